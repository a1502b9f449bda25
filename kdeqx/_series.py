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
import numpy as np
from jaxtyping import Array, ArrayLike, Complex, Inexact, Int, Real

from ._taylor import taylor_coefficients


# The exponent of a zero coefficient: any product or sum carrying it rescales to zero.
_ZERO_EXPONENT = -(2**20)


def _power_of_two(k: Int[Array, "*shape"], dtype: Any) -> Real[Array, "*shape"]:
    """`2**k` exactly, built from its bits; `k` is clipped to the normal range."""
    info = jnp.finfo(dtype)
    bias = info.maxexp - 1
    int_dtype = jnp.dtype(f"int{info.bits}")
    k = jnp.clip(k, info.minexp, bias).astype(int_dtype)
    return lax.bitcast_convert_type((k + bias) << info.nmant, dtype)


def _ldexp(x: Inexact[Array, "terms ..."], k: Int[Array, " terms"]) -> Array:
    """`x[i] * 2**k[i]` for any integer `k[i]`, without overflow in the scale factor.

    Split into two halves so that each factor is a normal number whenever the result
    is: the product is exact, and underflows or overflows only if the result does.
    """
    real_dtype = jnp.finfo(x.dtype).dtype
    half = k // 2
    shape = k.shape + (1,) * (x.ndim - k.ndim)
    first = _power_of_two(half, real_dtype).reshape(shape)
    second = _power_of_two(k - half, real_dtype).reshape(shape)
    return x * first * second


def _split_exponent(
    x: Complex[Array, "terms n n"],
) -> tuple[Complex[Array, "terms n n"], Int[Array, " terms"]]:
    """Write each `x[i]` as `mantissa[i] * 2**exponent[i]`, one exponent per matrix.

    The largest real or imaginary part of a nonzero mantissa lies in `[0.5, 1)`.
    """
    # The exponent is piecewise constant in x: no gradient through its choice.
    size = lax.stop_gradient(
        jnp.max(jnp.maximum(jnp.abs(x.real), jnp.abs(x.imag)), axis=(-2, -1))
    )
    _, exponent = jnp.frexp(size)
    exponent = jnp.where(size > 0, exponent.astype(jnp.int32), _ZERO_EXPONENT)
    return _ldexp(x, -exponent), exponent


def _flip_pad(x: Array, fill: Any) -> Array:
    """`x` reversed along its first axis, then as many rows of `fill`.

    Row `j` of the `K + 1` rows starting at `K - m` is `x[m - j]` (`fill` for `j > m`).
    """
    return jnp.concatenate([jnp.flip(x, axis=0), jnp.full_like(x, fill)])


def _window(flipped: Array, m: Int[Array, ""]) -> Array:
    num_terms = flipped.shape[0] // 2
    return lax.dynamic_slice_in_dim(flipped, num_terms - 1 - m, num_terms, axis=0)


class _Scaled(eqx.Module):
    """Coefficients `mantissa[i] * 2**exponent[i]`, `i = 0..K`."""

    mantissa: Complex[Array, "terms n n"]
    exponent: Int[Array, " terms"]

    def window(self, m: Int[Array, ""]) -> "_Scaled":
        """Row `j` holds coefficient `m - j` (zero for `j > m`)."""
        return _Scaled(
            _window(_flip_pad(self.mantissa, 0), m),
            _window(_flip_pad(self.exponent, _ZERO_EXPONENT), m),
        )

    def at_set(self, m: Int[Array, ""], mantissa: Array, exponent: Array) -> "_Scaled":
        return _Scaled(
            self.mantissa.at[m].set(mantissa), self.exponent.at[m].set(exponent)
        )


def _sum_of_products(
    left: _Scaled, right: _Scaled, factor: Complex[Array, ""]
) -> tuple[Complex[Array, "n n"], Int[Array, ""]]:
    """`factor * sum_j left[j] @ right[j]`, as a mantissa and an exponent.

    Every term is rescaled to the largest term's exponent by an exact power of two, so
    terms far below it vanish harmlessly and nothing overflows.
    """
    exponents = jnp.maximum(left.exponent + right.exponent, _ZERO_EXPONENT)
    top = jnp.max(exponents)
    real_dtype = jnp.finfo(left.mantissa.dtype).dtype
    weights = _ldexp(jnp.ones(exponents.shape, real_dtype), exponents - top)
    total = jnp.einsum(
        "j,jab,jbc->ac",
        weights.astype(left.mantissa.dtype),
        left.mantissa,
        right.mantissa,
    )
    mantissa, exponent = _split_exponent((factor * total)[None])
    return mantissa[0], jnp.maximum(top + exponent[0], _ZERO_EXPONENT)


def _scaled(x: Complex[Array, "terms n n"]) -> _Scaled:
    return _Scaled(*_split_exponent(x))


def _heisenberg_coefficients(
    hamiltonian: Complex[Array, "terms n n"], observable: Complex[Array, "terms n n"]
) -> tuple[Complex[Array, "terms n n"], Int[Array, " terms"]]:
    """Normalised Taylor coefficients of `Y = V⁻¹ X_0 V` from those of `H` and `X_0`.

    One scan over the order `k = 1..K`; step `k` extends, in this order,
    `V[k] = -i/k sum_j H[k-1-j] V[j]`, `W[k] = i/k sum_j W[j] H[k-1-j]`,
    `P[k] = sum_j X_0[k-j] V[j]` (so `P = X_0 V`) and emits `Y[k] = sum_j W[j] P[k-j]`.
    """
    num_terms, n, _ = hamiltonian.shape
    dtype = hamiltonian.dtype
    h = _scaled(hamiltonian)
    x = _scaled(observable)
    identity = jnp.zeros_like(hamiltonian).at[0].set(jnp.eye(n, dtype=dtype))
    v = w = _scaled(identity)
    p = _Scaled(
        jnp.zeros_like(x.mantissa).at[0].set(x.mantissa[0]),
        jnp.full_like(x.exponent, _ZERO_EXPONENT).at[0].set(x.exponent[0]),
    )

    def step(carry, k):
        v, w, p = carry
        h_window = h.window(k - 1)
        kf = k.astype(jnp.finfo(dtype).dtype)
        v = v.at_set(k, *_sum_of_products(h_window, v, -1j / kf))
        w = w.at_set(k, *_sum_of_products(w, h_window, 1j / kf))
        one = jnp.ones((), dtype)
        p = p.at_set(k, *_sum_of_products(x.window(k), v, one))
        y_mantissa, y_exponent = _sum_of_products(w, p.window(k), one)
        return (v, w, p), (y_mantissa, y_exponent)

    _, (mantissas, exponents) = lax.scan(step, (v, w, p), jnp.arange(1, num_terms))
    # Y[0] = W[0] X_0[0] V[0] = X_0(t).
    mantissa = jnp.concatenate([x.mantissa[:1], mantissas])
    exponent = jnp.concatenate([x.exponent[:1], exponents])
    return mantissa, exponent


def _factorials(
    order: int, dtype: Any
) -> tuple[Real[Array, " terms"], Int[Array, " terms"]]:
    """`k! = mantissa[k] * 2**exponent[k]` for `k = 0..order`, without overflow."""
    mantissas, exponents = jnp.frexp(jnp.arange(1, order + 1, dtype=dtype))

    def step(carry, factor):
        mantissa, exponent = carry
        mantissa, shift = jnp.frexp(mantissa * factor[0])
        exponent = exponent + factor[1] + shift
        return (mantissa, exponent), (mantissa, exponent)

    one = (jnp.asarray(0.5, dtype), jnp.asarray(1, jnp.int32))
    _, (ms, es) = lax.scan(step, one, (mantissas, exponents.astype(jnp.int32)))
    return jnp.concatenate([one[0][None], ms]), jnp.concatenate([one[1][None], es])


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
        t = t.astype(jnp.result_type(float))
    return t


def _check_square(shape: Any, what: str) -> int:
    if (
        not isinstance(shape, jax.ShapeDtypeStruct)
        or len(shape.shape) != 2
        or shape.shape[0] != shape.shape[1]
    ):
        got = shape.shape if isinstance(shape, jax.ShapeDtypeStruct) else shape
        raise ValueError(f"`{what}` must be a square (n, n) array, got {got}.")
    return shape.shape[0]


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
        if isinstance(order, bool) or not isinstance(order, int | np.integer):
            raise TypeError(f"`order` must be a Python int, got {order!r}.")
        if order < 0:
            raise ValueError(f"`order` must be >= 0, got {order}.")
        if not callable(observable):
            observable = jnp.asarray(observable)
            _check_square(
                jax.ShapeDtypeStruct(observable.shape, observable.dtype), "observable"
            )
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
        mantissa, exponent = _normalised_frexp(self, _as_time(t))
        return _ldexp(mantissa, exponent)

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
) -> Inexact[Array, "terms n n"]:
    _check_square(jax.eval_shape(fn, t), what)
    return taylor_coefficients(fn, t, order)


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
        mantissa * factorial_mantissa[:, None, None], exponent + factorial_exponent
    )
