"""Truncated Taylor arithmetic in array form.

A truncated Taylor series of order `K` of an array-valued function `a(s)` about
`s = 0` is stored as one array `A` of shape `(K + 1, *shape)`, coefficient axis
first, holding the *normalised* coefficients `A[m] = a^(m)(0) / m!`. In this form a
product is a Cauchy convolution, `d/ds` is a shift, and no factorial is ever formed.

[`taylor_coefficients`][] traces a user function `t -> f(t)` to a jaxpr and interprets
it equation by equation on such arrays. Each rule works on the whole coefficient axis at
once; the nonlinear ones (`exp`, `sin`, `div`, ...) are recurrences run by one
`lax.fori_loop` over the order, so the traced program has the same size for every `K`.

Equations that do not depend on the expansion variable are evaluated as they are, with
their own primitives, so constants (weights, `jnp.eye`, integer index arithmetic) need
no rule at all. Nonsmooth primitives (`max`, `abs`, `select_n`, comparisons, ...) use
the piece that is active at the expansion point.

Values of the form `sum_l f_l(s) A_l`, a few scalar series times constant arrays (a
driven Hamiltonian `H0 + cos(t) H1`, or an MLP's last layer applied to a narrow hidden
series), are kept in that factored form for as long as only linear operations and
products with constants touch them: see [`_Factored`][]. [`taylor_expansion`][]
returns them so; [`taylor_coefficients`][] always returns plain coefficient arrays.
"""

import functools as ft
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PyTree, Shaped

from .._backend import FULL_PRECISION


class _Series:
    """An environment value that depends on the expansion variable.

    `coeffs` has shape `(K + 1, *aval.shape)`. Any other environment value is a
    constant: a plain array whose higher coefficients are implicitly zero.

    `affine` records (at trace time) that every coefficient past the first is zero,
    as for the seed `t + s` and anything linear in it. `exp`, `sin`, `cos`, `sinh` and
    `cosh` of an affine series have closed forms, so the common generators
    (`cos(w t) A`, `exp(-t) B`, ...) need no recurrence loop at all.
    """

    __slots__ = ("coeffs", "affine")

    def __init__(self, coeffs: Array, affine: bool = False):
        self.coeffs = coeffs
        self.affine = affine


def _all_affine(invals: Sequence[Any]) -> bool:
    return all(x.affine for x in invals if isinstance(x, _Series))


# The most terms a factored value may have; beyond, it is expanded into coefficients.
MAX_FACTORED_TERMS = 16


class _Factored:
    """An environment value `constant + sum_l scalars[l](s) * matrices[l]`: a constant
    array plus a few scalar series times constant arrays.

    `scalars` has shape `(J, K + 1)` (the normalised coefficients of each scalar
    series), `matrices` shape `(J, *aval.shape)`, and `constant` is an array of the
    value's shape or None. Products with constants act on the arrays only and linear
    primitives term by term, so a generator such as `H0 + cos(t) H1` costs `O(J K)`
    scalar and `O(J n^2)` array memory instead of `O(K n^2)`, and a consumer (the
    operator recursion) can use the structure. Every constant lands in `constant`, so
    `H0 + 0 + cos(t) H1` is still two terms.
    """

    __slots__ = ("scalars", "matrices", "constant")

    def __init__(self, scalars: Array, matrices: Array, constant: Array | None = None):
        self.scalars = scalars
        self.matrices = matrices
        self.constant = constant

    @staticmethod
    def of(series: "_Series") -> "_Factored":
        """A series of `J` entries as `J` terms: entry `l`'s scalar series times the
        `l`-th unit array."""
        coeffs = series.coeffs
        size = math.prod(coeffs.shape[1:])
        scalars = coeffs.reshape(coeffs.shape[0], size).T
        units = jnp.eye(size, dtype=coeffs.dtype).reshape((size,) + coeffs.shape[1:])
        return _Factored(scalars, units)

    @property
    def num_terms(self) -> int:
        return self.scalars.shape[1]

    @property
    def complex_scalars(self) -> bool:
        return jnp.iscomplexobj(self.scalars)

    def constant_or_zeros(self) -> Array:
        if self.constant is None:
            return jnp.zeros_like(self.matrices[0])
        return self.constant

    def with_constant_as_term(self) -> "_Factored":
        """The constant as one more term, with the unit series."""
        if self.constant is None:
            return self
        unit = _with_first(jnp.ones((1,), self.scalars.dtype), self.num_terms).T
        return _Factored(
            jnp.concatenate([self.scalars, unit]),
            jnp.concatenate([self.matrices, self.constant[None]]),
        )

    def coefficients(self) -> Array:
        dtype = self.matrices.dtype
        total = jnp.tensordot(
            self.scalars.T, self.matrices, axes=1, precision=FULL_PRECISION
        ).astype(dtype)
        if self.constant is None:
            return total
        return total.at[0].add(self.constant.astype(dtype))

    def value(self) -> Array:
        """The value at the expansion point."""
        dtype = self.matrices.dtype
        total = jnp.tensordot(
            self.scalars[:, 0], self.matrices, axes=1, precision=FULL_PRECISION
        ).astype(dtype)
        if self.constant is None:
            return total
        return total + self.constant.astype(dtype)

    def expanded(self) -> "_Series":
        return _Series(self.coefficients())


# ----------------------------------------------------------------------------------
# Coefficient-array helpers. Every array below has the coefficient axis first.
# ----------------------------------------------------------------------------------


def _lift(x: Any, num_terms: int) -> Array:
    """Coefficients of `x`: a series as is, a constant with zero higher terms."""
    if isinstance(x, _Factored):
        return x.coefficients()
    if isinstance(x, _Series):
        return x.coeffs
    x = jnp.asarray(x)
    return jnp.concatenate([x[None], jnp.zeros((num_terms - 1,) + x.shape, x.dtype)])


def _primal(x: Any) -> Any:
    """Value at the expansion point."""
    if isinstance(x, _Factored):
        return x.value()
    return x.coeffs[0] if isinstance(x, _Series) else x


def _orders(num_terms: int, dtype: Any, ndim: int) -> Array:
    """`[0, 1, ..., K]` shaped to broadcast against a `ndim`-dimensional array."""
    return jnp.arange(num_terms, dtype=dtype).reshape((num_terms,) + (1,) * (ndim - 1))


def _with_first(value: Array, num_terms: int) -> Array:
    """A coefficient array whose only nonzero coefficient is the zeroth, `value`."""
    return _lift(value, num_terms)


def _set(a: Array, m: Array, value: Array) -> Array:
    """`a` with coefficient `m` replaced (a dynamic update, cheaper to compile than a
    scatter)."""
    return lax.dynamic_update_index_in_dim(a, value.astype(a.dtype), m, 0)


def _set_first(a: Array, value: Array) -> Array:
    return jnp.concatenate([value.astype(a.dtype)[None], a[1:]])


def _flip_pad(a: Array) -> Array:
    """`a` reversed along the coefficient axis, followed by as many zero rows.

    Slicing `K + 1` rows of this at offset `K - m` gives `a[m - j]` at row `j` (zero for
    `j > m`): the window a Cauchy convolution needs, with no masking and one dynamic
    slice whatever `m` is.
    """
    return jnp.concatenate([jnp.flip(a, axis=0), jnp.zeros_like(a)])


def _window(flipped: Array, m: Array | int) -> Array:
    """Rows `a[m], a[m - 1], ..., a[0], 0, ...` from `flipped = _flip_pad(a)`."""
    num_terms = flipped.shape[0] // 2
    return lax.dynamic_slice_in_dim(flipped, num_terms - 1 - m, num_terms, axis=0)


def _convolve_at(a: Array, flipped_b: Array, m: Array | int) -> Array:
    """Coefficient `m` of the product `a * b`: `sum_j a[j] * b[m - j]`."""
    return jnp.sum(a * _window(flipped_b, m), axis=0)


def _derivative(a: Array) -> Array:
    """Normalised coefficients of `da/ds`: `(m + 1) * a[m + 1]`, the last one zero."""
    num_terms = a.shape[0]
    scale = _orders(num_terms, a.dtype, a.ndim)[1:]
    return jnp.concatenate([a[1:] * scale, jnp.zeros_like(a[:1])])


def _integral(da: Array, a0: Array) -> Array:
    """Coefficients of the antiderivative of `da` whose value at zero is `a0`."""
    num_terms = da.shape[0]
    scale = _orders(num_terms, da.dtype, da.ndim)[1:]
    return jnp.concatenate([a0[None].astype(da.dtype), da[:-1] / scale])


def cauchy_product(a: Array, b: Array) -> Array:
    """Coefficients of the elementwise product of two series of the same shape."""
    flipped_b = _flip_pad(b)
    return lax.map(lambda m: _convolve_at(a, flipped_b, m), jnp.arange(a.shape[0]))


def _divide(a: Array, b: Array) -> Array:
    """Coefficients of `a / b`, from `y * b = a`: `y[m] = (a[m] - sum_{j<m} y[j]
    b[m - j]) / b[0]`."""
    flipped_b = _flip_pad(b)

    def next_coefficient(m, y):
        # y[m] is still zero here, so the convolution only sees the known terms.
        return _set(y, m, (a[m] - _convolve_at(y, flipped_b, m)) / b[0])

    return lax.fori_loop(0, a.shape[0], next_coefficient, jnp.zeros_like(a))


def _set_flipped(flipped: Array, m: Array, value: Array) -> Array:
    """Write coefficient `m` into a `_flip_pad` buffer (kept alongside an evolving
    series so that its windows need no flip per step)."""
    num_terms = flipped.shape[0] // 2
    return _set(flipped, num_terms - 1 - m, value)


def _sqrt(x: Array) -> Array:
    """Coefficients of `sqrt(x)`, from `y * y = x`."""
    num_terms = x.shape[0]
    y0 = jnp.sqrt(x[0])
    y = _with_first(y0, num_terms)

    def next_coefficient(m, carry):
        y, flipped_y = carry
        # With y[m] still zero the self-convolution is sum_{0<j<m} y[j] y[m-j].
        ym = (x[m] - _convolve_at(y, flipped_y, m)) / (2 * y0)
        return _set(y, m, ym), _set_flipped(flipped_y, m, ym)

    return lax.fori_loop(1, num_terms, next_coefficient, (y, _flip_pad(y)))[0]


def _power(x: Array, p: Array) -> Array:
    """Coefficients of `x ** p` for a constant `p`, from `x y' = p x' y`.

    Needs `x[0] != 0`; integer powers go through [`_integer_power`][] instead so that
    `t ** 2` at `t = 0` works.
    """
    num_terms = x.shape[0]
    weighted_x = _flip_pad(x * _orders(num_terms, x.dtype, x.ndim))
    flipped_x = _flip_pad(x)
    y0 = x[0] ** p

    def next_coefficient(m, y):
        mf = m.astype(x.dtype)
        # m x0 y[m] = (p + 1) sum_j j x[j] y[m-j] - m sum_{j>=1} x[j] y[m-j]
        ym = (p + 1) * _convolve_at(y, weighted_x, m) - mf * _convolve_at(
            y, flipped_x, m
        )
        return _set(y, m, ym / (mf * x[0]))

    return lax.fori_loop(1, num_terms, next_coefficient, _with_first(y0, num_terms))


def _integer_power(x: Array, n: int) -> Array:
    """Coefficients of `x ** n` by repeated squaring (`n` is static)."""
    if n < 0:
        return _divide(
            _with_first(jnp.ones_like(x[0]), x.shape[0]), _integer_power(x, -n)
        )
    result = _with_first(jnp.ones_like(x[0]), x.shape[0])
    square = x
    while n:
        if n & 1:
            result = cauchy_product(result, square)
        n >>= 1
        if n:
            square = cauchy_product(square, square)
    return result


def _exp(x: Array) -> Array:
    """Coefficients of `exp(x)`, from `y' = x' y`: `m y[m] = sum_j j x[j] y[m-j]`."""
    num_terms = x.shape[0]
    weighted_x = _flip_pad(x * _orders(num_terms, x.dtype, x.ndim))

    def next_coefficient(m, y):
        # y[m] is still zero, and the j = 0 weight is zero anyway.
        return _set(y, m, _convolve_at(y, weighted_x, m) / m.astype(x.dtype))

    y = _with_first(jnp.exp(x[0]), num_terms)
    return lax.fori_loop(1, num_terms, next_coefficient, y)


def _riccati(x: Array, y0: Array, c0: float, c2: float) -> Array:
    """Coefficients of `y` with `y' = (c0 + c2 y²) x'` and `y(0) = y0`.

    `tanh` is (1, -1) and `tan` is (1, 1). `u = c0 + c2 y²` is carried alongside `y`,
    and so is `y` in the flipped layout that its self-convolution windows.
    """
    num_terms = x.shape[0]
    weighted_x = _flip_pad(x * _orders(num_terms, x.dtype, x.ndim))
    y = _with_first(y0, num_terms)
    u = _with_first(c0 + c2 * y0 * y0, num_terms)

    def next_coefficient(m, carry):
        y, flipped_y, u = carry
        # m y[m] = sum_{j>=1} j x[j] u[m-j]; u[m] is still zero so only u[<m] is used.
        ym = _convolve_at(u, weighted_x, m) / m.astype(x.dtype)
        y = _set(y, m, ym)
        flipped_y = _set_flipped(flipped_y, m, ym)
        um = c2 * _convolve_at(y, flipped_y, m)
        return y, flipped_y, _set(u, m, um)

    return lax.fori_loop(1, num_terms, next_coefficient, (y, _flip_pad(y), u))[0]


def _sin_cos(x: Array, sign: float) -> tuple[Array, Array]:
    """Coefficients of `(s, c)` with `s' = c x'`, `c' = sign * s x'`.

    `sign = -1` gives `(sin x, cos x)`, `sign = +1` gives `(sinh x, cosh x)`.
    """
    num_terms = x.shape[0]
    weighted_x = _flip_pad(x * _orders(num_terms, x.dtype, x.ndim))
    if sign < 0:
        s0, c0 = jnp.sin(x[0]), jnp.cos(x[0])
    else:
        s0, c0 = jnp.sinh(x[0]), jnp.cosh(x[0])

    def next_coefficient(m, carry):
        s, c = carry
        mf = m.astype(x.dtype)
        sm = _convolve_at(c, weighted_x, m) / mf
        cm = sign * _convolve_at(s, weighted_x, m) / mf
        return _set(s, m, sm), _set(c, m, cm)

    init = (_with_first(s0, num_terms), _with_first(c0, num_terms))
    return lax.fori_loop(1, num_terms, next_coefficient, init)


def _log(x: Array) -> Array:
    return _integral(_divide(_derivative(x), x), jnp.log(x[0]))


def _integral_of(derivative: Array, value: Array, x: Array) -> Array:
    """Coefficients of `y` with `y' = derivative * x'` and `y(0) = value`."""
    return _integral(cauchy_product(derivative, _derivative(x)), value)


def _one(x: Array) -> Array:
    return _with_first(jnp.ones_like(x[0]), x.shape[0])


# ----------------------------------------------------------------------------------
# Rules. A rule maps the equation and its inputs (series or constants) to its outputs.
# ----------------------------------------------------------------------------------


def _num_terms(invals: Sequence[Any]) -> int:
    return next(x.coeffs.shape[0] for x in invals if isinstance(x, _Series))


def _is_inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _out_avals(eqn: jex.JaxprEqn) -> list[Any]:
    return [v.aval for v in eqn.outvars]


def _bind(eqn: jex.JaxprEqn, *args: Any) -> Any:
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # JAX < 0.10: `(subfuns, params)`
        subfuns, params = params
        args = (*subfuns, *args)
    return eqn.primitive.bind(*args, **params)


def _as_list(eqn: jex.JaxprEqn, out: Any) -> list[Any]:
    return list(out) if eqn.primitive.multiple_results else [out]


def _elementwise_inputs(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list[Array]:
    """Inputs lifted to series and broadcast to the output's shape.

    Elementwise primitives may mix a rank-0 operand with a full-rank one.
    """
    (aval,) = _out_avals(eqn)
    num_terms = _num_terms(invals)
    shape = (num_terms,) + tuple(aval.shape)

    def broadcast(x):
        coeffs = _lift(x, num_terms)
        # A rank-0 operand gets unit axes after the coefficient axis, not before.
        missing = len(shape) - coeffs.ndim
        coeffs = coeffs.reshape((num_terms,) + (1,) * missing + coeffs.shape[1:])
        return jnp.broadcast_to(coeffs, shape)

    return [broadcast(x) for x in invals]


def _finish(eqn: jex.JaxprEqn, coeffs: Array, affine: bool = False) -> list[Any]:
    (aval,) = _out_avals(eqn)
    return [_Series(coeffs.astype(aval.dtype), affine)]


def _linear_rule(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Primitives linear (or affine) in their floating inputs: apply per coefficient.

    Floating constants are lifted (zero higher coefficients), which is right for the
    additive primitives (`add`, `concatenate`, `pad`, `select_n` cases, ...); integer
    and boolean operands (indices, predicates) are shared by every coefficient.
    """
    num_terms = _num_terms(invals)
    args, axes = [], []
    for x in invals:
        if isinstance(x, _Series) or _is_inexact(x):
            args.append(_lift(x, num_terms))
            axes.append(0)
        else:
            args.append(x)
            axes.append(None)
    out = jax.vmap(lambda *a: _bind(eqn, *a), in_axes=axes)(*args)
    return [_Series(o, _all_affine(invals)) for o in _as_list(eqn, out)]


def _scaling_rule(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """A bilinear primitive with exactly one series input: linear in that input."""
    axes = [0 if isinstance(x, _Series) else None for x in invals]
    args = [x.coeffs if isinstance(x, _Series) else x for x in invals]
    out = jax.vmap(lambda *a: _bind(eqn, *a), in_axes=axes)(*args)
    return [_Series(out, _all_affine(invals))]


def _mul_rule(eqn, invals):
    if not all(isinstance(x, _Series) for x in invals):
        return _scaling_rule(eqn, invals)
    a, b = _elementwise_inputs(eqn, invals)
    return _finish(eqn, cauchy_product(a, b))


def _dot_general_rule(eqn, invals):
    if not all(isinstance(x, _Series) for x in invals):
        return _scaling_rule(eqn, invals)
    a, b = (x.coeffs for x in invals)
    (contract_a, contract_b), (batch_a, batch_b) = eqn.params["dimension_numbers"]

    def shift(dims):
        return tuple(d + 1 for d in dims)

    # Coefficient m is sum_j dot(a[j], b[m - j]): the coefficient axis of `a` and of
    # the window of `b` is contracted along with the primitive's own contraction.
    dimension_numbers = (
        ((0,) + shift(contract_a), (0,) + shift(contract_b)),
        (shift(batch_a), shift(batch_b)),
    )
    params = dict(eqn.params, dimension_numbers=dimension_numbers)
    flipped_b = _flip_pad(b)

    def coefficient(m):
        return eqn.primitive.bind(a, _window(flipped_b, m), **params)

    return _finish(eqn, lax.map(coefficient, jnp.arange(a.shape[0])))


def _div_rule(eqn, invals):
    numerator, denominator = invals
    if not isinstance(denominator, _Series):
        return _scaling_rule(eqn, invals)
    a, b = _elementwise_inputs(eqn, invals)
    return _finish(eqn, _divide(a, b))


def _unary(
    fn: Callable[[Array], Array],
    closed_form: Callable[[Array, Array, int], Array] | None = None,
    keeps_affine: bool = False,
) -> Callable:
    """A rule for an elementwise function: `fn` maps coefficients to coefficients;
    `closed_form(a, b, K + 1)` gives the coefficients of `f(a + b s)` directly."""

    def rule(eqn, invals):
        (x,) = _elementwise_inputs(eqn, invals)
        if closed_form is not None and _all_affine(invals):
            # x[1:2].sum(0) is x[1], or zero when K = 0.
            return _finish(eqn, closed_form(x[0], x[1:2].sum(axis=0), x.shape[0]))
        return _finish(eqn, fn(x), keeps_affine and _all_affine(invals))

    return rule


def _powers_over_factorials(b: Array, num_terms: int) -> Array:
    """`b**m / m!` for `m = 0..K`, as a running product so that neither `b**m` nor
    `m!` has to be representable on its own. (A loop with a one-multiply body:
    far cheaper to compile than `jnp.cumprod`.)"""

    def next_power(m, q):
        return _set(q, m, q[m - 1] * b / m.astype(b.dtype))

    first = _with_first(jnp.ones_like(b), num_terms)
    return lax.fori_loop(1, num_terms, next_power, first)


def _quarter_turns(num_terms: int, dtype: Any, ndim: int) -> tuple[Array, Array]:
    """`cos(m pi / 2)` and `sin(m pi / 2)` for `m = 0..K`, exactly."""
    m = jnp.arange(num_terms)
    odd = m & 1
    sign = 1 - 2 * ((m >> 1) & 1)
    shape = (num_terms,) + (1,) * ndim
    cos = ((1 - odd) * sign).astype(dtype).reshape(shape)
    sin = (odd * sign).astype(dtype).reshape(shape)
    return cos, sin


def _exp_affine(a: Array, b: Array, num_terms: int) -> Array:
    return jnp.exp(a) * _powers_over_factorials(b, num_terms)


def _sin_cos_affine(a: Array, b: Array, num_terms: int, sine: bool) -> Array:
    # The m-th derivative of sin(a + b s) is b^m sin(a + m pi / 2).
    turns_cos, turns_sin = _quarter_turns(num_terms, a.dtype, a.ndim)
    if sine:
        phase = jnp.sin(a) * turns_cos + jnp.cos(a) * turns_sin
    else:
        phase = jnp.cos(a) * turns_cos - jnp.sin(a) * turns_sin
    return phase * _powers_over_factorials(b, num_terms)


def _sinh_cosh_affine(a: Array, b: Array, num_terms: int, sinh: bool) -> Array:
    # Derivatives alternate between sinh and cosh.
    even = ((jnp.arange(num_terms) & 1) == 0).reshape((num_terms,) + (1,) * a.ndim)
    first, second = (jnp.sinh(a), jnp.cosh(a)) if sinh else (jnp.cosh(a), jnp.sinh(a))
    return jnp.where(even, first, second) * _powers_over_factorials(b, num_terms)


def _integer_pow_rule(eqn, invals):
    (x,) = _elementwise_inputs(eqn, invals)
    return _finish(eqn, _integer_power(x, int(eqn.params["y"])))


def _pow_rule(eqn, invals):
    base, exponent = invals
    x, y = _elementwise_inputs(eqn, invals)
    if not isinstance(exponent, _Series):
        return _finish(eqn, _power(x, y[0]))
    # x ** y = exp(y log x), with the value at zero taken from pow itself.
    result = _exp(cauchy_product(y, _log(x)))
    return _finish(eqn, _set_first(result, x[0] ** y[0]))


def _expm1(x):
    return _set_first(_exp(x), jnp.expm1(x[0]))


def _log1p(x):
    return _integral(_divide(_derivative(x), _one(x) + x), jnp.log1p(x[0]))


def _tanh(x):
    return _riccati(x, jnp.tanh(x[0]), 1.0, -1.0)


def _logistic(x):
    # logistic(x) = (1 + tanh(x / 2)) / 2
    half = _riccati(x / 2, jnp.tanh(x[0] / 2), 1.0, -1.0) / 2
    return _set_first(half, jax.nn.sigmoid(x[0]))


def _tan(x):
    return _riccati(x, jnp.tan(x[0]), 1.0, 1.0)


def _atan(x):
    return _integral(
        _divide(_derivative(x), _one(x) + cauchy_product(x, x)), jnp.arctan(x[0])
    )


def _asin(x):
    root = _sqrt(_one(x) - cauchy_product(x, x))
    return _integral(_divide(_derivative(x), root), jnp.arcsin(x[0]))


def _acos(x):
    root = _sqrt(_one(x) - cauchy_product(x, x))
    return _integral(-_divide(_derivative(x), root), jnp.arccos(x[0]))


def _asinh(x):
    root = _sqrt(_one(x) + cauchy_product(x, x))
    return _integral(_divide(_derivative(x), root), jnp.arcsinh(x[0]))


def _acosh(x):
    root = _sqrt(cauchy_product(x, x) - _one(x))
    return _integral(_divide(_derivative(x), root), jnp.arccosh(x[0]))


def _atanh(x):
    return _integral(
        _divide(_derivative(x), _one(x) - cauchy_product(x, x)), jnp.arctanh(x[0])
    )


def _erf(x):
    gaussian = _exp(-cauchy_product(x, x)) * (2 / np.sqrt(np.pi))
    return _integral_of(gaussian, jax.scipy.special.erf(x[0]), x)


def _abs(x):
    if jnp.iscomplexobj(x):
        squared = cauchy_product(x.real, x.real) + cauchy_product(x.imag, x.imag)
        return _sqrt(squared)
    # The piece active at the expansion point: +x or -x (+x at zero, as JAX does).
    return jnp.where(x[0] >= 0, x, -x)


def _atan2_rule(eqn, invals):
    y, x = _elementwise_inputs(eqn, invals)
    numerator = cauchy_product(x, _derivative(y)) - cauchy_product(y, _derivative(x))
    denominator = cauchy_product(x, x) + cauchy_product(y, y)
    return _finish(
        eqn, _integral(_divide(numerator, denominator), jnp.arctan2(y[0], x[0]))
    )


def _choose(first: Array, tie: Array, a: Array, b: Array) -> Array:
    """`a` where the expansion point chose it, `b` elsewhere, their mean at a tie.

    The mean at a tie matches JAX's own derivative of `max` and `min`.
    """
    return jnp.where(tie, (a + b) / 2, jnp.where(first, a, b))


def _max_rule(eqn, invals):
    a, b = _elementwise_inputs(eqn, invals)
    chosen = _choose(a[0] > b[0], a[0] == b[0], a, b)
    return _finish(eqn, chosen, _all_affine(invals))


def _min_rule(eqn, invals):
    a, b = _elementwise_inputs(eqn, invals)
    chosen = _choose(a[0] < b[0], a[0] == b[0], a, b)
    return _finish(eqn, chosen, _all_affine(invals))


def _clamp_rule(eqn, invals):
    lo, x, hi = _elementwise_inputs(eqn, invals)
    inner = jnp.where(x[0] > hi[0], hi, x)
    chosen = jnp.where(x[0] < lo[0], lo, inner)
    return _finish(eqn, chosen, _all_affine(invals))


def _reduce_chooser_rule(eqn, invals):
    """`reduce_max` / `reduce_min`: the coefficients at the extremal entries (averaged
    over ties, as JAX's derivative does)."""
    (x,) = invals
    coeffs = x.coeffs
    axes = tuple(eqn.params["axes"])
    primal = coeffs[0]
    if eqn.primitive.name == "reduce_max":
        extreme = jnp.max(primal, axis=axes, keepdims=True)
    else:
        extreme = jnp.min(primal, axis=axes, keepdims=True)
    chosen = primal == extreme
    count = jnp.sum(chosen, axis=axes)
    shifted = tuple(a + 1 for a in axes)
    total = jnp.sum(jnp.where(chosen, coeffs, 0), axis=shifted)
    return _finish(eqn, total / count)


def _rem_rule(eqn, invals):
    # rem(x, y) = x - y * trunc(x / y), with the quotient fixed at the expansion point.
    x, y = _elementwise_inputs(eqn, invals)
    quotient = jnp.trunc(x[0] / y[0])
    result = x - quotient * y
    return _finish(eqn, _set_first(result, lax.rem(x[0], y[0])))


def _cond_rule(eqn, invals):
    """Expand the branch selected at the expansion point (the index is a constant)."""
    index, *operands = invals
    num_terms = _num_terms(operands)
    is_series = [isinstance(x, _Series) for x in operands]
    out_avals = _out_avals(eqn)

    def expand_branch(closed):
        def branch(*arrays):
            vals = [_Series(a) if s else a for a, s in zip(arrays, is_series)]
            outs = _eval_jaxpr(closed.jaxpr, closed.consts, vals)
            # Every branch must return the same structure: floating outputs as series.
            return [
                _lift(o, num_terms) if _is_inexact_aval(aval) else _primal(o)
                for o, aval in zip(outs, out_avals)
            ]

        return branch

    arrays = [x.coeffs if isinstance(x, _Series) else x for x in operands]
    branches = [expand_branch(b) for b in eqn.params["branches"]]
    outs = lax.switch(index, branches, *arrays)
    return [
        _Series(o) if _is_inexact_aval(aval) else o for o, aval in zip(outs, out_avals)
    ]


def _is_inexact_aval(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


_LINEAR = (
    "neg add sub add_any convert_element_type reshape broadcast_in_dim transpose "
    "squeeze expand_dims slice dynamic_slice dynamic_update_slice gather scatter "
    "scatter-add scatter_add concatenate stack pad select_n real imag conj complex "
    "rev reduce_sum cumsum copy copy_p split reduce_precision sharding_constraint "
    "optimization_barrier"
).split()

# Piecewise-constant primitives: their derivatives are zero wherever they exist.
_PIECEWISE_CONSTANT = frozenset(
    "sign floor ceil round stop_gradient is_finite nextafter".split()
)

_RULES: dict[str, Callable[[jex.JaxprEqn, Sequence[Any]], list[Any]]] = {
    **{name: _linear_rule for name in _LINEAR},
    "mul": _mul_rule,
    "dot_general": _dot_general_rule,
    "div": _div_rule,
    "integer_pow": _integer_pow_rule,
    "pow": _pow_rule,
    "square": _unary(lambda x: cauchy_product(x, x)),
    "sqrt": _unary(_sqrt),
    "rsqrt": _unary(lambda x: _power(x, jnp.asarray(-0.5, x.dtype))),
    "cbrt": _unary(lambda x: _power(x, jnp.asarray(1 / 3, x.dtype))),
    "exp": _unary(_exp, _exp_affine),
    "exp2": _unary(lambda x: _set_first(_exp(x * np.log(2)), jnp.exp2(x[0]))),
    "expm1": _unary(
        _expm1, lambda a, b, k: _set_first(_exp_affine(a, b, k), jnp.expm1(a))
    ),
    "log": _unary(_log),
    "log1p": _unary(_log1p),
    "sin": _unary(
        lambda x: _sin_cos(x, -1.0)[0], ft.partial(_sin_cos_affine, sine=True)
    ),
    "cos": _unary(
        lambda x: _sin_cos(x, -1.0)[1], ft.partial(_sin_cos_affine, sine=False)
    ),
    "sinh": _unary(
        lambda x: _sin_cos(x, 1.0)[0], ft.partial(_sinh_cosh_affine, sinh=True)
    ),
    "cosh": _unary(
        lambda x: _sin_cos(x, 1.0)[1], ft.partial(_sinh_cosh_affine, sinh=False)
    ),
    "tan": _unary(_tan),
    "tanh": _unary(_tanh),
    "logistic": _unary(_logistic),
    "atan": _unary(_atan),
    "asin": _unary(_asin),
    "acos": _unary(_acos),
    "asinh": _unary(_asinh),
    "acosh": _unary(_acosh),
    "atanh": _unary(_atanh),
    "erf": _unary(_erf),
    "abs": _unary(_abs, keeps_affine=True),
    "atan2": _atan2_rule,
    "max": _max_rule,
    "min": _min_rule,
    "clamp": _clamp_rule,
    "reduce_max": _reduce_chooser_rule,
    "reduce_min": _reduce_chooser_rule,
    "rem": _rem_rule,
    "cond": _cond_rule,
}


# ----------------------------------------------------------------------------------
# Rules that keep values factored. Each returns None when it does not apply, and the
# equation then goes to the rules above with every factored input expanded.
# ----------------------------------------------------------------------------------


def _size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _factored_operands(eqn: jex.JaxprEqn, invals: Sequence[Any]) -> list[Any] | None:
    """The inputs with every series factored, or None if one must stay a series.

    A series is factored when it is small (at most `MAX_FACTORED_TERMS` entries) and
    the equation makes it larger: a broadcast, or a product with a constant array.
    """
    out_size = max(_size(aval.shape) for aval in _out_avals(eqn))
    operands = []
    for x in invals:
        if isinstance(x, _Series):
            size = _size(x.coeffs.shape[1:])
            if size > MAX_FACTORED_TERMS or size >= out_size:
                return None
            x = _Factored.of(x)
        operands.append(x)
    if not any(isinstance(x, _Factored) for x in operands):
        return None
    return operands


def _zeros_like_operand(x: Any) -> Array:
    return jnp.zeros_like(x.matrices[0] if isinstance(x, _Factored) else x)


# Linear over the reals only: they do not commute with a complex scalar factor
# (`conj` does, once the scalars are conjugated too).
_REAL_LINEAR = frozenset("real imag complex convert_element_type".split())


def _conjugated(x: Any) -> Any:
    """For `conj`: a factored operand with its scalars conjugated (the same array
    when they are real, so that `A + conj(A).T` still merges)."""
    if isinstance(x, _Factored) and x.complex_scalars:
        return _Factored(jnp.conj(x.scalars), x.matrices, x.constant)
    return x


def _factored_linear_rule(eqn, invals):
    """A primitive additive in its floating operands, term by term.

    Operands that share one `scalars` array (`A` and `A.T`, say, in `A + A.T`) are
    bound together, so their terms merge instead of adding up; floating constants
    form one more term with the unit series.
    """
    operands = _factored_operands(eqn, invals)
    if operands is None:
        return None
    complex_scalars = any(
        isinstance(x, _Factored) and x.complex_scalars for x in operands
    )
    if complex_scalars and eqn.primitive.name in _REAL_LINEAR:
        return None
    if eqn.primitive.name == "conj":
        operands = [_conjugated(x) for x in operands]
    floating = [
        i for i, x in enumerate(operands) if isinstance(x, _Factored) or _is_inexact(x)
    ]
    groups: dict[int, list[int]] = {}
    for i in floating:
        if isinstance(operands[i], _Factored):
            groups.setdefault(id(operands[i].scalars), []).append(i)
    out_avals = _out_avals(eqn)
    # The constant parts, all bound at once (if there are any).
    constant: list[Any] = [None] * len(out_avals)
    if any(
        not isinstance(operands[i], _Factored) or operands[i].constant is not None
        for i in floating
    ):
        constants = [
            x.constant_or_zeros() if isinstance(x, _Factored) else x for x in operands
        ]
        constant = _as_list(eqn, _bind(eqn, *constants))
    all_scalars, all_matrices = [], []
    for slots in groups.values():
        args = [
            x.matrices if i in slots else _zeros_like_operand(x) if i in floating else x
            for i, x in enumerate(operands)
        ]
        all_scalars.append(operands[slots[0]].scalars)
        axes = [0 if i in slots else None for i in range(len(args))]
        bind = jax.vmap(lambda *a: _bind(eqn, *a), in_axes=axes)
        all_matrices.append(_as_list(eqn, bind(*args)))
    scalars = jnp.concatenate(
        [x.astype(jnp.result_type(*all_scalars)) for x in all_scalars]
    )
    if scalars.shape[0] + 1 > MAX_FACTORED_TERMS:
        return None
    return [
        _Factored(scalars, jnp.concatenate([m[k] for m in all_matrices]), constant[k])
        for k in range(len(out_avals))
    ]


def _pairwise_products(a: Array, b: Array) -> Array:
    """The scalar series `a[l] * b[m]` for every pair, as `(La * Lb, K + 1)`."""
    num_terms = a.shape[1]
    shape = (num_terms, a.shape[0], b.shape[0])
    left = jnp.broadcast_to(a.T[:, :, None], shape)
    right = jnp.broadcast_to(b.T[:, None, :], shape)
    dtype = jnp.result_type(a, b)
    product = cauchy_product(left.astype(dtype), right.astype(dtype))
    return product.reshape(num_terms, -1).T


def _factored_product_rule(eqn, invals):
    """`mul`, `dot_general`, `div` by a constant: a product acts on the arrays of
    each term; two factored operands give every pair of terms."""
    operands = _factored_operands(eqn, invals)
    if operands is None:
        return None
    factored = [i for i, x in enumerate(operands) if isinstance(x, _Factored)]
    if eqn.primitive.name == "div" and factored != [0]:
        return None
    if len(factored) == 1:
        (i,) = factored
        x = operands[i]
        axes = [0 if j == i else None for j in range(len(operands))]
        args = [x.matrices if j == i else y for j, y in enumerate(operands)]
        matrices = jax.vmap(lambda *a: _bind(eqn, *a), in_axes=axes)(*args)
        constant = None
        if x.constant is not None:
            args = [x.constant if j == i else y for j, y in enumerate(operands)]
            constant = _bind(eqn, *args)
        return [_Factored(x.scalars, matrices, constant)]
    a, b = (x.with_constant_as_term() for x in operands)
    if a.scalars.shape[0] * b.scalars.shape[0] > MAX_FACTORED_TERMS:
        return None
    bind = jax.vmap(jax.vmap(lambda x, y: _bind(eqn, x, y), (None, 0)), (0, None))
    matrices = bind(a.matrices, b.matrices)
    matrices = matrices.reshape((-1,) + matrices.shape[2:])
    return [_Factored(_pairwise_products(a.scalars, b.scalars), matrices)]


def _factored_convert_rule(eqn, invals):
    """A cast of a small real series to a complex dtype (as `cos(t) * H1` with a
    complex `H1` begins) factors it with complex unit arrays, so that its scalars keep
    their real dtype: the recursion can then tell from dtypes alone that the scalar
    functions are real."""
    (x,) = invals
    if (
        isinstance(x, _Series)
        and not x.affine
        and not jnp.iscomplexobj(x.coeffs)
        and jnp.issubdtype(eqn.params["new_dtype"], jnp.complexfloating)
        and _size(x.coeffs.shape[1:]) <= MAX_FACTORED_TERMS
    ):
        factored = _Factored.of(x)
        matrices = factored.matrices.astype(eqn.params["new_dtype"])
        return [_Factored(factored.scalars, matrices)]
    return _factored_linear_rule(eqn, invals)


_FACTORED_RULES: dict[str, Callable[[jex.JaxprEqn, Sequence[Any]], Any]] = {
    **{name: _factored_linear_rule for name in _LINEAR},
    "convert_element_type": _factored_convert_rule,
    "mul": _factored_product_rule,
    "dot_general": _factored_product_rule,
    "div": _factored_product_rule,
}

# Primitives whose body is another jaxpr that can simply be inlined. For custom_jvp
# and custom_vjp functions this expands the primal function: exactly the function
# whose Taylor coefficients are asked for.
_INLINE_PARAM = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


# ----------------------------------------------------------------------------------
# The interpreter.
# ----------------------------------------------------------------------------------


def _depends_on_s(x: Any) -> bool:
    return isinstance(x, (_Series, _Factored))


def _eval_eqn(eqn: jex.JaxprEqn, invals: list[Any]) -> list[Any]:
    name = eqn.primitive.name
    if not any(map(_depends_on_s, invals)):
        return _as_list(eqn, _bind(eqn, *invals))
    if name in _INLINE_PARAM:
        body = eqn.params[_INLINE_PARAM[name]]
        if isinstance(body, jex.ClosedJaxpr):
            return _eval_jaxpr(body.jaxpr, body.consts, invals)
        return _eval_jaxpr(body, [], invals)
    if name in _PIECEWISE_CONSTANT or not any(
        _is_inexact_aval(a) for a in _out_avals(eqn)
    ):
        # Integer and boolean results (comparisons, argmax, casts to int) are
        # piecewise constant in s: their value at the expansion point is the series.
        return _as_list(eqn, _bind(eqn, *map(_primal, invals)))
    factored_rule = _FACTORED_RULES.get(name)
    if factored_rule is not None:
        outs = factored_rule(eqn, invals)
        if outs is not None:
            return outs
    invals = [x.expanded() if isinstance(x, _Factored) else x for x in invals]
    rule = _RULES.get(name)
    if rule is None:
        raise NotImplementedError(
            f"kdeqx cannot expand the primitive `{name}` in a Taylor series: it is "
            "applied to a value that depends on t. Rewrite that part of the function "
            "with supported operations (arithmetic, matmul, exp/log/sin/cos/tanh/..., "
            "where/max/abs, reshapes and indexing, lax.cond), or compute it outside "
            "the function if it does not depend on t."
        )
    return rule(eqn, invals)


def _eval_jaxpr(
    jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any]
) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        outvals = _eval_eqn(eqn, [read(v) for v in eqn.invars])
        # Dropped outputs (`_`) are stored too: nothing reads them, and JAX before
        # 0.10 has no public `DropVar` to test for.
        env.update(zip(eqn.outvars, outvals))
    return [read(v) for v in jaxpr.outvars]


def _identity_series(t: Float[Array, ""], num_terms: int) -> Float[Array, " terms"]:
    """Coefficients of `s -> t + s`: `[t, 1, 0, ..., 0]`."""
    orders = jnp.arange(num_terms)
    return jnp.where(orders == 0, t, jnp.where(orders == 1, 1, 0)).astype(t.dtype)


def _expand(
    fn: Callable[[Array], PyTree[Array]], t: Float[ArrayLike, ""], order: int
) -> tuple[list[Any], Any, int]:
    t = jnp.asarray(t)
    closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(t)
    num_terms = order + 1
    seed = _Series(_identity_series(t, num_terms), affine=True)
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, [seed])
    return outs, jax.tree.structure(out_shapes), num_terms


def taylor_coefficients(
    fn: Callable[[Array], PyTree[Array]], t: Float[ArrayLike, ""], order: int
) -> PyTree[Shaped[Array, "terms ..."]]:
    """Normalised Taylor coefficients of `s -> fn(t + s)` at `s = 0`.

    **Arguments:**

    - `fn`: a function of a real scalar returning an array or a pytree of arrays. It
        may close over arrays (including tracers), so gradients with respect to its
        parameters flow through the result.
    - `t`: the expansion point, a real floating scalar.
    - `order`: the truncation order `K` (static).

    **Returns:**

    The structure `fn` returns, each array `y` replaced by an array of shape
    `(K + 1, *y.shape)` whose row `m` is `y^(m)(t) / m!`.

    Raises `NotImplementedError` naming the primitive when part of `fn` that depends
    on `t` has no Taylor rule.
    """
    outs, structure, num_terms = _expand(fn, t, order)
    return jax.tree.unflatten(structure, [_lift(o, num_terms) for o in outs])


class FactoredCoefficients(NamedTuple):
    """Taylor coefficients of the form `coefficient[m] = sum_l scalars[l, m] *
    matrices[l]`: `J` scalar series times constant arrays. Where `constant_last`
    (known while tracing), the last term is the constant part: its scalar series is
    one, then zeros."""

    scalars: Shaped[Array, "J terms"]
    matrices: Shaped[Array, "J ..."]
    constant_last: bool = False


def taylor_expansion(
    fn: Callable[[Array], PyTree[Array]], t: Float[ArrayLike, ""], order: int
) -> PyTree[Shaped[Array, "terms ..."] | FactoredCoefficients]:
    """As [`taylor_coefficients`][], but an output that is a sum of at most
    `MAX_FACTORED_TERMS` scalar series times constant arrays (a constant among them)
    comes back as [`FactoredCoefficients`][] instead of its coefficients."""
    outs, structure, num_terms = _expand(fn, t, order)

    def as_returned(out):
        if isinstance(out, _Factored):
            constant = out.constant is not None
            out = out.with_constant_as_term()
            return FactoredCoefficients(out.scalars, out.matrices, constant)
        if isinstance(out, _Series):
            return out.coeffs
        out = jnp.asarray(out)
        unit = _with_first(jnp.ones((1,), jnp.finfo(out.dtype).dtype), num_terms)
        return FactoredCoefficients(unit.T, out[None], True)

    return jax.tree.unflatten(structure, [as_returned(o) for o in outs])
