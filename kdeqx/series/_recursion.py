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
`K^2 / 2` matrix products either way. Neither scan's body depends on `K`, so the
compiled program does not grow with the order.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Complex, Int

from .._backend import complex_factors, complex_product
from ._scaled import ldexp, normalised, powers_of_two, Scaled, ZERO_EXPONENT, zeros


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


def _window(x: Scaled, m: Int[Array, ""], axis: int) -> Scaled:
    """Entry `i` of the result is coefficient `m - i` of the reversed and padded `x`."""
    length = x.exponent.shape[axis] // 2
    start = length - 1 - m
    return Scaled(
        lax.dynamic_slice_in_dim(x.mantissa, start, length, axis),
        lax.dynamic_slice_in_dim(x.exponent, start, length, axis),
    )


class DenseTerms(eqx.Module):
    """A generator (or observable) given by its coefficients, `G(t + s) = sum_j G[j]
    s^j`, every coefficient its own matrix: the general path."""

    reversed: Scaled

    @staticmethod
    def of(coefficients: Complex[Array, "terms n n"], length: int) -> "DenseTerms":
        padded = _padded(coefficients, length)
        return DenseTerms(Scaled.of(_reversed_and_padded(padded, axis=0)))

    @property
    def n(self) -> int:
        return self.reversed.mantissa.shape[-1]

    @property
    def dtype(self) -> Any:
        return self.reversed.mantissa.dtype

    def times(self, x: Scaled, m: Int[Array, ""]) -> tuple[Scaled, Scaled]:
        """The pair of rows whose sum of products is coefficient `m` of `G X`:
        `sum_i G[m - i] X[i]`."""
        return _window(self.reversed, m, axis=0), x

    def times_on_the_left(self, x: Scaled, m: Int[Array, ""]) -> tuple[Scaled, Scaled]:
        """The same for `X G`."""
        return x, _window(self.reversed, m, axis=0)


class FactoredTerms(eqx.Module):
    """A generator of the form `G(t + s) = sum_l c_l(s) M_l`: `J` scalar series times
    constant matrices (`H0 + cos(t) H1`, say). Coefficient `m` of `G X` is
    `sum_l M_l (sum_i c_l[m - i] X[i])`: scalar-weighted sums, then `J` products."""

    scalars: Scaled
    matrices: Scaled

    @staticmethod
    def of(
        scalars: Complex[Array, "J terms"],
        matrices: Complex[Array, "J n n"],
        length: int,
    ) -> "FactoredTerms":
        padded = _padded(scalars.T, length).T
        return FactoredTerms(
            Scaled.of(_reversed_and_padded(padded, axis=1), core=0),
            Scaled.of(matrices),
        )

    @property
    def n(self) -> int:
        return self.matrices.mantissa.shape[-1]

    @property
    def dtype(self) -> Any:
        return self.matrices.mantissa.dtype

    @property
    def count(self) -> int:
        return self.matrices.exponent.shape[0]

    def window(self, m: Int[Array, ""]) -> Scaled:
        """`c_l[m - i]` at `(l, i)`, zero for `i > m`."""
        return _window(self.scalars, m, axis=1)

    def times(self, x: Scaled, m: Int[Array, ""]) -> tuple[Scaled, Scaled]:
        return self.matrices, _weighted_sums(self.window(m), x)

    def times_on_the_left(self, x: Scaled, m: Int[Array, ""]) -> tuple[Scaled, Scaled]:
        return _weighted_sums(self.window(m), x), self.matrices


def _weighted_sums(weights: Scaled, x: Scaled) -> Scaled:
    """`sum_i weights[l, i] X[i]` for every `l`, each term rescaled to the largest of
    its sum. (Left unnormalised: its mantissas stay below the number of terms, and
    the product that uses it normalises.)"""
    exponents = jnp.maximum(weights.exponent + x.exponent, ZERO_EXPONENT)
    top = jnp.max(exponents, axis=1)
    scaled = ldexp(weights.mantissa, exponents - top[:, None])
    return Scaled(jnp.tensordot(scaled, x.mantissa, 1), top)


Terms = DenseTerms | FactoredTerms


def _sums_of_products(
    left: Scaled, right: Scaled, factor: Complex[Array, " batch"]
) -> Scaled:
    """`factor[b] * sum_r left[b, r] @ right[b, r]`, every term rescaled to the
    largest of its sum by an exact power of two before adding."""
    exponents = jnp.maximum(left.exponent + right.exponent, ZERO_EXPONENT)
    top = jnp.max(exponents, axis=1)
    weights = powers_of_two(exponents - top[:, None], left.mantissa.real.dtype)
    weighted = left.mantissa * (weights * factor[:, None])[..., None, None]
    # The term index r is contracted with the matrix product.
    total = complex_product(
        complex_factors(weighted),
        complex_factors(right.mantissa),
        (((1, 3), (1, 2)), ((0,), (0,))),
    )
    return normalised(total, top)


def _products(
    pairs: Sequence[tuple[Scaled, Scaled]], factors: Complex[Array, " pairs"]
) -> list[Scaled]:
    """[`_sums_of_products`][] of each pair; pairs with the same number of terms
    share one batched product."""
    groups: dict[int, list[int]] = {}
    for i, (left, _) in enumerate(pairs):
        groups.setdefault(left.exponent.shape[0], []).append(i)
    results: list[Any] = [None] * len(pairs)
    for members in groups.values():
        stacked = [
            jax.tree.map(lambda *xs: jnp.stack(xs), *(pairs[i][side] for i in members))
            for side in (0, 1)
        ]
        total = _sums_of_products(*stacked, factors[jnp.asarray(members)])
        for position, i in enumerate(members):
            results[i] = total[position]
    return results


def _step_pairs(
    hamiltonian: Terms, observable: Terms, v: Scaled, w: Scaled, m: Int[Array, ""]
) -> list[tuple[Scaled, Scaled]]:
    """The pairs whose sums of products are coefficient `m` of `H V`, `W H` and
    `X_0 V`."""
    if isinstance(hamiltonian, FactoredTerms) and isinstance(observable, FactoredTerms):
        # Both weight V's rows: one pass over V for the two.
        weights = jax.tree.map(
            lambda a, b: jnp.concatenate([a, b]),
            hamiltonian.window(m),
            observable.window(m),
        )
        sums = _weighted_sums(weights, v)
        count = hamiltonian.count
        return [
            (hamiltonian.matrices, sums[:count]),
            hamiltonian.times_on_the_left(w, m),
            (observable.matrices, sums[count:]),
        ]
    return [
        hamiltonian.times(v, m),
        hamiltonian.times_on_the_left(w, m),
        observable.times(v, m),
    ]


def _propagators(
    hamiltonian: Terms, observable: Terms, order: int
) -> tuple[Scaled, Scaled]:
    """Normalised Taylor coefficients `0..K` of `W = V⁻¹` and of `P = X_0 V`.

    Step `k` of one scan computes, from coefficients already known,

    - `V[k] = -i/k (H V)[k - 1]`     (from `V' = -i H V`),
    - `W[k] =  i/k (W H)[k - 1]`     (from `W' = i W H`),
    - `P[k - 1] = (X_0 V)[k - 1]`,

    as one batched product where their numbers of terms agree. `P` lags one step, so
    the scan runs to `K + 1`, with one slack row.
    """
    length = order + 2
    n, dtype = observable.n, observable.dtype
    identity = Scaled(0.5 * jnp.eye(n, dtype=dtype), jnp.asarray(1, jnp.int32))
    start = zeros((length, n, n), dtype).with_row(jnp.asarray(0), identity)

    def step(carry, inputs):
        v, w = carry
        k, factors = inputs
        m = k - 1
        new_v, new_w, new_p = _products(
            _step_pairs(hamiltonian, observable, v, w, m), factors
        )
        return (v.with_row(k, new_v), w.with_row(k, new_w)), new_p

    steps = jnp.arange(1, length)
    k = steps.astype(jnp.finfo(dtype).dtype)[:, None]
    factors = (jnp.array([-1j, 1j, 0]) / k + jnp.array([0, 0, 1])).astype(dtype)
    (_, w), p = lax.scan(step, (start, start), (steps, factors))
    return w[: order + 1], p


# Terms per product in [`_cauchy_product`][]. At n = 256, K = 40 (complex128, 2 cores)
# the product took 1.09 s with 4, 1.16 s with 2 or 8 and 1.34 s with 16; at n = 32 and
# n = 4, K = 100, 4 was as fast as 16 or 32.
_CHUNK = 4


def _chunks(length: int, c: int) -> tuple[Int[Array, " chunks"], Int[Array, " chunks"]]:
    """`(m, a0)` for `m = 0..length - 1` and `a0 = 0, c, 2c, ... <= m`, in that
    order: computed rather than stored, so the program has no constant that grows
    with the order."""
    counts = np.arange(length) // c + 1
    q = jnp.arange(int(np.sum(counts)))
    starts = jnp.cumsum(jnp.arange(length) // c + 1) - (jnp.arange(length) // c + 1)
    m = jnp.searchsorted(starts, q, side="right") - 1
    return m.astype(jnp.int32), ((q - starts[m]) * c).astype(jnp.int32)


def _cauchy_product(left: Scaled, right: Scaled) -> Scaled:
    """`Y[m] = sum_a left[a] @ right[m - a]` for `m = 0..K`.

    One scan over chunks of `c` consecutive terms of one `Y[m]`, `a = a0..a0 + c - 1`,
    each one matrix product contracting its `c` terms: `left`'s rows `a0..` and, from
    a reversed copy of `right` padded with zeros, rows `m - a0, m - a0 - 1, ...`
    (terms past `m` fall in the padding). That is about `K^2 / 2 + K c / 2` products,
    against the `(K + 1)^2` of a scan with fixed windows. Every term is scaled by an
    exact power of two relative to the largest term of its `Y[m]`, known in advance
    from the exponents, so the chunks add up directly.
    """
    length = left.exponent.shape[0]
    c = _CHUNK
    a = jnp.arange(length)[:, None]
    m = jnp.arange(length)[None, :]
    term_exponents = left.exponent[:, None] + right.exponent[jnp.maximum(m - a, 0)]
    top = jnp.max(jnp.where(m >= a, term_exponents, ZERO_EXPONENT), axis=0)
    top = jnp.maximum(top, ZERO_EXPONENT)

    # Zero rows past the ends, so that every chunk's slices stay in bounds.
    left_factors = complex_factors(_padded(left.mantissa, length + c))
    left_exponent = _padded(left.exponent, length + c, ZERO_EXPONENT)
    right_length = 2 * length + c
    right_factors = complex_factors(
        _padded(jnp.flip(right.mantissa, axis=0), right_length)
    )
    right_exponent = _padded(jnp.flip(right.exponent), right_length, ZERO_EXPONENT)
    real_dtype = left.mantissa.real.dtype

    def step(total, chunk):
        m, a0 = chunk
        start = length - 1 - m + a0
        exponents = lax.dynamic_slice_in_dim(
            left_exponent, a0, c
        ) + lax.dynamic_slice_in_dim(right_exponent, start, c)
        weights = powers_of_two(
            jnp.maximum(exponents, ZERO_EXPONENT) - top[m], real_dtype
        )
        part = complex_product(
            lax.dynamic_slice_in_dim(left_factors, a0, c, axis=-3),
            lax.dynamic_slice_in_dim(right_factors, start, c, axis=-3)
            * weights[:, None, None],
            (((0, 2), (0, 1)), ((), ())),
        )
        row = lax.dynamic_index_in_dim(total, m, keepdims=False) + part
        return lax.dynamic_update_index_in_dim(total, row, m, 0), None

    start = jnp.zeros(left.mantissa.shape, left.mantissa.dtype)
    total, _ = lax.scan(step, start, _chunks(length, c))
    return normalised(total, top)


def heisenberg_coefficients(
    hamiltonian: Terms, observable: Terms, order: int
) -> Scaled:
    """`X_k(t) / k!` for `k = 0..K`, in scaled form: the coefficients of
    `Y = V⁻¹ X_0 V = W P`."""
    w, p = _propagators(hamiltonian, observable, order)
    return _cauchy_product(w, p)
