"""OperatorSeries: the operators `X_k = i[H, X_{k-1}] + dX_{k-1}/dt`, all at once.

Why this works (the Heisenberg picture). Let `V(s)` solve `V' = -i H(t + s) V`,
`V(0) = I`, and `W = V⁻¹`, which solves `W' = i W H(t + s)`, `W(0) = I`. Then
`Y(s) = W(s) X_0(t + s) V(s)` has `Y' = W (i[H, X_0] + X_0') V`, and by induction
`Y^(k)(0) = X_k(t)`. So the normalised Taylor coefficients of `Y` are exactly
`X_k(t) / k!`: one Taylor expansion of `H` and `X_0` in `t`, then `O(K^2 n^3)` work in
a single `lax.scan` over the order. No nested `jacfwd`, so the compiled program does
not grow with `K`.

Why the exponents. `X_k / k!` spans hundreds of decades as `k` grows (1e-43 at
`k = 100` for the question's example), beyond float32. Every coefficient is therefore
carried as a mantissa (largest real or imaginary part in `[0.5, 1)`) and an integer
power of two, and sums of products are rescaled by exact powers of two before adding.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Complex, Inexact, Int, Real, Shaped

from ._taylor import taylor_coefficients


# The exponent of a zero coefficient: any product or sum carrying it rescales to zero.
_ZERO_EXPONENT = -(2**20)


def _int_dtype(dtype: Any) -> Any:
    return jnp.dtype(f"int{jnp.finfo(dtype).bits}")


def _power_of_two(k: Int[Array, "*shape"], dtype: Any) -> Real[Array, "*shape"]:
    """`2**k` exactly, built from its bits; `k` is clipped to the normal range."""
    info = jnp.finfo(dtype)
    bias = info.maxexp - 1
    k = jnp.minimum(jnp.maximum(k, info.minexp), bias).astype(_int_dtype(dtype))
    return lax.bitcast_convert_type((k + bias) << info.nmant, dtype)


def _exponent(size: Real[Array, "*shape"]) -> Int[Array, "*shape"]:
    """The `e` with `size = m * 2**e`, `0.5 <= m < 1`, read off the bits of `size >= 0`.

    Zero (and anything the CPU flushes to zero) gets `_ZERO_EXPONENT`. This is
    `jnp.frexp` without its subnormal handling, at a fraction of the compile time.
    """
    info = jnp.finfo(size.dtype)
    bias = info.maxexp - 1
    biased = lax.bitcast_convert_type(size, _int_dtype(size.dtype)) >> info.nmant
    exponent = (biased - bias + 1).astype(jnp.int32)
    return jnp.where(biased == 0, _ZERO_EXPONENT, exponent)


def _ldexp(x: Inexact[Array, "*batch"], k: Int[Array, "*#batch"]) -> Array:
    """`x * 2**k` for any integer `k`, without overflow in the scale factor.

    Split into two halves so that each factor is a normal number whenever the result
    is: the product is exact, and underflows or overflows only if the result does.
    """
    real_dtype = jnp.finfo(x.dtype).dtype
    half = k >> 1
    return x * _power_of_two(half, real_dtype) * _power_of_two(k - half, real_dtype)


def _split_exponent(
    x: Complex[Array, "*batch n n"],
) -> tuple[Complex[Array, "*batch n n"], Int[Array, "*batch"]]:
    """Write each matrix `x[i]` as `mantissa[i] * 2**exponent[i]`.

    The largest real or imaginary part of a nonzero mantissa lies in `[0.5, 1)`.
    """
    # The exponent is piecewise constant in x: no gradient through its choice.
    size = lax.stop_gradient(
        jnp.max(jnp.maximum(jnp.abs(x.real), jnp.abs(x.imag)), axis=(-2, -1))
    )
    exponent = _exponent(size)
    return _ldexp(x, -exponent[..., None, None]), exponent


class _Scaled(eqx.Module):
    """A batch of series of scaled matrices: coefficient `i` of series `b` is
    `mantissa[b, i] * 2**exponent[b, i]`.

    Both live in one complex array, the exponent (an integer well below 2**24, so
    exact as a float) in an extra column. One array means one slice, one update and
    one select per operation instead of two, so the scan below compiles to fewer
    kernels; XLA's compile time is roughly proportional to their number.
    """

    packed: Complex[Array, "batch rows n n_plus_1"]

    @staticmethod
    def pack(
        mantissa: Complex[Array, "batch rows n n"], exponent: Int[Array, "batch rows"]
    ) -> "_Scaled":
        column = jnp.broadcast_to(
            exponent[..., None, None].astype(mantissa.dtype), mantissa.shape[:-1] + (1,)
        )
        return _Scaled(jnp.concatenate([mantissa, column], axis=-1))

    @property
    def mantissa(self) -> Complex[Array, "batch rows n n"]:
        return self.packed[..., :-1]

    @property
    def exponent(self) -> Int[Array, "batch rows"]:
        return self.packed[..., 0, -1].real.astype(jnp.int32)

    def row(self, i: Int[Array, ""]) -> "_Scaled":
        """Row `i` of every series, as a `rows = 1` batch."""
        return _Scaled(lax.dynamic_slice_in_dim(self.packed, i, 1, axis=1))

    def with_row(self, i: Int[Array, ""], row: "_Scaled") -> "_Scaled":
        return _Scaled(lax.dynamic_update_slice_in_dim(self.packed, row.packed, i, 1))

    def select(self, mask: tuple[bool, ...], other: "_Scaled") -> "_Scaled":
        """Per series of the batch: `self` where `mask`, else `other`."""
        chosen = jnp.asarray(mask)[:, None, None, None]
        return _Scaled(jnp.where(chosen, self.packed, other.packed))

    def pick(self, indices: tuple[int, ...]) -> "_Scaled":
        """The series `indices` of the batch, in that order."""
        # Static slices rather than a gather: cheaper to compile.
        return _Scaled(jnp.concatenate([self.packed[i : i + 1] for i in indices]))


class _Reversed(eqx.Module):
    """A batch of scaled series stored back to front and followed by as many zero
    rows, for the right-hand factor of a Cauchy product.

    With `L` coefficients, row `L - 1 - i` holds coefficient `i`, so the `L` rows from
    `L - 1 - m` are coefficients `m, m - 1, ..., 0` and then zeros: the window
    `sum_j a[j] b[m - j]` needs, as one dynamic slice with no mask and no flip.
    """

    rows: _Scaled

    @staticmethod
    def of(x: _Scaled) -> "_Reversed":
        zero = _Scaled.pack(
            jnp.zeros_like(x.mantissa), jnp.full_like(x.exponent, _ZERO_EXPONENT)
        )
        flipped = jnp.flip(x.packed, axis=1)
        return _Reversed(_Scaled(jnp.concatenate([flipped, zero.packed], axis=1)))

    def _index(self, i: Int[Array, ""]) -> Int[Array, ""]:
        return self.rows.packed.shape[1] // 2 - 1 - i

    def window(self, m: Int[Array, ""]) -> _Scaled:
        """Row `j` holds coefficient `m - j`, zero for `j > m`."""
        length = self.rows.packed.shape[1] // 2
        start = self._index(m)
        return _Scaled(
            lax.dynamic_slice_in_dim(self.rows.packed, start, length, axis=1)
        )

    def row(self, i: Int[Array, ""]) -> _Scaled:
        return self.rows.row(self._index(i))

    def with_row(self, i: Int[Array, ""], row: _Scaled) -> "_Reversed":
        return _Reversed(self.rows.with_row(self._index(i), row))


def _sums_of_products(
    left: _Scaled, right: _Scaled, factor: Complex[Array, " batch"]
) -> _Scaled:
    """`factor[b] * sum_j left[b, j] @ right[b, j]`, as a `rows = 1` batch.

    Each term is rescaled to the largest term's exponent by an exact power of two
    before adding, so terms far below it vanish harmlessly and nothing overflows.
    """
    exponents = jnp.maximum(left.exponent + right.exponent, _ZERO_EXPONENT)
    top = jnp.max(exponents, axis=1, keepdims=True)
    weights = _ldexp(jnp.ones(exponents.shape, factor.real.dtype), exponents - top)
    weighted = left.mantissa * (weights[..., None, None] * factor[:, None, None, None])
    # One product for the whole batch; the term index j is contracted with the
    # matrix product.
    total = lax.dot_general(weighted, right.mantissa, (((1, 3), (1, 2)), ((0,), (0,))))
    mantissa, exponent = _split_exponent(total[:, None])
    return _Scaled.pack(mantissa, jnp.maximum(top + exponent, _ZERO_EXPONENT))


def _unit(length: int, n: int, dtype: Any, scale: int) -> _Scaled:
    """`scale * I` followed by zero coefficients (`scale` is 0 or 1), as a batch of
    one, built directly in scaled form."""
    first = jnp.full((1, n, n), 0.5 * scale, dtype) * jnp.eye(n, dtype=dtype)
    mantissa = jnp.concatenate([first, jnp.zeros((length - 1, n, n), dtype)])
    exponent = jnp.full((length,), _ZERO_EXPONENT, jnp.int32)
    if scale:
        exponent = jnp.concatenate([jnp.ones((1,), jnp.int32), exponent[1:]])
    return _Scaled.pack(mantissa[None], exponent[None])


def _concatenate(*xs: _Scaled) -> _Scaled:
    return _Scaled(jnp.concatenate([x.packed for x in xs]))


def _heisenberg_coefficients(
    hamiltonian: Complex[Array, "terms n n"], observable: Complex[Array, "terms n n"]
) -> tuple[Complex[Array, "terms n n"], Int[Array, " terms"]]:
    """Normalised Taylor coefficients of `Y = V⁻¹ X_0 V` from those of `H` and `X_0`.

    With `W = V⁻¹` and `P = X_0 V`, step `k` of one scan computes, as one batched
    product of four Cauchy sums over coefficients already known,

    - `V[k] = -i/k sum_j H[j] V[k-1-j]`     (from `V' = -i H V`),
    - `W[k] =  i/k sum_j W[j] H[k-1-j]`     (from `W' = i W H`),
    - `P[k-1] = sum_j X_0[j] V[k-1-j]`,
    - `Y[k-2] = sum_j W[j] P[k-2-j]`,

    so the scan runs two steps past `K`; two slack rows keep those steps in bounds.
    The left factors `[H, W, X_0, W]` and the right factors `[V, H, V, P]` each live
    in one batched buffer, `P` stored one row late so that every right factor is
    windowed at the same `k - 1`: a step reads one window and writes one row of each.
    """
    num_terms, n, _ = hamiltonian.shape
    dtype = hamiltonian.dtype
    slack = 2
    length = num_terms + slack
    padding = [(0, 0), (0, slack), (0, 0), (0, 0)]
    both = jnp.pad(jnp.stack([hamiltonian, observable]), padding)
    h_and_x = _Scaled.pack(*_split_exponent(both))
    h, x = h_and_x.pick((0,)), h_and_x.pick((1,))
    identity = _unit(length, n, dtype, 1)
    zero = _unit(length, n, dtype, 0)
    left = _concatenate(h, identity, x, identity)
    right = _Reversed.of(_concatenate(identity, h, identity, zero))
    # Which series of each buffer a step writes: W in the left; V, V, P in the right.
    left_written = (False, True, False, True)
    right_written = (True, False, True, True)

    def step(carry, inputs):
        left, right = carry
        k, factor = inputs
        # [V[k], W[k], P[k-1], Y[k-2]]
        new = _sums_of_products(left, right.window(k - 1), factor)
        left_row = new.pick((1, 1, 1, 1)).select(left_written, left.row(k))
        right_row = new.pick((0, 0, 0, 2)).select(right_written, right.row(k))
        carry = (left.with_row(k, left_row), right.with_row(k, right_row))
        return carry, new.packed[3, 0]

    steps = jnp.arange(1, length)
    k = steps.astype(jnp.finfo(dtype).dtype)[:, None]
    factors = (jnp.array([-1j, 1j, 0, 0]) / k + jnp.array([0, 0, 1, 1])).astype(dtype)
    _, rows = lax.scan(step, (left, right), (steps, factors))
    # The first step's Y[-1] is an empty sum.
    y = _Scaled(rows[None, 1:])
    return y.mantissa[0], y.exponent[0]


def _factorials(
    order: int, dtype: Any
) -> tuple[Real[Array, " terms"], Int[Array, " terms"]]:
    """`k! = mantissa[k] * 2**exponent[k]` for `k = 0..order`, without overflow."""

    def step(carry, k):
        mantissa, exponent = carry
        product = mantissa * k
        # product >= 0.5, so the rescaling factor is a normal number.
        shift = _exponent(product)
        mantissa = product * _power_of_two(-shift, dtype)
        return (mantissa, exponent + shift), (mantissa, exponent + shift)

    one = (jnp.asarray(0.5, dtype), jnp.asarray(1, jnp.int32))
    ks = jnp.arange(1, order + 1, dtype=dtype)
    _, (mantissas, exponents) = lax.scan(step, one, ks)
    return (
        jnp.concatenate([one[0][None], mantissas]),
        jnp.concatenate([one[1][None], exponents]),
    )


def _as_time(t: Any) -> Real[Array, ""]:
    t = jnp.asarray(t)
    if t.ndim != 0:
        raise ValueError(
            f"`t` must be a scalar, got an array of shape {t.shape}; use `jax.vmap` "
            "over the series to evaluate at a batch of times."
        )
    if jnp.issubdtype(t.dtype, jnp.complexfloating):
        raise TypeError(
            f"`t` must be real, got dtype {t.dtype}: the series is taken along the "
            "real time axis."
        )
    if not jnp.issubdtype(t.dtype, jnp.floating):
        return t.astype(jnp.result_type(float))
    # A strong dtype, so that Python floats and arrays share one compilation.
    return t.astype(t.dtype)


def _check_square(shape: tuple[int, ...], what: str) -> None:
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"`{what}` must be a square (n, n) array, got shape {shape}.")


def _constant(value: Array) -> Callable[[Array], Array]:
    return lambda t: value


class OperatorSeries(eqx.Module):
    """The operator sequence `X_0, X_1, ..., X_K` of a time-dependent generator.

    `X_0 = X(t)` and `X_k = i [H(t), X_{k-1}(t)] + d/dt X_{k-1}(t)`, with the general
    commutator `[A, B] = AB - BA` (neither `H` nor `X` need be Hermitian). `X_k / k!`
    are the Taylor coefficients in `s` of the Heisenberg-picture operator
    `V(s)⁻¹ X(t + s) V(s)`, `V' = -i H(t + s) V`, `V(0) = I`.

    The generator and the observable are fields, so when they are Equinox modules
    (an `eqx.nn.MLP` in `t`, say), `eqx.filter_grad` reaches their parameters.

    !!! Example

        ```python
        sx = jnp.array([[0, 1], [1, 0]], dtype=jnp.complex64)
        sy = jnp.array([[0, -1j], [1j, 0]], dtype=jnp.complex64)
        series = kdeqx.OperatorSeries(lambda t: jnp.cos(t) * sy, sx, order=9)
        xs = series(jnp.float32(1.0))             # (10, 2, 2): X_0 .. X_9
        coeffs = series.normalised(jnp.float32(1.0))  # X_k / k!
        ```
    """

    hamiltonian: Callable[[Array], Array]
    observable: Callable[[Array], Array] | Inexact[Array, "n n"]
    order: int = eqx.field(static=True)

    def __init__(
        self,
        hamiltonian: Callable[[Array], Array],
        observable: Callable[[Array], Array] | ArrayLike,
        order: int,
    ):
        """**Arguments:**

        - `hamiltonian`: the generator `H`, a callable `t -> (n, n)` array (real or
            complex): a function or an `eqx.Module`. It must be built from operations
            that have Taylor rules (arithmetic, matmul, `exp`/`log`/`sin`/`cos`/`tanh`
            and friends, `eqx.nn.MLP` with relu, tanh or softplus, `where`, `max`,
            `lax.cond`, reshapes and indexing); anything else raises an error naming
            the primitive.
        - `observable`: `X_0`, a callable `t -> (n, n)` array, or a constant `(n, n)`
            array.
        - `order`: `K`, the last index computed; a Python `int >= 0` (static).
        """
        if not callable(hamiltonian):
            raise TypeError(
                "`hamiltonian` must be a callable `t -> (n, n) array`, got "
                f"{type(hamiltonian).__name__}."
            )
        if isinstance(order, bool) or not isinstance(order, int):
            raise TypeError(f"`order` must be a Python int, got {order!r}.")
        if order < 0:
            raise ValueError(f"`order` must be >= 0, got {order}.")
        if not callable(observable):
            observable = jnp.asarray(observable)
            _check_square(observable.shape, "observable")
            if not jnp.issubdtype(observable.dtype, jnp.inexact):
                observable = observable.astype(jnp.result_type(float))
        self.hamiltonian = hamiltonian
        self.observable = observable
        self.order = int(order)

    def __call__(self, t: ArrayLike) -> Complex[Array, "terms n n"]:
        """The operators `X_0(t), ..., X_K(t)`.

        **Arguments:**

        - `t`: a real scalar time. Use `jax.vmap` for a batch of times.

        **Returns:**

        A complex array of shape `(K + 1, n, n)`, complex64 or complex128 following the
        dtypes of `t`, `H(t)` and `X_0(t)`. `X_k` grows like `k!`, so in float32 it
        overflows to `inf` around `k = 35..45` for generators of size one; use
        [`kdeqx.OperatorSeries.normalised`][] or
        [`kdeqx.OperatorSeries.normalised_frexp`][] for large orders.
        """
        return _operators(self, _as_time(t))

    def normalised(self, t: ArrayLike) -> Complex[Array, "terms n n"]:
        """The normalised operators `X_k(t) / k!`, `k = 0..K`.

        These are the Taylor coefficients of the Heisenberg-picture operator, so
        `sum_k normalised[k] * s**k` approximates `V(s)⁻¹ X(t + s) V(s)`. They are
        computed without ever forming `X_k` or `k!`, so they neither overflow nor lose
        precision at large `K`; only values below the dtype's smallest normal number
        (about 1e-38 in float32) flush to zero. To keep those, use
        [`kdeqx.OperatorSeries.normalised_frexp`][].

        **Arguments:**

        - `t`: a real scalar time.

        **Returns:**

        A complex array of shape `(K + 1, n, n)`.
        """
        return _normalised(self, _as_time(t))

    def normalised_frexp(
        self, t: ArrayLike
    ) -> tuple[Complex[Array, "terms n n"], Int[Array, " terms"]]:
        """`X_k(t) / k!` as `mantissa[k] * 2**exponent[k]`: finite and accurate at any
        order and in any dtype.

        **Arguments:**

        - `t`: a real scalar time.

        **Returns:**

        `(mantissa, exponent)`: a complex `(K + 1, n, n)` array whose largest real or
        imaginary part in each `mantissa[k]` lies in `[0.5, 1)` (or which is zero), and
        an int32 `(K + 1,)` array. Reassemble in a wider type, e.g.
        `mantissa * 2.0 ** exponent[:, None, None]` in float64, or compare
        `log2|X_k / k!| = log2|mantissa[k]| + exponent[k]`.
        """
        return _normalised_frexp(self, _as_time(t))


def _coefficients(
    fn: Callable[[Array], Array], t: Real[Array, ""], order: int, what: str
) -> Shaped[Array, "terms n n"]:
    # Shapes are checked on the result, so `fn` is traced once per compilation.
    coeffs = taylor_coefficients(fn, t, order)
    if not isinstance(coeffs, jax.Array):
        raise ValueError(
            f"`{what}` must return a single (n, n) array, got {type(coeffs).__name__}."
        )
    _check_square(coeffs.shape[1:], what)
    return coeffs


@eqx.filter_jit
def _normalised_frexp(
    series: OperatorSeries, t: Real[Array, ""]
) -> tuple[Complex[Array, "terms n n"], Int[Array, " terms"]]:
    observable = series.observable
    if not callable(observable):
        observable = _constant(observable)
    hamiltonian = _coefficients(series.hamiltonian, t, series.order, "hamiltonian")
    x0 = _coefficients(observable, t, series.order, "observable")
    if hamiltonian.shape != x0.shape:
        raise ValueError(
            "`hamiltonian(t)` and `observable(t)` must have the same shape, got "
            f"{hamiltonian.shape[1:]} and {x0.shape[1:]}."
        )
    dtype = jnp.promote_types(jnp.result_type(t, hamiltonian, x0), jnp.complex64)
    return _heisenberg_coefficients(hamiltonian.astype(dtype), x0.astype(dtype))


@eqx.filter_jit
def _operators(
    series: OperatorSeries, t: Real[Array, ""]
) -> Complex[Array, "terms n n"]:
    mantissa, exponent = _normalised_frexp(series, t)
    factorial_mantissa, factorial_exponent = _factorials(
        series.order, jnp.finfo(mantissa.dtype).dtype
    )
    # X_k = (X_k / k!) * k!, with the powers of two added as integers.
    return _ldexp(
        mantissa * factorial_mantissa[:, None, None],
        (exponent + factorial_exponent)[:, None, None],
    )


@eqx.filter_jit
def _normalised(
    series: OperatorSeries, t: Real[Array, ""]
) -> Complex[Array, "terms n n"]:
    mantissa, exponent = _normalised_frexp(series, t)
    return _ldexp(mantissa, exponent[:, None, None])
