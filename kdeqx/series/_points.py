"""The Cauchy product `Y = W P` of two truncated matrix series, by evaluating them at
points on circles and interpolating: `O(K)` matrix products instead of `O(K^2)`.

`Y(s) = W(s) P(s)` is a polynomial of degree `2K`, so its values at the `N = 2K + 1`
points `s_j = rho w^j` (`w = exp(2 pi i / N)`) determine it: coefficient `m` is
`rho^-m / N sum_j Y(s_j) w^(-jm)`, exactly, for one product per point. Where the
terms pair up as adjoints (`W = B^H`, `P = A B`, `A` Hermitian), `Y(conj(s)) =
Y(s)^H` and the points `j = 0..K` suffice.

The rounding error of coefficient `m` is then about `eps G_W(rho) G_P(rho) /
rho^m`, where `G(rho) = sum_a |W[a]| rho^a` bounds the series on the circle, against
`eps g_m`, `g_m = sum_a |W[a]| |P[m - a]|`, for the direct sum. Their ratio, the
*loss*, is at least one and close to it (a few bits) for the radius that suits `m`,
so each circle serves a band of coefficients. The radii are chosen at run time from
the coefficients' exponents, the fewest that serve every coefficient within
[`LOSS_BITS`][] (see [`circles`][]). A coefficient no circle serves (a tiny one
between large neighbours), or one cheaper to sum than a circle's products (the
lowest), is summed directly.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Complex, Float, Int, Real

from .._backend import complex_factors, complex_product, FULL_PRECISION
from ._scaled import normalised, powers_of_two, Scaled, ZERO_EXPONENT


# The most bits of accuracy a circle may lose against the direct sum, for each
# coefficient it serves; and the most circles, past which the rest are summed
# directly (coefficients that decay as a propagator's, `h^k / k!`, take 3 circles at
# K = 100, 5-7 at K = 200-300, 10 at K = 500).
LOSS_BITS = 8.0
MAX_CIRCLES = 16
# Radii `2**r` with `r` on a grid of eighths (`a r` stays exact) in `[-32, 32]`; a
# radius off the best by `2**(1/16)` loses 0.7 bits at m = 500, a quarter step's
# `2**(1/8)` 2.9 bits.
RADIUS_STEP = 0.125
RADIUS_BOUND = 32.0


def weighted_sums(
    weights: Complex[Array, "J L"],
    planes: Real[Array, "L 2 n n"],
    along_rows: bool = False,
) -> Complex[Array, "J n n"]:
    """`sum_i weights[:, i] x[i]` for `x` stored as real and imaginary planes: one
    real matrix product, which on the CPU runs at memory speed where the complex
    one (a `J x L` by `L x n^2` product) takes several times as long.

    `along_rows`: as products summed along the rows instead, with no contraction.
    A TPU lays a contraction's rows out inside its tiles, so a scan that writes one
    row a step into the planes it sums rewrites all of them in each step; summed
    along the rows, the planes keep one row after another."""
    if along_rows:
        wr, wi = weights.real[..., None, None], weights.imag[..., None, None]
        re, im = planes[None, :, 0], planes[None, :, 1]
        by_real = jnp.sum(wr * re - wi * im, axis=1)
        return lax.complex(by_real, jnp.sum(wr * im + wi * re, axis=1))
    count = weights.shape[0]
    real_weights = jnp.concatenate([weights.real, weights.imag])
    parts = jnp.tensordot(real_weights, planes, 1, precision=FULL_PRECISION)
    by_real, by_imag = parts[:count], parts[count:]
    return lax.complex(by_real[:, 0] - by_imag[:, 1], by_real[:, 1] + by_imag[:, 0])


def planes_of(x: Complex[Array, "*batch n n"]) -> Real[Array, "*batch 2 n n"]:
    """The real and imaginary planes of matrices `x`, side by side before the
    matrix axes."""
    return jnp.stack([x.real, x.imag], axis=-3)


def adjoint(x: Array) -> Array:
    return jnp.conj(jnp.swapaxes(x, -1, -2))


class PlaneSeries(eqx.Module):
    """A series in scaled form whose mantissas are kept as real and imaginary planes,
    as the evaluations at points read them. With `adjoint`, the series is that of
    the planes' adjoints: `W = V^H` read from `V`'s own planes, never stored. The
    planes may hold rows past the last exponent's (a scan's slack row), unread."""

    planes: Real[Array, "rows 2 n n"]
    exponent: Int[Array, " L"]
    adjoint: bool = eqx.field(static=True, default=False)

    @staticmethod
    def of(series: "Scaled | PlaneSeries") -> "PlaneSeries":
        if isinstance(series, PlaneSeries):
            return series
        return PlaneSeries(planes_of(series.mantissa), series.exponent)

    @property
    def dtype(self):
        return jnp.promote_types(self.planes.dtype, jnp.complex64)

    def row(self, a: Int[Array, ""]) -> Complex[Array, "n n"]:
        """The mantissa of coefficient `a`."""
        x = lax.complex(self.planes[a, 0], self.planes[a, 1])
        return adjoint(x) if self.adjoint else x


def _log2_sum(x: Float[Array, "..."], axis: int) -> Float[Array, "..."]:
    """`log2(sum 2**x)` along `axis`, with `-inf` for an empty sum."""
    top = jnp.max(x, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0)
    total = jnp.sum(jnp.exp2(x - top), axis=axis)
    return jnp.squeeze(top, axis) + jnp.log2(total)


def _sizes(exponent: Int[Array, " L"]) -> Float[Array, " L"]:
    """`log2` of a coefficient's size, `-inf` for zero."""
    return jnp.where(exponent <= ZERO_EXPONENT, -jnp.inf, exponent.astype(jnp.float32))


def losses(
    left: Int[Array, " L"], right: Int[Array, " L"], radii: Float[Array, " G"]
) -> tuple[Float[Array, "L G"], Bool[Array, " L"]]:
    """The loss in bits of each coefficient `m` (rows) on the circle of radius
    `2**radii[g]` (columns), from the exponents of `W` and `P`; and which
    coefficients are exactly zero (every term is), which need no circle."""
    length = left.shape[0]
    a = jnp.arange(length, dtype=jnp.float32)
    size_l, size_r = _sizes(left), _sizes(right)
    on_circle = _log2_sum(size_l + a * radii[:, None], axis=1) + _log2_sum(
        size_r + a * radii[:, None], axis=1
    )
    m = a[:, None]
    # Term `(m, a)` is `left[a] right[m - a]`; there are none for `a > m`.
    later = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    pairs = size_l[None, :] + jnp.where(
        later >= 0, size_r[jnp.maximum(later, 0)], -jnp.inf
    )
    direct = _log2_sum(pairs, axis=1)
    zero = ~jnp.isfinite(direct)
    loss = on_circle[None, :] - m * radii[None, :] - jnp.where(zero, 0, direct)[:, None]
    return jnp.where(zero[:, None], 0.0, loss), zero


def circles(
    loss: Float[Array, "L G"],
    pending: Bool[Array, " L"],
    count: int,
    paired: bool | Bool[Array, ""],
) -> tuple[Int[Array, " C"], Bool[Array, " C"]]:
    """Up to `count` radii (indices into the grid) that serve the `pending`
    coefficients, and which are used (a prefix).

    A coefficient's loss is convex in `log2` of the radius (a log-sum-exp of linear
    functions, less a linear one), so the radii that serve it form an interval.
    Each circle takes the largest lower end among the pending intervals, which
    serves every interval that holds it: whatever radius serves the interval with
    that lower end, moved down to it, serves no fewer, so this takes the fewest
    circles that serve them all. A circle costs a
    product per point, so it is drawn only while the coefficients left would cost
    more products summed directly."""
    good = loss <= LOSS_BITS
    grid = loss.shape[1]
    lowest = jnp.argmax(good, axis=1)
    highest = grid - 1 - jnp.argmax(good[:, ::-1], axis=1)
    m = jnp.arange(loss.shape[0])
    direct_cost = jnp.where(paired, m // 2 + 1, m + 1)
    circle_cost = jnp.where(paired, 1, 2) * loss.shape[0]

    def choose(pending, _):
        index = jnp.max(jnp.where(pending, lowest, 0))
        used = jnp.sum(jnp.where(pending, direct_cost, 0)) > circle_cost
        served = (lowest <= index) & (index <= highest)
        return pending & ~(used & served), (index, used)

    _, (indices, used) = lax.scan(choose, pending, None, length=count)
    return indices, used


def _angles(
    rows: Int[Array, " rows"], columns: Int[Array, " columns"], points: int, dtype
) -> Real[Array, "rows columns"]:
    """`2 pi (j a mod N) / N` at `(rows[j], columns[a])`: reduced exactly before
    rounding."""
    turns = (rows[:, None] * columns[None, :]) % points
    return (2 * np.pi / points) * turns.astype(dtype)


def _sizes_on_circle(
    exponent: Int[Array, " L"], radius: Float[Array, ""], dtype
) -> Float[Array, " L"]:
    """`log2 |x[a]| 2**(radius a)`, up to a bit: the terms' sizes on the circle."""
    length = exponent.shape[0]
    return exponent.astype(dtype) + jnp.arange(length, dtype=dtype) * radius


def _evaluation(
    sizes: Float[Array, " L"], rows: Int[Array, " J"]
) -> Complex[Array, "J L"]:
    """The weights `2**(sizes[a] - max(sizes)) w^(ja)` that take the mantissas of a
    series to its values at the points `s_j = 2**radius w^j`, `j` in `rows`,
    divided by its largest term on the circle."""
    length = sizes.shape[0]
    angles = _angles(rows, jnp.arange(length), 2 * length - 1, sizes.dtype)
    scale = jnp.exp2(sizes - jnp.max(sizes))
    return lax.complex(jnp.cos(angles), jnp.sin(angles)) * scale


def _values_as_factors(
    weights: Complex[Array, "J L"], series: PlaneSeries, backend: str
) -> Array:
    """`sum_a weights[:, a] x[a]`, prepared for [`complex_product`][
    kdeqx._backend.complex_product]. On the CPU the three parts of Gauss's trick
    come straight out of one real product with the planes, with no complex array
    in between (each pass over memory costs as much as the product).

    For an `adjoint` series, `W(s) = V(conj s)^H`: the values of `V` at the
    conjugate points, whose CPU parts are left transposed for
    [`_interpolated`][] to contract along their rows."""
    planes = series.planes
    if series.adjoint:
        weights = jnp.conj(weights)
    if backend != "cpu":
        values = weighted_sums(_padded_terms(weights, planes.shape[0], 1), planes)
        return complex_factors(adjoint(values) if series.adjoint else values, backend)
    wr, wi = weights.real, weights.imag
    # Columns `(a, plane)`: the real part, the imaginary part, and their sum; of
    # `A^H = A_re^T - i A_im^T`, the transposes of `A_re`, `-A_im` and their sum.
    if series.adjoint:
        parts = [(wr, -wi), (-wi, -wr), (wr - wi, -wi - wr)]
    else:
        parts = [(wr, -wi), (wi, wr), (wr + wi, wr - wi)]
    by_part = jnp.stack([jnp.stack(part, axis=-1) for part in parts])
    count, length, n = weights.shape[0], planes.shape[0], planes.shape[-1]
    # Rows past the series' own, if any, weighted by zeros.
    by_part = _padded_terms(by_part, length, axis=2)
    matrix = by_part.reshape(3 * count, 2 * length)
    planes = planes.reshape(2 * length, n, n)
    values = jnp.tensordot(matrix, planes, 1, precision=FULL_PRECISION)
    return values.reshape(3, count, n, n)


def _padded_terms(weights: Array, length: int, axis: int) -> Array:
    """`weights` followed by zeros up to `length` terms along `axis`."""
    widths = [(0, 0)] * weights.ndim
    widths[axis] = (0, length - weights.shape[axis])
    return jnp.pad(weights, widths)


def _interpolated(
    weights: Complex[Array, "L J"],
    w: Array,
    p: Array,
    backend: str,
    w_transposed: bool = False,
) -> Complex[Array, "L n n"]:
    """`sum_j weights[:, j] y_j` for the products `y_j = w_j p_j` of prepared
    factors (on the CPU, `w_transposed`: `w`'s parts are stored transposed). On the
    CPU the weights act on the three parts of Gauss's trick, `ac`, `bd` and
    `(a + b)(c + d)`, before they are combined."""
    numbers = (((2,), (1,)), ((0,), (0,)))
    if backend != "cpu":
        return weighted_sums(
            weights, planes_of(complex_product(w, p, numbers, backend))
        )
    numbers = (((2 if w_transposed else 3,), (2,)), ((0, 1), (0, 1)))
    parts = lax.dot_general(w, p, numbers, FULL_PRECISION)
    gr, gi = weights.real, weights.imag
    # y = (ac - bd) + i (total - ac - bd); rows (m, plane), columns (part, j).
    by_plane = jnp.stack(
        [
            jnp.stack([gr + gi, gi - gr, -gi]),
            jnp.stack([gi - gr, -gr - gi, gr]),
        ]
    )
    length, count, n = weights.shape[0], weights.shape[1], w.shape[-1]
    matrix = jnp.moveaxis(by_plane, 2, 0).reshape(2 * length, 3 * count)
    parts = parts.reshape(3 * count, n, n)
    sums = jnp.tensordot(matrix, parts, 1, precision=FULL_PRECISION)
    sums = sums.reshape(length, 2, n, n)
    return lax.complex(sums[:, 0], sums[:, 1])


def _on_circle(
    left: PlaneSeries,
    right: PlaneSeries,
    radius: Float[Array, ""],
    paired: bool | Bool[Array, ""],
    backend: str,
) -> Scaled:
    """All coefficients of `Y = W P` from its values on the circle of radius
    `2**radius`: at the points `j = 0..K`, and where not `paired` at `K + 1..2K`
    too, in a second pass of the same program."""
    length = left.exponent.shape[0]
    points = 2 * length - 1
    real_dtype = left.planes.dtype
    w_sizes = _sizes_on_circle(left.exponent, radius, real_dtype)
    p_sizes = _sizes_on_circle(right.exponent, radius, real_dtype)
    # Coefficient m is 2**(w_top + p_top - m radius) / N sum_j y_j w^(-jm), where
    # the values were divided by 2**w_top and 2**p_top.
    top = jnp.max(w_sizes) + jnp.max(p_sizes)
    scale = top - jnp.arange(length, dtype=real_dtype) * radius
    whole = jnp.floor(scale)

    def pass_terms(rows):
        w = _values_as_factors(_evaluation(w_sizes, rows), left, backend)
        p = _values_as_factors(_evaluation(p_sizes, rows), right, backend)
        angles = -_angles(jnp.arange(length), rows, points, real_dtype)
        # The points j > K are, where paired, the adjoints of those j < N - K:
        # S + S^H, with the real point j = 0 at half weight. Row N of the second
        # pass repeats point 0.
        share = jnp.where(paired & (rows == 0), 0.5, 1.0) * (rows < points) / points
        weights = lax.complex(jnp.cos(angles), jnp.sin(angles)) * share
        return weights * jnp.exp2(scale - whole)[:, None], w, p

    def interpolated(rows):
        return _interpolated(*pass_terms(rows), backend, left.adjoint)

    def one_pass(i, total):
        return total + interpolated(i * length + jnp.arange(length))

    if isinstance(paired, bool):  # known in advance: one pass of the points needed
        total = interpolated(jnp.arange(length if paired else points))
    else:
        passes = jnp.where(paired, 1, 2)
        shape = (length,) + left.planes.shape[-2:]
        total = lax.fori_loop(0, passes, one_pass, jnp.zeros(shape, left.dtype))
    total = jnp.where(paired, total + adjoint(total), total)
    return normalised(total, whole.astype(jnp.int32))


def largest_terms(left: Int[Array, " L"], right: Int[Array, " L"]) -> Int[Array, " L"]:
    """The exponent of the largest term `left[a] right[m - a]` of each coefficient
    `m` of a Cauchy product, from its operands' exponents (`ZERO_EXPONENT` where all
    are zero): the scale its terms are summed at."""
    a = jnp.arange(left.shape[0])[:, None]
    m = jnp.arange(left.shape[0])[None, :]
    terms = left[:, None] + right[jnp.maximum(m - a, 0)]
    top = jnp.max(jnp.where(m >= a, terms, ZERO_EXPONENT), axis=0)
    return jnp.maximum(top, ZERO_EXPONENT)


def _summed_directly(
    left: PlaneSeries,
    right: PlaneSeries,
    rows: Bool[Array, " L"],
    paired: bool | Bool[Array, ""],
    backend: str,
    into: Scaled,
) -> Scaled:
    """`into` with coefficients `rows` of `Y = W P` replaced by sums of their terms,
    one product each, scaled relative to the largest. Where `paired`, only the terms
    `a <= m - a` are computed, and the row is `S + S^H`."""
    length = left.exponent.shape[0]
    index = jnp.arange(length)
    real_dtype = left.planes.dtype

    def next_row(after):
        return jnp.min(jnp.where(rows & (index > after), index, length))

    tops = largest_terms(left.exponent, right.exponent)

    def step(state):
        y, row, m, a = state
        lhs = complex_factors(left.row(a), backend)
        rhs = complex_factors(right.row(m - a), backend)
        product = complex_product(lhs, rhs, (((1,), (0,)), ((), ())), backend)
        exponent = jnp.maximum(left.exponent[a] + right.exponent[m - a], ZERO_EXPONENT)
        top = tops[m]
        half = jnp.where(paired & (2 * a == m), 0.5, 1.0)
        row = row + (powers_of_two(exponent - top, real_dtype) * half) * product
        done = a + 1 > jnp.where(paired, m // 2, m)

        # A finished row is written (a cheap select on one row), and a new one
        # starts from zero.
        finished = normalised(jnp.where(paired, row + adjoint(row), row), top)
        y = y.with_row(
            m, jax.tree.map(lambda f, o: jnp.where(done, f, o), finished, y[m])
        )
        row = jnp.where(done, 0, row)
        return y, row, jnp.where(done, next_row(m), m), jnp.where(done, 0, a + 1)

    zero = jnp.zeros((), jnp.int32)
    start = (into, jnp.zeros(left.planes.shape[-2:], left.dtype), next_row(-1), zero)
    y, _, _, _ = lax.while_loop(lambda s: s[2] < length, step, start)
    return y


def cauchy_product_at_points(
    left: Scaled | PlaneSeries,
    right: Scaled | PlaneSeries,
    paired: bool | Bool[Array, ""] = False,
    backend: str | None = None,
) -> Scaled:
    """`Y[m] = sum_a left[a] @ right[m - a]` for `m = 0..K`, from the values of both
    series at `2K + 1` points on each of a few circles (`K + 1` where `paired`: the
    terms `(a, m - a)` and `(m - a, a)` are adjoints), within [`LOSS_BITS`][] of the
    direct sum's accuracy for every coefficient."""
    backend = jax.default_backend() if backend is None else backend
    left, right = PlaneSeries.of(left), PlaneSeries.of(right)
    length = left.exponent.shape[0]
    radii = jnp.arange(-RADIUS_BOUND, RADIUS_BOUND + RADIUS_STEP / 2, RADIUS_STEP)
    loss, zero = losses(left.exponent, right.exponent, radii)
    loss, zero = lax.stop_gradient(loss), lax.stop_gradient(zero)
    reachable = jnp.any(loss <= LOSS_BITS, axis=1)
    indices, used = circles(loss, reachable & ~zero, MAX_CIRCLES, paired)
    # Each coefficient takes the circle that loses least for it.
    losses_used = jnp.where(used[None, :], loss[:, indices], jnp.inf)
    circle_of = jnp.argmin(losses_used, axis=1)
    served = (jnp.min(losses_used, axis=1) <= LOSS_BITS) & ~zero
    real_dtype = left.planes.dtype

    def circle(i, y):
        radius = radii[indices[i]].astype(real_dtype)
        on_circle = _on_circle(left, right, radius, paired, backend)
        mine = served & (circle_of == i)
        return Scaled(
            jnp.where(mine[:, None, None], on_circle.mantissa, y.mantissa),
            jnp.where(mine, on_circle.exponent, y.exponent),
        )

    shape = (length,) + left.planes.shape[-2:]
    start = Scaled(
        jnp.zeros(shape, left.dtype), jnp.full((length,), ZERO_EXPONENT, jnp.int32)
    )
    y = lax.fori_loop(0, jnp.sum(used), circle, start)
    return _summed_directly(left, right, ~served & ~zero, paired, backend, y)
