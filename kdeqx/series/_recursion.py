"""The Heisenberg recursion: the normalised Taylor coefficients `X_k(t) / k!` from
those of the generator `H` and the observable `X_0`.

Why this works. Let `V(s)` solve `V' = -i H(t + s) V`, `V(0) = I`, and `W = V⁻¹`,
which solves `W' = i W H(t + s)`, `W(0) = I`. Then `Y(s) = W(s) X_0(t + s) V(s)` has
`Y' = W (i[H, X_0] + X_0') V`, and by induction `Y^(k)(0) = X_k(t)`. So the normalised
Taylor coefficients of `Y` are exactly `X_k(t) / k!`.

The work. One `lax.scan` over the order computes the coefficients of `V`, `W` and
`P = X_0 V`; one more gives `Y = W P`, a Cauchy product. A generator given by its
coefficients (the general path) makes each step of the first scan a Cauchy sum of
`K + 2` matrix products; a generator `sum_l c_l(s) M_l` of `J` factored terms makes it
`J` products after sums weighted by scalars. The Cauchy product costs about
`K^2 / 2` matrix products either way, or, for a factored generator where that is
large, a few times `K` from the values of `W` and `P` at points on circles
(`_points.py`). No loop's body
depends on `K`, so the compiled program does not grow with the order.
"""

import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Complex, Inexact, Int, Real

from .._backend import complex_factors, complex_product, FULL_PRECISION
from ._points import (
    adjoint,
    cauchy_product_at_points,
    largest_terms,
    planes_of,
    PlaneSeries,
    weighted_sums,
)
from ._scaled import normalised, powers_of_two, Scaled, ZERO_EXPONENT, zeros


def _padded(coefficients: Array, length: int, value: int = 0) -> Array:
    """`coefficients` (order first) followed by rows of `value` up to `length`."""
    missing = length - coefficients.shape[0]
    widths = [(0, missing)] + [(0, 0)] * (coefficients.ndim - 1)
    return jnp.pad(coefficients, widths, constant_values=value)


def _reversed_and_padded(coefficients: Array, axis: int) -> Array:
    """Coefficients `L - 1, ..., 0` along `axis`, then `L` zeros: the `L` entries from
    `L - 1 - m` are coefficients `m, m - 1, ..., 0` and then zeros, the window a
    Cauchy sum `sum_i a[m - i] b[i]` needs, as one dynamic slice with no mask."""
    flipped = jnp.flip(coefficients, axis=axis)
    return jnp.concatenate([flipped, jnp.zeros_like(flipped)], axis=axis)


def _window(reversed_: Array, m: Int[Array, ""], axis: int) -> Array:
    """Entry `i` along `axis` is coefficient `m - i` of a reversed and padded array."""
    length = reversed_.shape[axis] // 2
    return lax.dynamic_slice_in_dim(reversed_, length - 1 - m, length, axis)


def _all_diagonal(matrices: Array) -> Bool[Array, ""]:
    off_diagonal = ~jnp.eye(matrices.shape[-1], dtype=bool)
    return lax.stop_gradient(jnp.all(jnp.where(off_diagonal, matrices, 0) == 0))


def _all_hermitian(matrices: Array) -> Bool[Array, ""]:
    return lax.stop_gradient(jnp.all(matrices == adjoint(matrices)))


def _only_zeroth(reversed_: Array, axis: int) -> Bool[Array, ""]:
    """Whether coefficients laid out by [`_reversed_and_padded`][] along `axis` are
    zero past the zeroth (coefficient `j` sits at `L - 1 - j`)."""
    length = reversed_.shape[axis] // 2
    past_zeroth = lax.slice_in_dim(reversed_, 0, length - 1, axis=axis)
    return lax.stop_gradient(jnp.all(past_zeroth == 0))


def _weighted(weights: Array, x: Array) -> Array:
    """`sum_i weights[..., i] x[i]`."""
    return jnp.tensordot(weights, x, 1, precision=FULL_PRECISION)


# A matrix product contracting terms and columns at once, `sum_r A[r] @ B[r]`.
_SUM_OF_PRODUCTS = (((0, 2), (0, 1)), ((), ()))


# From this size on, the general path multiplies only the coefficients that can meet
# the generator's, rounded up to one of `PARTS` equal parts of the order (more parts
# run faster). Below, the extra product kernels cost more compile time than they
# save. See `benchmarks/operator_series.py`.
PARTS_FROM = 64
PARTS = 8


def _part_bounds(length: int) -> list[int]:
    """The ends of [`PARTS`][] equal parts of `length` coefficients, rounded up."""
    parts = min(PARTS, length)
    return [-(-length * (j + 1) // parts) for j in range(parts)]


def _part_of(m: Int[Array, ""], bounds: list[int]) -> Int[Array, ""]:
    """The first part that holds coefficients `0..m`: the first bound past `m`."""
    return jnp.sum(m >= jnp.asarray(bounds[:-1]))


def _real_sum_of_products(
    real: Real[Array, "L n n"], x: Complex[Array, "L n n"], real_first: bool
) -> Complex[Array, "n n"]:
    """`sum_r real[r] @ x[r]` (or `x[r] @ real[r]`) for real matrices `real`: the real
    and imaginary parts of `x` side by side, so one real product of twice the width,
    two-thirds of the work of a complex product by Gauss's trick."""
    n = x.shape[-1]
    if real_first:
        planes = jnp.concatenate([x.real, x.imag], axis=-1)
        both = lax.dot_general(real, planes, _SUM_OF_PRODUCTS, FULL_PRECISION)
        return lax.complex(both[:, :n], both[:, n:])
    planes = jnp.concatenate([x.real, x.imag], axis=-2)
    both = lax.dot_general(planes, real, _SUM_OF_PRODUCTS, FULL_PRECISION)
    return lax.complex(both[:n], both[n:])


def _prepared(matrices: Inexact[Array, "L n n"]) -> Array:
    """Matrices that take part in many products: real ones as they are, complex ones
    as [`kdeqx._backend.complex_factors`][]."""
    return matrices if not jnp.iscomplexobj(matrices) else complex_factors(matrices)


def _sum_of_products(
    prepared: Array, x: Complex[Array, "L n n"], real: bool, prepared_first: bool
) -> Complex[Array, "n n"]:
    """`sum_r M[r] @ x[r]` (or `x[r] @ M[r]`) for matrices `M` given by
    [`_prepared`][] (`real`: whether they were real)."""
    if real:
        return _real_sum_of_products(prepared, x, prepared_first)
    factors = complex_factors(x)
    pair = (prepared, factors) if prepared_first else (factors, prepared)
    return complex_product(*pair, _SUM_OF_PRODUCTS)


class DenseTerms(eqx.Module):
    """A generator (or observable) given by its coefficients, `G(t + s) = sum_j G[j]
    s^j`, every coefficient its own matrix: the general path. Coefficient `m` of `G X`
    is a sum of `L` products, `sum_i G[m - i] X[i]`.

    Real coefficients (by their dtype, as an MLP's output is) stay real, and their
    products with the complex `X` take two real products instead of three."""

    reversed: Scaled
    reversed_factors: Array

    @staticmethod
    def of(coefficients: Inexact[Array, "terms n n"], length: int) -> "DenseTerms":
        padded = _padded(coefficients, length)
        reversed_ = Scaled.of(_reversed_and_padded(padded, axis=0))
        return DenseTerms(reversed_, _prepared(reversed_.mantissa))

    @property
    def real_coefficients(self) -> bool:
        """Whether the coefficients are real by their dtype (an MLP's are)."""
        return not jnp.iscomplexobj(self.reversed.mantissa)

    def product(
        self, x: Scaled, m: Int[Array, ""], factor: Array, generator_first: bool
    ) -> Scaled:
        """`factor` times coefficient `m` of `G X` (or of `X G`), from the first `L`
        coefficients of `X`, each term scaled relative to the largest.

        Only `X[0..m]` meet a coefficient of `G` (the window is zero past them), so
        from [`PARTS_FROM`][] on only those are multiplied, rounded up to a part of
        the order: over the whole recursion, about `1/2 + 1/(2 PARTS)` of the
        products."""
        if x.mantissa.shape[-1] < PARTS_FROM:
            return self._product_of_first(x, m, factor, generator_first, None)
        bounds = _part_bounds(x.exponent.shape[0])
        branches = [
            ft.partial(self._product_of_first, x, m, factor, generator_first, rows)
            for rows in bounds
        ]
        return lax.switch(_part_of(m, bounds), branches)

    def _product_of_first(
        self, x: Scaled, m, factor, generator_first: bool, rows: int | None
    ) -> Scaled:
        """The terms `G[m - i] X[i]` of [`DenseTerms.product`][] for `i < rows`."""
        x = x[:rows]
        window = _window(self.reversed.exponent, m, axis=0)[:rows]
        exponents = jnp.maximum(window + x.exponent, ZERO_EXPONENT)
        top = jnp.max(exponents)
        weights = powers_of_two(exponents - top, x.mantissa.real.dtype) * factor
        generator = _window(self.reversed_factors, m, axis=-3)[..., :rows, :, :]
        weighted = x.mantissa * weights[:, None, None]
        total = _sum_of_products(
            generator, weighted, self.real_coefficients, generator_first
        )
        return normalised(total, top)

    def hermitian(self) -> Bool[Array, ""]:
        """Whether every coefficient is exactly Hermitian: `G(t + s)` is, for real
        `s`."""
        return _all_hermitian(self.reversed.mantissa)

    def constant(self) -> Bool[Array, ""]:
        """Whether every coefficient past the zeroth is zero."""
        return _only_zeroth(self.reversed.mantissa, axis=0)


# From this size on, diagonal factored matrices scale rather than multiply, which
# runs faster; below, the products are cheap and the check's branch costs compile
# time that small first calls notice. See `benchmarks/operator_series.py`.
DIAGONAL_FROM = 128


class FactoredTerms(eqx.Module):
    """A generator of the form `G(t + s) = sum_l c_l(s) M_l`: `J` scalar series times
    constant matrices (`H0 + cos(t) H1`, say). Coefficient `m` of `G X` is
    `sum_l M_l (sum_i c_l[m - i] X[i])`: sums weighted by scalars, then `J` products
    with matrices prepared once. Real matrices (by their dtype, as those of most spin
    Hamiltonians are) stay real, and take two real products instead of three."""

    scalars: Scaled
    matrices: Scaled
    matrix_factors: Array
    diagonal: Bool[Array, ""] | bool
    real_scalars: bool = eqx.field(static=True)
    constant_last: bool = eqx.field(static=True)

    @staticmethod
    def of(
        scalars: Complex[Array, "J terms"],
        matrices: Inexact[Array, "J n n"],
        length: int,
        real_scalars: bool = False,
        constant_last: bool = False,
    ) -> "FactoredTerms":
        """`real_scalars`: whether the scalar functions are known to be real (their
        dtype was), which [`FactoredTerms.hermitian`][] then need not check;
        `constant_last`: whether the last term is known to be constant (its scalar
        series one, then zeros), whose sums then need no pass over `X`."""
        padded = _padded(scalars.T, length).T
        matrices_ = Scaled.of(matrices)
        return FactoredTerms(
            Scaled.of(_reversed_and_padded(padded, axis=1), core=0),
            matrices_,
            _prepared(matrices_.mantissa),
            _all_diagonal(matrices) if matrices.shape[-1] >= DIAGONAL_FROM else False,
            real_scalars,
            constant_last,
        )

    @property
    def real_matrices(self) -> bool:
        """Whether the constant matrices are real by their dtype."""
        return not jnp.iscomplexobj(self.matrices.mantissa)

    def hermitian(self) -> Bool[Array, ""]:
        """Whether `G(t + s)` is exactly Hermitian for real `s`: Hermitian matrices
        times real scalar functions. Checked on the constant matrices alone when the
        scalars are real by their dtype, so that under `vmap` over `t` the answer is
        not batched."""
        hermitian = _all_hermitian(self.matrices.mantissa)
        if self.real_scalars:
            return hermitian
        return hermitian & jnp.all(self.scalars.mantissa.imag == 0)

    def constant(self) -> Bool[Array, ""]:
        """Whether every scalar coefficient past the zeroth is zero."""
        return _only_zeroth(self.scalars.mantissa, axis=1)

    def weights(
        self, x: Scaled, m: Int[Array, ""], factor: Array
    ) -> tuple[Complex[Array, "J L"], Int[Array, ""]]:
        """`factor c_l[m - i]` at `(l, i)`, with every term `c_l[m - i] M_l X[i]`
        scaled relative to the largest, whose exponent comes second: the matrices
        are then used as prepared."""
        c = jax.tree.map(lambda a: _window(a, m, axis=1), self.scalars)
        exponents = c.exponent + x.exponent + self.matrices.exponent[:, None]
        exponents = jnp.maximum(exponents, ZERO_EXPONENT)
        top = jnp.max(exponents)
        real_dtype = x.mantissa.real.dtype
        scale = powers_of_two(exponents - top, real_dtype)
        return c.mantissa * factor * scale, top

    def finish(
        self, sums: Complex[Array, "J n n"], top: Int[Array, ""], generator_first: bool
    ) -> Scaled:
        """`sum_l M_l sums[l]` (or `sum_l sums[l] M_l`), times `2**top`.

        Where every `M_l` is diagonal (checked exactly, at run time), as observables
        such as `sigma_z` or a number operator are, they scale the rows (or columns)
        of the sums instead: no matrix products."""

        def by_products():
            return _sum_of_products(
                self.matrix_factors, sums, self.real_matrices, generator_first
            )

        def by_diagonals():
            diagonals = jnp.diagonal(self.matrices.mantissa, axis1=-2, axis2=-1)
            diagonals = diagonals[..., None] if generator_first else diagonals[:, None]
            return jnp.sum(diagonals * sums, axis=0)

        if self.diagonal is False:
            return normalised(by_products(), top)
        return normalised(lax.cond(self.diagonal, by_diagonals, by_products), top)

    def product(
        self, x: Scaled, m: Int[Array, ""], factor: Array, generator_first: bool
    ) -> Scaled:
        """`factor` times coefficient `m` of `G X` (or of `X G`). A constant last term
        (`H0`, or a constant observable's only one) meets `X[m]` alone: its sum needs
        no pass over the other coefficients."""
        weights, top = self.weights(x, m, factor)
        if self.constant_last:
            others = _weighted(weights[:-1], x.mantissa)
            constant = weights[-1:, m, None, None] * x.mantissa[m]
            sums = jnp.concatenate([others, constant])
        else:
            sums = _weighted(weights, x.mantissa)
        return self.finish(sums, top, generator_first)


Terms = DenseTerms | FactoredTerms


# From this size on, the sums weighted by factored terms read `V` as real planes: the
# real `J x L` by `L x n^2` product is several times faster than the complex one;
# below, the planes' upkeep costs more compile time than the sums save.
PLANES_FROM = 128
# Backends whose propagators sum `V`'s planes along the rows rather than by a
# contraction (`weighted_sums`' `along_rows`): on a TPU the scan runs markedly
# faster and compiles sooner; on the CPU the contraction is the faster. On those
# backends, from `SUMS_IN_PARTS_FROM` on, a step sums only the rows that can have
# weights, up to its own, rounded up to one of `PARTS` parts of the order, each a
# branch; below, the branches cost more than they save (`benchmarks/series_sums.py`).
SUMS_ALONG_ROWS_ON = ("tpu",)
SUMS_IN_PARTS_FROM = 1024


def _sums_of_rows(
    weights: Complex[Array, "J L"], planes: Real[Array, "L 2 n n"], m: Int[Array, ""]
) -> Complex[Array, "J n n"]:
    """`weighted_sums` of `V`'s planes, whose rows past `m` have zero weights (they
    are not yet computed): on the backends of `SUMS_ALONG_ROWS_ON`, along the rows,
    and from `SUMS_IN_PARTS_FROM` on, over the rows up to `m`'s part alone."""
    if jax.default_backend() not in SUMS_ALONG_ROWS_ON:
        return weighted_sums(weights, planes)
    if planes.shape[-1] < SUMS_IN_PARTS_FROM:
        return weighted_sums(weights, planes, along_rows=True)
    bounds = _part_bounds(planes.shape[0])
    branches = [
        ft.partial(weighted_sums, weights[:, :rows], planes[:rows], True)
        for rows in bounds
    ]
    return lax.switch(_part_of(m, bounds), branches)


def _sums_sparing_constants(
    weights: Complex[Array, "J L"],
    planes: Real[Array, "L 2 n n"],
    m: Int[Array, ""],
    current: Complex[Array, "n n"],
    constant_rows: tuple[int, ...],
) -> Complex[Array, "J n n"]:
    """`weighted_sums`, where the rows `constant_rows` belong to constant terms:
    their only nonzero weight is that of `x[m]` (`current`), so they scale it and the
    pass over every `x[i]` serves the other rows alone. For `H0 + cos(t) H1` with a
    constant `X_0` that is two real rows of weights instead of six: the sums
    themselves run markedly faster, the whole series a little faster at moderate `n`
    (see `benchmarks/operator_series.py`)."""
    count = weights.shape[0]
    others = [row for row in range(count) if row not in constant_rows]
    by_row = {row: weights[row, m] * current for row in constant_rows}
    if others:
        summed = _sums_of_rows(weights[jnp.asarray(others)], planes, m)
        by_row.update(zip(others, summed))
    return jnp.stack([by_row[row] for row in range(count)])


def _matrices(terms: Terms) -> Array:
    """Some of the generator's matrices, for their size and dtype."""
    if isinstance(terms, DenseTerms):
        return terms.reversed.mantissa
    return terms.matrices.mantissa


def _propagators(
    hamiltonian: Terms,
    observable: Terms,
    order: int,
    unitary: bool | Bool[Array, ""] = False,
    as_planes: bool = False,
) -> tuple[Scaled | PlaneSeries, Scaled | PlaneSeries]:
    """Normalised Taylor coefficients `0..K` of `W = V⁻¹` and of `P = X_0 V`.

    Step `k` of one scan computes, from coefficients already known,

    - `V[k] = -i/k (H V)[k - 1]`     (from `V' = -i H V`),
    - `W[k] =  i/k (W H)[k - 1]`     (from `W' = i W H`), or `V[k]^H` where `unitary`
      (a Hermitian `H` makes `V` unitary),
    - `P[k - 1] = (X_0 V)[k - 1]`.

    `P` lags one step, so the scan runs to `K + 1`, with one slack row. From
    [`PLANES_FROM`][] on, a factored generator and observable read `V` as real and
    imaginary planes, for their weighted sums, and `V` is kept as those alone.
    There, `as_planes` (for the product at points, which reads planes) returns `P`
    as planes too, and where `unitary` is known in advance, `W` as `V`'s planes
    read as their adjoints: no series of `W` is stored or copied.
    """
    length = order + 2
    n = _matrices(observable).shape[-1]
    # Real dense coefficients stay real; the propagators are complex.
    dtype = jnp.promote_types(_matrices(observable).dtype, jnp.complex64)
    identity = Scaled(0.5 * jnp.eye(n, dtype=dtype), jnp.asarray(1, jnp.int32))
    start = zeros((length, n, n), dtype).with_row(jnp.asarray(0), identity)
    both_factored = isinstance(hamiltonian, FactoredTerms) and isinstance(
        observable, FactoredTerms
    )
    use_planes = both_factored and n >= PLANES_FROM
    as_planes = as_planes and use_planes
    # `W = V^H` read from `V`'s planes: no `W` in the scan.
    w_from_planes = as_planes and unitary is True
    constant_rows = ()
    if use_planes:
        assert isinstance(hamiltonian, FactoredTerms)
        assert isinstance(observable, FactoredTerms)
        # The rows of the constant terms (`H0`, a constant `X_0`) in the weights.
        h_count = hamiltonian.matrices.exponent.shape[0]
        x_count = observable.matrices.exponent.shape[0]
        constant_rows = (h_count - 1,) * hamiltonian.constant_last + (
            h_count + x_count - 1,
        ) * observable.constant_last

    def step(carry, k):
        v, planes, w, latest = carry
        m = k - 1
        step_factor = (1 / k.astype(jnp.finfo(dtype).dtype)).astype(dtype)
        one = jnp.ones((), dtype)
        if both_factored:
            assert isinstance(hamiltonian, FactoredTerms)
            assert isinstance(observable, FactoredTerms)
            # Both weight V's rows: one pass over V for the two.
            h_weights, h_top = hamiltonian.weights(v, m, -1j * step_factor)
            x_weights, x_top = observable.weights(v, m, one)
            weights = jnp.concatenate([h_weights, x_weights])
            count = h_weights.shape[0]
            if use_planes:
                sums = _sums_sparing_constants(
                    weights, planes, m, latest, constant_rows
                )
            else:
                sums = _weighted(weights, v.mantissa)
            new_v = hamiltonian.finish(sums[:count], h_top, generator_first=True)
            new_p = observable.finish(sums[count:], x_top, generator_first=True)
        else:
            new_v = hamiltonian.product(v, m, -1j * step_factor, generator_first=True)
            new_p = observable.product(v, m, one, generator_first=True)

        def inverse_by_adjoint():
            return Scaled(adjoint(new_v.mantissa), new_v.exponent)

        def inverse_by_products():
            return hamiltonian.product(w, m, 1j * step_factor, generator_first=False)

        if isinstance(unitary, bool):  # known in advance: one branch in the program
            if not w_from_planes:
                new_w = inverse_by_adjoint() if unitary else inverse_by_products()
                w = w.with_row(k, new_w)
        else:
            w = w.with_row(
                k, lax.cond(unitary, inverse_by_adjoint, inverse_by_products)
            )
        if use_planes:
            new_planes = planes_of(new_v.mantissa)
            planes = lax.dynamic_update_index_in_dim(planes, new_planes, k, 0)
            # V's mantissas live in its planes alone; its exponents are kept here.
            exponent = lax.dynamic_update_index_in_dim(v.exponent, new_v.exponent, k, 0)
            v = Scaled(v.mantissa, exponent)
            latest = new_v.mantissa
        else:
            v = v.with_row(k, new_v)
        p_rows = planes_of(new_p.mantissa) if as_planes else new_p.mantissa
        return (v, planes, w, latest), (p_rows, new_p.exponent)

    v, planes, latest = start, None, None
    if use_planes:
        real_dtype = jnp.finfo(dtype).dtype
        half = identity.mantissa.real.astype(real_dtype)
        planes = jnp.zeros((length, 2, n, n), real_dtype).at[0, 0].set(half)
        # No complex copy of V's coefficients: 16 n^2 (K + 2) bytes fewer.
        v = Scaled(jnp.zeros((length, 0, 0), dtype), start.exponent)
        # The newest coefficient's mantissa, for the constant terms. Read from the
        # planes, which the step then updates, it made XLA copy them every step.
        latest = identity.mantissa
    carry = (v, planes, None if w_from_planes else start, latest)
    (v, planes, w, _), outputs = lax.scan(step, carry, jnp.arange(1, length))
    p = PlaneSeries(*outputs) if as_planes else Scaled(*outputs)
    if w_from_planes:
        assert planes is not None
        # All of V's planes, the slack row unread: no copy of the others.
        return PlaneSeries(planes, v.exponent[: order + 1], adjoint=True), p
    assert w is not None
    return w[: order + 1], p


# Up to this size a first call of the series is mostly compiling, so it is compiled
# with `quick_start_options` (`_series._jit`; see `benchmarks/operator_series.py`).
QUICK_START_UP_TO = 128


def window_size(n: int) -> int:
    """Left terms per product in [`_cauchy_product`][], chosen by timing the product
    alone (`benchmarks/operator_series.py`). Wider windows save steps and copies of
    the right term but compute products past the last term: they pay for small
    matrices, and cost for large ones."""
    return 4 if n < 64 else 2 if n < 384 else 1


def _window_count(length: int, k: int) -> int:
    """How many windows of `k` left terms cover the pairs `(a, c)`, `a + c <= K`, of
    the general product (`K - c + 1` left terms for right term `c`)."""
    return int(np.sum((np.arange(length, 0, -1) + k - 1) // k))


def _window_products(lefts, rhs, a0, k: int, n: int, one_term):
    """The products of `k` left terms from `a0` (rows of the tall `lefts`) with
    `rhs`, as `(k n, n)` rows; a window of 2 that holds one term (`one_term`)
    computes only that one, the other rows zero."""

    def product(rows: int):
        lhs = lax.dynamic_slice_in_dim(lefts, a0 * n, rows * n, axis=-2)
        products = complex_product(lhs, rhs, (((1,), (0,)), ((), ())))
        missing = jnp.zeros(((k - rows) * n, n), products.dtype)
        return jnp.concatenate([products, missing])

    if k != 2:
        return product(k)
    return lax.cond(one_term, lambda: product(1), lambda: product(2))


def _cauchy_product(
    left: Scaled,
    right: Scaled,
    hermitian: bool | Bool[Array, ""] = False,
    window: int | None = None,
) -> Scaled:
    """`Y[m] = sum_a left[a] @ right[m - a]` for `m = 0..K`.

    For each right term `c`, windows of `k` consecutive left terms `a` (`window`, by
    default [`window_size`][]) are multiplied by it in one product: `left` is stored
    as one tall matrix, so a window is a block of its rows, and the product's `k`
    blocks are the terms of `Y[a + c], ..., Y[a + c + k - 1]`, added into those rows
    of the result after scaling each by an exact power of two relative to the
    largest term of its `Y[m]` (known in advance from the exponents), so that the
    terms add up directly. Scaling the products rather than an operand saves a pass
    over the operands, which XLA:CPU copies out of their arrays for every product.

    Where `hermitian` (`left[a] = B[a]^H` and `right[a] = A B[a]` with `A`
    Hermitian, as for `W = V^H`, `P = X_0 V`), the terms `(a, c)` and `(c, a)` are
    adjoints: only `a <= c` are computed (the middle term `a = c` at half weight)
    and `Y = S + S^H` from their sums `S`, half the products.
    """
    length, n = left.exponent.shape[0], left.mantissa.shape[-1]
    order = length - 1
    k = window_size(n) if window is None else window
    # `k` more rows, where the last window of a right term may reach.
    top = jnp.pad(largest_terms(left.exponent, right.exponent), (0, k))
    left_exponents = jnp.pad(left.exponent, (0, k), constant_values=ZERO_EXPONENT)
    lefts = complex_factors(_padded(left.mantissa, length + k))
    lefts = lefts.reshape(*lefts.shape[:-3], (length + k) * n, n)
    rights = complex_factors(right.mantissa)
    real_dtype = left.mantissa.real.dtype

    def step(state):
        total, c, a0 = state
        rhs = lax.dynamic_index_in_dim(rights, c, axis=-3, keepdims=False)
        a = a0 + jnp.arange(k)
        last = jnp.where(hermitian, jnp.minimum(c, order - c), order - c)
        products = _window_products(lefts, rhs, a0, k, n, a0 + 1 > last)
        exponents = lax.dynamic_slice_in_dim(left_exponents, a0, k) + right.exponent[c]
        exponents = jnp.maximum(exponents, ZERO_EXPONENT)
        exponents = exponents - lax.dynamic_slice_in_dim(top, a0 + c, k)
        half = jnp.where(hermitian & (a == c), 0.5, 1.0).astype(real_dtype)
        # Windows reach past the last term; those products (zero or, for windows
        # of more than 2, computed) must add nothing.
        weights = jnp.where(a <= last, powers_of_two(exponents, real_dtype) * half, 0)
        rows = lax.dynamic_slice_in_dim(total, a0 + c, k)
        rows = rows + weights[:, None, None] * products.reshape(k, n, n)
        total = lax.dynamic_update_slice_in_dim(total, rows, a0 + c, 0)
        next_c = a0 + k > last
        return total, jnp.where(next_c, c + 1, c), jnp.where(next_c, 0, a0 + k)

    first = jnp.zeros((), jnp.int32)
    state = (jnp.zeros((length + k, n, n), left.mantissa.dtype), first, first)
    if isinstance(hermitian, bool) and not hermitian:
        # A scan, which reverse-mode derivatives need: the general path.
        count = _window_count(length, k)
        state, _ = lax.scan(lambda s, _: (step(s), None), state, None, length=count)
    else:
        # The pairing, decided at run time, sets the number of windows.
        state = lax.while_loop(lambda s: s[1] <= order, step, state)
    total = state[0][:length]
    # Where the partners are adjoints, they are added once, at the end.
    total = jnp.where(hermitian, total + adjoint(total), total)
    return normalised(total, top[:length])


# The Cauchy product is computed from the series' values at points on a few circles
# (`kdeqx.series._points`), `O(K)` products instead of `O(K^2)`, where the direct
# one would cost at least `POINTS_FROM_WORK` multiply-adds (its `(K + 1)^2 / 4`
# products of `n^3`, paired): from n = 256 at K = 40, n = 1024 at K = 8. There it
# saves more per call than it adds to the compile, which it lengthens markedly;
# below, a call saves too little to repay that. See `benchmarks/operator_series.py`.
# Up to `QUICK_START_UP_TO` on the CPU, where a first call compiles for a quick
# start and the product at points adds less to it, it starts at
# `POINTS_FROM_WORK_SMALL` (n = 128 from K = 31, n = 64 from K = 90): there it saves
# more per call than it adds to a quick start, which stays shorter than the direct
# product's full compile (`benchmarks/operator_series.py`, sections 5 and 6).
# A TPU compiles the product at points for several times as long as the direct one
# and runs the direct one's products fast, so there it starts at `n = 1024` for
# K = 40 (`benchmarks/accelerator.py --part2 --series-paths`).
POINTS_FROM_WORK = 2**32
POINTS_FROM_WORK_SMALL = 2**29
POINTS_FROM_WORK_TPU = 2**37
POINTS_ORDER_FROM = 8


def _at_points_pays(
    hamiltonian: Terms, n: int, order: int, backend: str | None = None
) -> bool:
    """Whether the product at points is taken: for factored generators, whose
    propagators' coefficients fall off as `h^k / k!` and suit a circle or two.
    A generator given by its coefficients may have any profile: an MLP's falls off
    geometrically after a far larger zeroth term, so most coefficients lose too
    much on any circle and are summed one product at a time (no faster than the
    direct product), and its propagator recursion costs most of its time anyway."""
    direct_work = (order + 1) ** 2 * n**3 // 4
    backend = jax.default_backend() if backend is None else backend
    if backend == "tpu":
        least = POINTS_FROM_WORK_TPU
    elif backend == "cpu" and n <= QUICK_START_UP_TO:
        least = POINTS_FROM_WORK_SMALL
    else:
        least = POINTS_FROM_WORK
    return (
        isinstance(hamiltonian, FactoredTerms)
        and order >= POINTS_ORDER_FROM
        and direct_work >= least
    )


def hermitian_shortcuts(
    hamiltonian: Terms, observable: Terms
) -> tuple[Bool[Array, ""], Bool[Array, ""]]:
    """`(unitary, paired)`: whether `H` is exactly Hermitian (then `W = V^H`), and
    whether `X_0` is besides constant and exactly Hermitian (then the Cauchy
    product's terms pair up as adjoints)."""
    unitary = hamiltonian.hermitian()
    return unitary, unitary & observable.hermitian() & observable.constant()


def _without_diagonal_shortcut(terms: Terms) -> Terms:
    """`terms` whose diagonal matrices are multiplied like any other: scaling by the
    diagonal alone has no derivative in the directions off it."""
    if isinstance(terms, FactoredTerms):
        return eqx.tree_at(lambda t: t.diagonal, terms, False)
    return terms


Shortcuts = tuple[bool, bool] | None


def _coefficients(
    hamiltonian: Terms,
    observable: Terms,
    order: int,
    fast: bool,
    shortcuts: Shortcuts = None,
) -> Scaled:
    """`X_k(t) / k!` for `k = 0..K` in scaled form, the coefficients of
    `Y = V⁻¹ X_0 V = W P`; with `fast`, taking the [`hermitian_shortcuts`][] (checked
    here unless given as `shortcuts`) and scaling by diagonal factored matrices where
    they hold."""
    if fast and shortcuts is not None:
        unitary, paired = shortcuts
    elif fast:
        unitary, paired = hermitian_shortcuts(hamiltonian, observable)
    else:
        unitary, paired = False, False
        hamiltonian = _without_diagonal_shortcut(hamiltonian)
        observable = _without_diagonal_shortcut(observable)
    n = _matrices(observable).shape[-1]
    at_points = fast and _at_points_pays(hamiltonian, n, order)
    w, p = _propagators(hamiltonian, observable, order, unitary, as_planes=at_points)
    if at_points:
        return cauchy_product_at_points(w, p, paired)
    assert isinstance(w, Scaled) and isinstance(p, Scaled)
    return _cauchy_product(w, p, paired)


@eqx.filter_custom_jvp
def _fast_coefficients(
    hamiltonian: Terms, observable: Terms, order: int, shortcuts: Shortcuts
) -> Scaled:
    return _coefficients(hamiltonian, observable, order, True, shortcuts)


@_fast_coefficients.def_jvp
def _general_tangents(primals, tangents, order, shortcuts):
    # `W = V^H` holds on Hermitian generators, not off them, so its derivative
    # would miss the directions that leave them: derivatives take the general path.
    return eqx.filter_jvp(
        lambda h, x: _coefficients(h, x, order, fast=False), primals, tangents
    )


def heisenberg_coefficients(
    hamiltonian: Terms,
    observable: Terms,
    order: int,
    shortcuts: Shortcuts = None,
) -> Scaled:
    """`X_k(t) / k!` for `k = 0..K`, in scaled form: the coefficients of
    `Y = V⁻¹ X_0 V = W P`.

    A Hermitian generator (checked exactly, at run time) makes `V` unitary, so
    `W = V^H` costs no products; a constant Hermitian `X_0` besides pairs the terms
    of the Cauchy product as adjoints, which halves it; diagonal factored matrices
    (from [`DIAGONAL_FROM`][] on) scale instead of multiplying. Derivatives are those
    of the general recursion, whatever the generator.

    `shortcuts`: `(unitary, paired)` as Python bools, where the caller has already
    checked them on these very terms (with [`hermitian_shortcuts`][]): the program
    then holds only the branches they take, and compiles sooner.
    """
    return _fast_coefficients(hamiltonian, observable, order=order, shortcuts=shortcuts)
