"""OperatorSeries: the operators `X_k = i[H, X_{k-1}] + dX_{k-1}/dt`, all at once.

The generator and the observable are expanded in Taylor series about `t`
(`_taylor.py`), kept factored where they are a few scalar functions times constant
matrices; the Heisenberg recursion (`_recursion.py`) turns the expansions into
`X_k / k!` in scaled form (`_scaled.py`). No nested `jacfwd`, so the compiled program
does not grow with `K`.
"""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Complex, Inexact, Int, Real, Shaped

from .._backend import FULL_PRECISION, outside_any_trace, quick_start_options
from ._recursion import (
    DenseTerms,
    FactoredTerms,
    heisenberg_coefficients,
    hermitian_shortcuts,
    QUICK_START_UP_TO,
    Terms,
)
from ._scaled import factorials, ldexp, Scaled
from ._taylor import FactoredCoefficients, taylor_coefficients, taylor_expansion


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


def _size_of(observable: Callable[[Array], Array] | Array) -> int | None:
    """`n` for an observable of shape `(n, n)`, found without computing anything; None
    where its output is not one square matrix (which the first evaluation reports)."""
    if callable(observable):
        t = jnp.zeros((), jnp.result_type(float))
        observable = eqx.filter_eval_shape(observable, t)
    shape = getattr(observable, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != shape[1]:
        return None
    return shape[0]


# From this much work on (`(K + 1)^2 n^3`: n = 32 from K = 11, n = 16 from K = 31,
# n = 8 from K = 90), a quick start is split in two programs (see [`_jit`][]). The
# split saves compile time and costs run time: a second dispatch and a wait for the
# shortcuts, and expansions compiled unoptimised, whose Taylor recurrences then run
# several times slower. From this much work on, a split first call is the shorter;
# below it, the slower runs outweigh the compile saved, which the smallest series
# (the question's n = 2, K = 9) would feel most (see `benchmarks/operator_series.py`).
# Repeated evaluations belong under `jax.jit`, which compiles one program with the
# default options.
SPLIT_FROM_WORK = 2**22


def _splitting_pays(series: "OperatorSeries") -> bool:
    """Whether a quick start is split in two programs: from [`SPLIT_FROM_WORK`][]."""
    assert series.size is not None
    return (series.order + 1) ** 2 * series.size**3 >= SPLIT_FROM_WORK


Finish = Callable[[Scaled, int], Any]


def _jit(finish: Finish) -> Callable:
    """A jitted `(series, t) -> finish(X_k / k! in scaled form, K)`.

    Where the series is small and the call is not inside another transformation (a
    user's `jit` compiles it as part of their program, with their options), it is
    compiled for a quick start. Past [`SPLIT_FROM_WORK`][] that is two programs: the
    expansions, unoptimised (`quick_start_options(optimise=False)`), and then, with
    the [`hermitian_shortcuts`][] they report fixed, the recursion, which holds only
    the branches they take: a shorter first call than as one program."""

    def whole(series: "OperatorSeries", t: Real[Array, ""]):
        hamiltonian, observable = _generator_terms(series, t)
        scaled = heisenberg_coefficients(hamiltonian, observable, series.order)
        return finish(scaled, series.order)

    def recursion(hamiltonian: Terms, observable: Terms, order: int, shortcuts):
        scaled = heisenberg_coefficients(hamiltonian, observable, order, shortcuts)
        return finish(scaled, order)

    plain = eqx.filter_jit(whole)

    @ft.cache
    def quick(fn: Callable) -> Callable:
        # `filter_jit` passes keywords on to `jax.jit`; its overloads omit them.
        options = quick_start_options()
        return eqx.filter_jit(fn, compiler_options=options)  # pyright: ignore

    @ft.wraps(finish)
    def call(series: "OperatorSeries", t: Real[Array, ""]):
        size = series.size
        small = size is not None and size <= QUICK_START_UP_TO
        if small and outside_any_trace() and quick_start_options():
            if not _splitting_pays(series):
                return quick(whole)(series, t)
            hamiltonian, observable, unitary, paired = _quick_terms()(series, t)
            shortcuts = (bool(unitary), bool(paired))
            return quick(recursion)(hamiltonian, observable, series.order, shortcuts)
        return plain(series, t)

    return call


class OperatorSeries(eqx.Module):
    """The operator sequence `X_0, X_1, ..., X_K` of a time-dependent generator.

    `X_0 = X(t)` and `X_k = i [H(t), X_{k-1}(t)] + d/dt X_{k-1}(t)`, with the general
    commutator `[A, B] = AB - BA` (neither `H` nor `X` need be Hermitian). `X_k / k!`
    are the Taylor coefficients in `s` of the Heisenberg-picture operator
    `V(s)⁻¹ X(t + s) V(s)`, `V' = -i H(t + s) V`, `V(0) = I`.

    The generator and the observable are fields, so when they are Equinox modules
    (an `eqx.nn.MLP` in `t`, say), `eqx.filter_grad` reaches their parameters. The
    static field `size` is `n`, read off the observable when the series is built
    (`None` if it is not one square matrix); up to `n = 128` a call made outside any
    transformation compiles with options that shorten XLA:CPU's compile markedly.

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
    factored: bool = eqx.field(static=True)
    size: int | None = eqx.field(static=True)

    def __init__(
        self,
        hamiltonian: Callable[[Array], Array],
        observable: Callable[[Array], Array] | ArrayLike,
        order: int,
        *,
        factored: bool = True,
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
        - `factored`: whether to use the structure of generators of the form
            `H(t) = sum_l f_l(t) A_l` (see [`kdeqx.OperatorSeries.factored_terms`][]);
            `False` forces the general path, which gives the same results more
            slowly.
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
        self.factored = bool(factored)
        self.size = _size_of(observable)

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

    def factored_terms(self, t: ArrayLike = 0.0) -> tuple[int | None, int | None]:
        """How many factored terms the recursion uses for the generator and for the
        observable: `J` where the function is `sum_l f_l(t) A_l` with `J` scalar
        functions `f_l` and constant matrices `A_l` (a constant counts as one term),
        and `None` where it takes the general path.

        The form is found while tracing, without being declared: linear operations
        (sums, transposes, `conj`, indexing, reshapes) and products with constants
        keep it, anything else (`expm(t A)`, `tanh` of a matrix, an MLP that outputs
        the matrix through a nonlinearity, a sum of more than 16 terms) leaves it.
        With `J` terms a step of the recursion costs `J` matrix products instead of
        `K + 2`, and the generator's coefficients take `O(J n^2)` memory.

        **Arguments:**

        - `t`: a real scalar time, for its dtype; nothing is computed.

        **Returns:**

        `(J_hamiltonian, J_observable)`, each an `int` or `None`.
        """
        counts = []

        def count_terms(series, t):
            for expansion in _expansions(series, t):
                counts.append(_factored_terms(expansion, series.order + 2))

        # Traced for shapes only: nothing is computed.
        eqx.filter_eval_shape(count_terms, self, _as_time(t))
        return counts[0], counts[1]

    def hermitian_shortcuts(self, t: ArrayLike = 0.0) -> tuple[bool, bool]:
        """Which of the recursion's Hermitian shortcuts hold at `t`; both are checked
        exactly (entry by entry, no tolerance) each time the series is evaluated.

        - `unitary`: `H(t + s)` is Hermitian for real `s` (its constant matrices are,
            and its scalar functions are real), so the propagator `V` is unitary and
            `V⁻¹ = V^H` costs no matrix products.
        - `paired`: besides, `X_0` is constant and Hermitian, so the terms
            `V[a]^H X_0 V[m - a]` and `V[m - a]^H X_0 V[a]` of the Cauchy product are
            adjoints: half of its `K^2 / 2` matrix products are skipped.

        Results agree with the general recursion to rounding; derivatives are always
        the general recursion's, so they stay exact along directions that make `H`
        non-Hermitian.

        **Arguments:**

        - `t`: a real scalar time.

        **Returns:**

        `(unitary, paired)`, Python bools (this evaluates the expansions at `t`).
        """
        unitary, paired = _hermitian_shortcuts(self, _as_time(t))
        return bool(unitary), bool(paired)


_Expansion = Shaped[Array, "terms n n"] | FactoredCoefficients


@eqx.filter_jit
def _hermitian_shortcuts(
    series: OperatorSeries, t: Real[Array, ""]
) -> tuple[Bool[Array, ""], Bool[Array, ""]]:
    return hermitian_shortcuts(*_generator_terms(series, t))


def _expansion(
    fn: Callable[[Array], Array],
    t: Real[Array, ""],
    order: int,
    what: str,
    factored: bool,
) -> _Expansion:
    # Shapes are checked on the result, so `fn` is traced once per compilation.
    expand = taylor_expansion if factored else taylor_coefficients
    result = expand(fn, t, order)
    if isinstance(result, FactoredCoefficients):
        shape = result.matrices.shape[1:]
    elif isinstance(result, jax.Array):
        shape = result.shape[1:]
    else:
        raise ValueError(
            f"`{what}` must return a single (n, n) array, got {type(result).__name__}."
        )
    _check_square(shape, what)
    return result


def _factored_terms(expansion: _Expansion, length: int) -> int | None:
    """`J` if the recursion should use the expansion's factored form: while that needs
    fewer matrix products per step than its coefficients (`J` against `length`)."""
    if isinstance(expansion, FactoredCoefficients):
        count = expansion.scalars.shape[0]
        return count if count < length else None
    return None


def _terms(expansion: _Expansion, dtype: Any, length: int) -> Terms:
    """The recursion's view of a generator: factored if [`_factored_terms`][] says
    so, else its coefficients."""
    # Constants (the matrices of `H0 + cos(t) H1`, a constant observable) would
    # otherwise be preprocessed by XLA's constant folding, slowly at large n.
    if isinstance(expansion, FactoredCoefficients):
        scalars, matrices = lax.optimization_barrier(expansion[:2])
        if _factored_terms(expansion, length) is not None:
            return FactoredTerms.of(
                scalars.astype(dtype),
                _in_precision(matrices, dtype),
                length,
                real_scalars=not jnp.iscomplexobj(scalars),
                constant_last=expansion.constant_last,
            )
        coefficients = jnp.tensordot(
            scalars.T, matrices, axes=1, precision=FULL_PRECISION
        )
    else:
        coefficients = lax.optimization_barrier(expansion)
    return DenseTerms.of(_in_precision(coefficients, dtype), length)


def _in_precision(matrices: Array, dtype: Any) -> Array:
    """`matrices` in the precision of the complex `dtype`, staying real if they are:
    real matrices take two real products where complex ones take three."""
    if jnp.iscomplexobj(matrices):
        return matrices.astype(dtype)
    return matrices.astype(jnp.finfo(dtype).dtype)


def _expansions(
    series: OperatorSeries, t: Real[Array, ""]
) -> tuple[_Expansion, _Expansion]:
    observable = series.observable
    if not callable(observable):
        observable = _constant(observable)
    order, factored = series.order, series.factored
    hamiltonian = _expansion(series.hamiltonian, t, order, "hamiltonian", factored)
    x0 = _expansion(observable, t, order, "observable", factored)
    h_shape, x_shape = (
        (e.matrices if isinstance(e, FactoredCoefficients) else e).shape[1:]
        for e in (hamiltonian, x0)
    )
    if h_shape != x_shape:
        raise ValueError(
            "`hamiltonian(t)` and `observable(t)` must have the same shape, got "
            f"{h_shape} and {x_shape}."
        )
    return hamiltonian, x0


def _generator_terms(series: OperatorSeries, t: Real[Array, ""]) -> tuple[Terms, Terms]:
    hamiltonian, x0 = _expansions(series, t)
    dtype = jnp.promote_types(
        jnp.result_type(t, *jax.tree.leaves((hamiltonian, x0))), jnp.complex64
    )
    length = series.order + 2
    return _terms(hamiltonian, dtype, length), _terms(x0, dtype, length)


def _terms_and_shortcuts(
    series: OperatorSeries, t: Real[Array, ""]
) -> tuple[Terms, Terms, Bool[Array, ""], Bool[Array, ""]]:
    hamiltonian, observable = _generator_terms(series, t)
    return hamiltonian, observable, *hermitian_shortcuts(hamiltonian, observable)


@ft.cache
def _quick_terms() -> Callable:
    """[`_terms_and_shortcuts`][] compiled unoptimised, the first program of a split
    quick start."""
    options = quick_start_options(optimise=False)
    return eqx.filter_jit(
        _terms_and_shortcuts,
        compiler_options=options,  # pyright: ignore
    )


@_jit
def _normalised_frexp(
    scaled: Scaled, order: int
) -> tuple[Complex[Array, "terms n n"], Int[Array, " terms"]]:
    return scaled.mantissa, scaled.exponent


@_jit
def _operators(scaled: Scaled, order: int) -> Complex[Array, "terms n n"]:
    mantissa, exponent = scaled.mantissa, scaled.exponent
    factorial_mantissa, factorial_exponent = factorials(
        order, jnp.finfo(mantissa.dtype).dtype
    )
    # X_k = (X_k / k!) * k!, with the powers of two added as integers.
    return ldexp(
        mantissa * factorial_mantissa[:, None, None],
        (exponent + factorial_exponent)[:, None, None],
    )


@_jit
def _normalised(scaled: Scaled, order: int) -> Complex[Array, "terms n n"]:
    return scaled.values()
