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

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Complex, Int

from .._backend import complex_factors, complex_product
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


# A matrix product contracting terms and columns at once, `sum_r A[r] @ B[r]`.
_SUM_OF_PRODUCTS = (((0, 2), (0, 1)), ((), ()))


class DenseTerms(eqx.Module):
    """A generator (or observable) given by its coefficients, `G(t + s) = sum_j G[j]
    s^j`, every coefficient its own matrix: the general path. Coefficient `m` of `G X`
    is a sum of `L` products, `sum_i G[m - i] X[i]`."""

    reversed: Scaled
    reversed_factors: Array

    @staticmethod
    def of(coefficients: Complex[Array, "terms n n"], length: int) -> "DenseTerms":
        padded = _padded(coefficients, length)
        reversed_ = Scaled.of(_reversed_and_padded(padded, axis=0))
        return DenseTerms(reversed_, complex_factors(reversed_.mantissa))

    def product(
        self, x: Scaled, m: Int[Array, ""], factor: Array, generator_first: bool
    ) -> Scaled:
        """`factor` times coefficient `m` of `G X` (or of `X G`), from the first `L`
        coefficients of `X`, each term scaled relative to the largest."""
        window = _window(self.reversed.exponent, m, axis=0)
        exponents = jnp.maximum(window + x.exponent, ZERO_EXPONENT)
        top = jnp.max(exponents)
        weights = powers_of_two(exponents - top, x.mantissa.real.dtype) * factor
        generator = _window(self.reversed_factors, m, axis=-3)
        weighted = complex_factors(x.mantissa * weights[:, None, None])
        pair = (generator, weighted) if generator_first else (weighted, generator)
        return normalised(complex_product(*pair, _SUM_OF_PRODUCTS), top)


class FactoredTerms(eqx.Module):
    """A generator of the form `G(t + s) = sum_l c_l(s) M_l`: `J` scalar series times
    constant matrices (`H0 + cos(t) H1`, say). Coefficient `m` of `G X` is
    `sum_l M_l (sum_i c_l[m - i] X[i])`: sums weighted by scalars, then `J` products
    with matrices prepared once."""

    scalars: Scaled
    matrices: Scaled
    matrix_factors: Array

    @staticmethod
    def of(
        scalars: Complex[Array, "J terms"],
        matrices: Complex[Array, "J n n"],
        length: int,
    ) -> "FactoredTerms":
        padded = _padded(scalars.T, length).T
        matrices_ = Scaled.of(matrices)
        return FactoredTerms(
            Scaled.of(_reversed_and_padded(padded, axis=1), core=0),
            matrices_,
            complex_factors(matrices_.mantissa),
        )

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
        """`sum_l M_l sums[l]` (or `sum_l sums[l] M_l`), times `2**top`."""
        sums = complex_factors(sums)
        matrices = self.matrix_factors
        pair = (matrices, sums) if generator_first else (sums, matrices)
        return normalised(complex_product(*pair, _SUM_OF_PRODUCTS), top)

    def product(
        self, x: Scaled, m: Int[Array, ""], factor: Array, generator_first: bool
    ) -> Scaled:
        """`factor` times coefficient `m` of `G X` (or of `X G`)."""
        weights, top = self.weights(x, m, factor)
        sums = jnp.tensordot(weights, x.mantissa, 1)
        return self.finish(sums, top, generator_first)


Terms = DenseTerms | FactoredTerms


def _matrices(terms: Terms) -> Array:
    """Some of the generator's matrices, for their size and dtype."""
    if isinstance(terms, DenseTerms):
        return terms.reversed.mantissa
    return terms.matrices.mantissa


def _propagators(
    hamiltonian: Terms, observable: Terms, order: int
) -> tuple[Scaled, Scaled]:
    """Normalised Taylor coefficients `0..K` of `W = V⁻¹` and of `P = X_0 V`.

    Step `k` of one scan computes, from coefficients already known,

    - `V[k] = -i/k (H V)[k - 1]`     (from `V' = -i H V`),
    - `W[k] =  i/k (W H)[k - 1]`     (from `W' = i W H`),
    - `P[k - 1] = (X_0 V)[k - 1]`.

    `P` lags one step, so the scan runs to `K + 1`, with one slack row.
    """
    length = order + 2
    n, dtype = _matrices(observable).shape[-1], _matrices(observable).dtype
    identity = Scaled(0.5 * jnp.eye(n, dtype=dtype), jnp.asarray(1, jnp.int32))
    start = zeros((length, n, n), dtype).with_row(jnp.asarray(0), identity)

    def step(carry, k):
        v, w = carry
        m = k - 1
        step_factor = (1 / k.astype(jnp.finfo(dtype).dtype)).astype(dtype)
        one = jnp.ones((), dtype)
        new_w = hamiltonian.product(w, m, 1j * step_factor, generator_first=False)
        if isinstance(hamiltonian, FactoredTerms) and isinstance(
            observable, FactoredTerms
        ):
            # Both weight V's rows: one pass over V for the two.
            h_weights, h_top = hamiltonian.weights(v, m, -1j * step_factor)
            x_weights, x_top = observable.weights(v, m, one)
            sums = jnp.tensordot(jnp.concatenate([h_weights, x_weights]), v.mantissa, 1)
            count = h_weights.shape[0]
            new_v = hamiltonian.finish(sums[:count], h_top, generator_first=True)
            new_p = observable.finish(sums[count:], x_top, generator_first=True)
        else:
            new_v = hamiltonian.product(v, m, -1j * step_factor, generator_first=True)
            new_p = observable.product(v, m, one, generator_first=True)
        return (v.with_row(k, new_v), w.with_row(k, new_w)), new_p

    (_, w), p = lax.scan(step, (start, start), jnp.arange(1, length))
    return w[: order + 1], p


def chunk_size(n: int) -> int:
    """Terms per product in [`_cauchy_product`][], by measurement (complex128, K = 40,
    2 cores): at n = 256 the product took 1.09 s with 4 terms, 1.16 s with 2 or 8 and
    1.34 s with 16; at n = 512 6.5 s with 1 or 2 against 7.0-7.3 s with 4; at n = 1024
    47.6 s with 1, 48.2 s with 2 and 52.5 s with 4. (Larger matrices gain nothing from
    longer products and pay for the chunks' unused terms.)"""
    return 4 if n < 512 else 2


def _chunks(length: int, c: int) -> tuple[Int[Array, " chunks"], Int[Array, " chunks"]]:
    """`(m, a0)` for `m = 0..length - 1` and `a0 = 0, c, 2c, ... <= m`, in that
    order: computed from the chunk's position rather than stored, so the program has
    no constant that grows with the order.

    The `c` values of `m` in `[b c, b c + c)` have `b + 1` chunks each, so block `b`
    starts at chunk `c b (b + 1) / 2`; `b` is the root of that quadratic, corrected
    by one where floating point rounds it.
    """
    count = int(np.sum(np.arange(length) // c + 1))
    q = jnp.arange(count)
    b = ((jnp.sqrt(1 + 8 * q / c) - 1) / 2).astype(jnp.int32)
    b = jnp.where(c * (b + 1) * (b + 2) // 2 <= q, b + 1, b)
    b = jnp.where(c * b * (b + 1) // 2 > q, b - 1, b)
    offset = q - c * b * (b + 1) // 2
    m = b * c + offset // (b + 1)
    return m.astype(jnp.int32), (offset % (b + 1) * c).astype(jnp.int32)


def _cauchy_product(left: Scaled, right: Scaled, chunk: int | None = None) -> Scaled:
    """`Y[m] = sum_a left[a] @ right[m - a]` for `m = 0..K`.

    One scan over chunks of `c` consecutive terms of one `Y[m]` (`chunk`, by default
    [`chunk_size`][]), `a = a0..a0 + c - 1`, each one matrix product contracting its
    `c` terms: `left`'s rows `a0..` and, from a reversed copy of `right` padded with
    zeros, rows `m - a0, m - a0 - 1, ...` (terms past `m` fall in the padding). That
    is about `K^2 / 2 + K c / 2` products, against the `(K + 1)^2` of a scan with fixed
    windows. Every term is scaled by an exact power of two relative to the largest term
    of its `Y[m]`, known in advance from the exponents, so the chunks add up directly.
    """
    length = left.exponent.shape[0]
    c = chunk_size(left.mantissa.shape[-1]) if chunk is None else chunk
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
