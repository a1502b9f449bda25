"""OperatorSeries and the Taylor arithmetic behind it, against independent references:
the question's nested-`jacfwd` recursion, closed forms, an exact polynomial recursion,
and finite differences."""

import functools as ft
import math

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx
from kdeqx import _backend
from kdeqx.series._taylor import taylor_coefficients

from .helpers import count_equations


DTYPES = [jnp.float32, jnp.float64]


def complex_dtype(dtype):
    return jnp.complex64 if dtype == jnp.float32 else jnp.complex128


def tolerance(dtype):
    return 5e-5 if dtype == jnp.float32 else 1e-11


def pauli(dtype):
    c = complex_dtype(dtype)
    sx = jnp.array([[0, 1], [1, 0]], c)
    sy = jnp.array([[0, -1j], [1j, 0]], c)
    sz = jnp.array([[1, 0], [0, -1]], c)
    return sx, sy, sz


def nested_jacfwd(hamiltonian, observable, order):
    """The question's recursion, with the general commutator `AB - BA`: X_k is
    `i[H, X_{k-1}] + jacfwd(X_{k-1})`, each level a new closure."""
    levels = [observable]
    for _ in range(order):
        previous = levels[-1]

        def level(t, previous=previous):
            h, x = hamiltonian(t), previous(t)
            return 1j * (h @ x - x @ h) + jax.jacfwd(previous)(t)

        levels.append(level)
    return jax.jit(lambda t: jnp.stack([f(t) for f in levels]))


def relative_errors(got, expected):
    """Per-order error relative to the size of the reference term."""
    got = np.asarray(got, np.complex128)
    expected = np.asarray(expected, np.complex128)
    error = np.max(np.abs(got - expected), axis=(-2, -1))
    scale = np.max(np.abs(expected), axis=(-2, -1))
    return error / np.maximum(scale, np.finfo(np.float64).tiny)


# --- The question's example: H = cos(t) sy, X_0 = sx ----------------------------------


def question(dtype, order):
    sx, sy, _ = pauli(dtype)
    return kdeqx.OperatorSeries(lambda t: jnp.cos(t) * sy, sx, order=order)


@ft.cache
def question_reference(order):
    sx, sy, _ = pauli(jnp.float64)
    fn = nested_jacfwd(lambda t: jnp.cos(t) * sy, lambda t: sx + 0 * t, order)
    return np.asarray(fn(jnp.float64(1.0)))


def question_closed_form(t, order):
    """`X_k / k! = Re(z_k / k!) sx + Im(z_k / k!) sz` with
    `z_k = exp(-2i sin t) d^k/dt^k exp(2i sin t)`: the Taylor coefficients of
    `exp(2i (sin(t + s) - sin t))`, by the scalar recurrence `m E[m] = sum_j j G[j]
    E[m - j]` in float64."""
    sin_derivatives = [np.sin(t), np.cos(t), -np.sin(t), -np.cos(t)]
    g = np.array(
        [2j * sin_derivatives[m % 4] / math.factorial(m) for m in range(order + 1)]
    )
    e = np.zeros(order + 1, complex)
    e[0] = 1.0
    for m in range(1, order + 1):
        j = np.arange(1, m + 1)
        e[m] = np.sum(j * g[j] * e[m - j]) / m
    sx, _, sz = (np.asarray(p) for p in pauli(jnp.float64))
    return e.real[:, None, None] * sx + e.imag[:, None, None] * sz


@pytest.mark.x64
@pytest.mark.parametrize("dtype", DTYPES)
def test_question_example(dtype):
    """Against the question's nested-jacfwd recursion for k <= 5, and the closed forms
    X_1 = 2 cos t sz, X_2 = -4 cos^2 t sx - 2 sin t sz."""
    sx, _, sz = pauli(dtype)
    got = question(dtype, order=5)(jnp.asarray(1.0, dtype))
    assert got.shape == (6, 2, 2)
    assert got.dtype == complex_dtype(dtype)
    assert np.all(relative_errors(got, question_reference(5)) < tolerance(dtype))
    c, s = np.cos(1.0), np.sin(1.0)
    np.testing.assert_allclose(got[0], sx, atol=tolerance(dtype))
    np.testing.assert_allclose(got[1], 2 * c * sz, atol=tolerance(dtype))
    expected = -4 * c**2 * sx - 2 * s * sz
    np.testing.assert_allclose(got[2], expected, atol=10 * tolerance(dtype))


@pytest.mark.x64
@pytest.mark.parametrize("dtype", DTYPES)
def test_question_normalised_to_order_100(dtype):
    """X_k / k! falls to 1e-43 at k = 100, below float32's range; the mantissa and
    exponent form keeps it to a few ulps of relative error anyway."""
    series = question(dtype, order=100)
    t = jnp.asarray(1.0, dtype)
    mantissa, exponent = series.normalised_frexp(t)
    assert mantissa.dtype == complex_dtype(dtype)
    assert exponent.shape == (101,)
    scale = np.ldexp(1.0, np.asarray(exponent))[:, None, None]
    got = np.asarray(mantissa, np.complex128) * scale
    expected = question_closed_form(1.0, 100)
    limit = 1e-5 if dtype == jnp.float32 else 1e-13
    assert np.all(relative_errors(got, expected) < limit)
    assert np.all(np.isfinite(mantissa))
    if dtype == jnp.float64:
        return
    # The plain normalised form is finite too, exact where it is representable.
    normalised = np.asarray(series.normalised(t), np.complex128)
    assert np.all(np.isfinite(normalised))
    representable = np.max(np.abs(expected), axis=(1, 2)) > 1e-30
    assert np.all(relative_errors(normalised, expected)[representable] < limit)


@pytest.mark.x64
def test_unnormalised_terms_and_float32_overflow():
    """X_k = (X_k / k!) k!; in float32 |X_k| passes the largest float near k = 44 and
    becomes inf (never nan)."""
    series = question(jnp.float32, order=60)
    t = jnp.float32(1.0)
    got = np.asarray(series(t))
    factorials = np.array([math.factorial(k) for k in range(31)], np.float64)
    expected = question_closed_form(1.0, 30) * factorials[:, None, None]
    assert np.all(relative_errors(got[:31], expected) < 1e-5)
    assert np.all(np.isfinite(got[:40]))
    assert not np.all(np.isfinite(got[50:]))
    assert not np.any(np.isnan(got))


# --- General generators ---------------------------------------------------------------


def random_matrix(key, n, hermitian, dtype):
    a, b = jax.random.normal(key, (2, n, n), jnp.float64)
    m = a + 1j * b
    if hermitian:
        m = (m + m.conj().T) / 2
    return m.astype(complex_dtype(dtype))


def hermitian_3x3(dtype):
    a, b, c, d = (
        random_matrix(k, 3, True, dtype) for k in jax.random.split(jax.random.key(1), 4)
    )

    def hamiltonian(t):
        return jnp.cos(1.3 * t) * a + jnp.sin(t) ** 2 * b + jnp.exp(-t) * c

    def observable(t):
        return d + t * (a @ b + b @ a) / 2

    return hamiltonian, observable


def non_hermitian_4x4(dtype):
    a, b, c, d = (
        random_matrix(k, 4, False, dtype)
        for k in jax.random.split(jax.random.key(2), 4)
    )

    def hamiltonian(t):
        return a + jnp.tanh(t) * b + (t * t) * (c @ d)

    def observable(t):
        return jnp.sin(2 * t) * d + c

    return hamiltonian, observable


CASES = {"hermitian_3x3": hermitian_3x3, "non_hermitian_4x4": non_hermitian_4x4}


@ft.cache
def case_reference(name, t, order):
    hamiltonian, observable = CASES[name](jnp.float64)
    return np.asarray(nested_jacfwd(hamiltonian, observable, order)(jnp.float64(t)))


@pytest.mark.x64
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_nested_jacfwd(name, dtype):
    hamiltonian, observable = CASES[name](dtype)
    series = kdeqx.OperatorSeries(hamiltonian, observable, order=5)
    got = series(jnp.asarray(0.4, dtype))
    assert got.dtype == complex_dtype(dtype)
    assert np.all(relative_errors(got, case_reference(name, 0.4, 5)) < tolerance(dtype))


def polynomial_reference(h_coeffs, x_coeffs, t, order):
    """X_k(t) / k! for polynomial H and X_0, by the recursion on exact polynomial
    matrices (row d is the coefficient of t^d), then evaluated at t."""

    def product(p, q):
        out = np.zeros((len(p) + len(q) - 1,) + p.shape[1:], complex)
        for i, pi in enumerate(p):
            for j, qj in enumerate(q):
                out[i + j] += pi @ qj
        return out

    def evaluate(p):
        return sum(c * t**d for d, c in enumerate(p))

    x = x_coeffs
    terms = [evaluate(x)]
    for k in range(1, order + 1):
        commutator = product(h_coeffs, x) - product(x, h_coeffs)
        derivative = np.concatenate(
            [x[1:] * np.arange(1, len(x))[:, None, None], np.zeros_like(x[:1])]
        )
        derivative = np.pad(derivative, [(0, len(commutator) - len(x))] + [(0, 0)] * 2)
        x = 1j * commutator + derivative
        terms.append(evaluate(x) / math.factorial(k))
    return np.stack(terms)


@pytest.mark.x64
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_hermitian_polynomial_generator_to_order_16(dtype):
    keys = jax.random.split(jax.random.key(5), 5)
    h = np.stack(
        [np.asarray(random_matrix(k, 4, False, jnp.float64)) for k in keys[:3]]
    )
    x = np.stack(
        [np.asarray(random_matrix(k, 4, False, jnp.float64)) for k in keys[3:]]
    )
    h_, x_ = jnp.asarray(h, complex_dtype(dtype)), jnp.asarray(x, complex_dtype(dtype))
    series = kdeqx.OperatorSeries(
        lambda t: h_[0] + t * h_[1] + t**2 * h_[2], lambda t: x_[0] + t * x_[1], 16
    )
    got = series.normalised(jnp.asarray(0.3, dtype))
    expected = polynomial_reference(h, x, 0.3, 16)
    limit = 1e-4 if dtype == jnp.float32 else 1e-10
    assert np.all(relative_errors(got, expected) < limit)


@pytest.mark.x64
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factored", [False, True])
def test_real_non_symmetric_polynomial_generator_to_order_16(dtype, factored):
    """Real coefficients take two real products instead of complex ones when given as
    coefficients (`factored=False`); a non-symmetric generator needs `W` by its own
    products, and a time-dependent observable its own."""
    keys = jax.random.split(jax.random.key(6), 5)
    h = np.stack([np.asarray(jax.random.normal(k, (4, 4))) for k in keys[:3]]) / 2
    x = np.stack([np.asarray(jax.random.normal(k, (4, 4))) for k in keys[3:]])
    h_, x_ = jnp.asarray(h, dtype), jnp.asarray(x, dtype)
    series = kdeqx.OperatorSeries(
        lambda t: h_[0] + t * h_[1] + t**2 * h_[2],
        lambda t: x_[0] + t * x_[1],
        16,
        factored=factored,
    )
    got = series.normalised(jnp.asarray(0.3, dtype))
    assert got.dtype == complex_dtype(dtype)
    expected = polynomial_reference(h, x, 0.3, 16)
    limit = 1e-4 if dtype == jnp.float32 else 1e-10
    assert np.all(relative_errors(got, expected) < limit)


@pytest.mark.x64
def test_order_zero_is_the_observable():
    sx, sy, _ = pauli(jnp.float64)
    series = kdeqx.OperatorSeries(lambda t: jnp.cos(t) * sy, lambda t: t * sx, 0)
    got = series(jnp.float64(0.5))
    assert got.shape == (1, 2, 2)
    np.testing.assert_allclose(got[0], 0.5 * sx)


@pytest.mark.x64
def test_real_generator_and_int_time():
    series = kdeqx.OperatorSeries(
        lambda t: jnp.array([[0.0, t], [t, 1.0]]), jnp.eye(2), order=3
    )
    got = series(1)
    assert jnp.iscomplexobj(got)
    expected = nested_jacfwd(
        lambda t: jnp.array([[0.0, t], [t, 1.0]]), lambda t: jnp.eye(2) + 0 * t, 3
    )(jnp.float64(1.0))
    np.testing.assert_allclose(got, expected, atol=1e-12)


# --- Transformations ------------------------------------------------------------------


class Generator(eqx.Module):
    """H(t) = cos(omega t) a + b b^T, with trainable a, b and omega."""

    a: jax.Array
    b: jax.Array
    omega: jax.Array

    def __call__(self, t):
        return jnp.cos(self.omega * t) * self.a + self.b @ self.b.T


def trainable_series(dtype, order=8):
    # Drawn in float64 for both dtypes, so that both describe the same problem.
    a, b = jax.random.normal(jax.random.key(3), (2, 3, 3), jnp.float64).astype(dtype)
    generator = Generator((a + a.T) / 2, b, jnp.asarray(1.3, dtype))
    observable = jnp.diag(jnp.array([1.0, 0.0, -1.0], dtype))
    return kdeqx.OperatorSeries(generator, observable, order=order)


def loss(series, t):
    return jnp.sum(jnp.abs(series.normalised(t)) ** 2)


def flat_grads(grads):
    return jax.flatten_util.ravel_pytree(eqx.filter(grads, eqx.is_inexact_array))[0]


@pytest.mark.x64
def test_grad_matches_finite_differences():
    """Gradients with respect to the generator's parameters, the observable and t in
    float64 against central differences; then in float32, under jit and vmap over t,
    against the float64 ones."""
    series = trainable_series(jnp.float64)
    t = jnp.float64(0.4)
    grads = eqx.filter_grad(lambda args: loss(*args))((series, t))
    params, static = eqx.partition((series, t), eqx.is_inexact_array)
    flat, unflatten = jax.flatten_util.ravel_pytree(params)
    flat_grad = flat_grads(grads)

    def loss_of_flat(v):
        return loss(*eqx.combine(unflatten(v), static))

    eps = 1e-6
    # Entries of a, b, omega, the observable, and t (the last one).
    for i in [0, 4, 9, 13, 18, 20, len(flat) - 1]:
        e = jnp.zeros_like(flat).at[i].set(eps)
        fd = (loss_of_flat(flat + e) - loss_of_flat(flat - e)) / (2 * eps)
        np.testing.assert_allclose(flat_grad[i], fd, rtol=1e-6)

    per_time = jax.jit(jax.vmap(eqx.filter_grad(loss), in_axes=(None, 0)))(
        trainable_series(jnp.float32), jnp.array([0.4, 0.9], jnp.float32)
    )
    first = jax.tree.map(lambda x: x[0], eqx.filter(per_time, eqx.is_inexact_array))
    g32, g64 = flat_grads(first), flat_grad[:-1]
    assert g32.dtype == jnp.float32
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-4 * np.max(np.abs(g64)))


@pytest.mark.x64
@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_over_time(dtype):
    series = question(dtype, order=12)
    ts = np.array([-1.0, 0.2, 1.0])
    mantissa, exponent = jax.vmap(series.normalised_frexp)(jnp.asarray(ts, dtype))
    assert mantissa.shape == (3, 13, 2, 2) and exponent.shape == (3, 13)
    batched = (
        np.asarray(mantissa, np.complex128) * np.ldexp(1.0, exponent)[..., None, None]
    )
    for got, t in zip(batched, ts):
        assert np.all(relative_errors(got, question_closed_form(t, 12)) < 1e-5)


class MLPGenerator(eqx.Module):
    """Three small MLPs in t, one per activation, summed into a symmetric 3 x 3
    matrix."""

    mlps: tuple[eqx.nn.MLP, ...]

    def __init__(self, depth):
        keys = jax.random.split(jax.random.key(4), 3)
        activations = [jax.nn.relu, jnp.tanh, jax.nn.softplus]
        self.mlps = tuple(
            eqx.nn.MLP("scalar", 9, 8, depth, activation=f, key=k)
            for f, k in zip(activations, keys)
        )

    def __call__(self, t):
        m = sum(mlp(t) for mlp in self.mlps).reshape(3, 3)
        return (m + m.T) / 2


def mlp_series(order, depth):
    observable = jnp.diag(jnp.array([1.0, 0.0, -1.0]))
    return kdeqx.OperatorSeries(MLPGenerator(depth), observable, order=order)


@pytest.mark.x64
def test_mlp_generator():
    """Against nested jacfwd, and its gradient against central differences (the
    differences reuse the compilation of the first check)."""
    series = mlp_series(order=3, depth=1)
    t = jnp.float64(0.4)
    observable = series.observable
    expected = nested_jacfwd(series.hamiltonian, lambda t: observable + 0 * t, 3)(t)
    factorials = np.array([math.factorial(k) for k in range(4)])[:, None, None]
    got = series.normalised(t)
    assert np.all(relative_errors(got, expected / factorials) < 1e-11)

    grads = eqx.filter_grad(loss)(series, t)
    assert np.all(np.isfinite(flat_grads(grads)))
    eps = 1e-6
    for i in range(3):
        bias = series.hamiltonian.mlps[i].layers[0].bias

        def shifted(delta):
            return eqx.tree_at(
                lambda s: s.hamiltonian.mlps[i].layers[0].bias,
                series,
                bias.at[3].add(delta),
            )

        fd = (loss(shifted(eps), t) - loss(shifted(-eps), t)) / (2 * eps)
        got = grads.hamiltonian.mlps[i].layers[0].bias[3]
        np.testing.assert_allclose(got, fd, rtol=1e-6)


# --- Taylor rules ---------------------------------------------------------------------


def analytic_functions(xp):
    """Analytic functions of t, written once for jax.numpy and once for numpy. `exp`,
    `sin`, `cos`, `sinh`, `cosh` of something affine in t take closed forms; of
    anything else, recurrences: both are covered."""
    return [
        lambda t: xp.exp(t) * xp.sin(2 * t) + xp.cos(t) / (t * t + 1),
        lambda t: xp.log(t + 2) + xp.sqrt(t + 1) + (t + 2) ** 1.7 + (t + 1) ** -3,
        lambda t: xp.tanh(t) + xp.tan(t / 2) + xp.arctan(t) + 1 / (1 + xp.exp(-t)),
        lambda t: xp.sinh(t) * xp.cosh(t / 3) + xp.arcsinh(t) + xp.arctanh(t / 3),
        lambda t: xp.arcsin(t / 3) - xp.arccos(t / 4) + xp.log1p(t) + xp.expm1(t),
        lambda t: (t + 2) ** t + 2.0**t + t**5 + (xp.exp(1j * t) - xp.exp(-1j * t)) * t,
        # Not affine in t: the recurrences rather than the closed forms.
        lambda t: (
            xp.sin(t * t)
            + xp.cos(xp.exp(t) / 3)
            + xp.sinh(t * t / 2)
            + xp.cosh(xp.sin(t))
            + xp.exp(xp.cos(t))
        ),
    ]


def cauchy_coefficients(fn, t, order, radius=0.5, points=64):
    """Taylor coefficients by the trapezoidal rule on a circle in the complex plane:
    exact to rounding for functions analytic on the disc."""
    w = np.exp(2j * np.pi * np.arange(points) / points)
    values = fn(t + radius * w)
    coeffs = np.fft.fft(values) / points / radius ** np.arange(points)
    return coeffs[: order + 1]


@pytest.mark.x64
def test_taylor_rules_to_order_12():
    t = 0.7
    got = jax.jit(
        lambda t: taylor_coefficients(
            lambda t: [f(t) for f in analytic_functions(jnp)], t, 12
        )
    )(jnp.float64(t))
    for i, (g, fn) in enumerate(zip(got, analytic_functions(np))):
        expected = cauchy_coefficients(fn, t, 12)
        if not jnp.iscomplexobj(g):
            expected = expected.real
        np.testing.assert_allclose(g, expected, rtol=1e-9, atol=1e-12, err_msg=str(i))


NONSMOOTH_AND_STRUCTURAL = {
    "piecewise": lambda t: jnp.abs(t - 3) * t + jnp.where(t > 0, t**3, jnp.cos(t)),
    "clip_max": lambda t: jnp.clip(t * t, 0, 5) + jnp.max(jnp.stack([t, t * t])),
    "nn": lambda t: (
        jax.nn.relu(jnp.sin(t))
        + jax.nn.softplus(t)
        + jax.nn.gelu(t)
        + jax.nn.sigmoid(t)
        + jax.scipy.special.erf(t)
    ),
    "complex": lambda t: jnp.abs(jnp.exp(1j * t) + 2) + (jnp.exp(1j * t) * t).imag,
    "matrices": lambda t: (
        jnp.array([[t, 1.0], [2 * t, t * t]]) @ jnp.array([[jnp.sin(t), 1.0], [t, 0.0]])
        + jnp.eye(2) * jnp.arctan2(jnp.sin(t), t + 1)
    ),
    "cond_indexing": lambda t: (
        jax.lax.cond(t > 0, jnp.sin, jnp.cos, t)
        + jnp.zeros(4).at[1].set(t).at[2].add(t * t)[1:3]
        + jnp.linalg.norm(jnp.array([t, 1.0, t * t]))
    ),
}


@pytest.mark.x64
def test_taylor_rules_against_nested_jacfwd():
    """Nonsmooth and structural primitives, to order 3 (at points away from kinks);
    the smooth rules are checked to order 12 above."""

    def fn(t):
        return {name: f(t) for name, f in NONSMOOTH_AND_STRUCTURAL.items()}

    t = jnp.float64(0.7)
    got = jax.jit(lambda t: taylor_coefficients(fn, t, 3))(t)

    @jax.jit
    def expected(t):
        terms, derivative = [fn(t)], fn
        for m in range(1, 4):
            derivative = jax.jacfwd(derivative)
            terms.append(jax.tree.map(lambda x: x / math.factorial(m), derivative(t)))
        return jax.tree.map(lambda *xs: jnp.stack(xs), *terms)

    for name, value in expected(t).items():
        np.testing.assert_allclose(
            got[name], value, rtol=1e-10, atol=1e-12, err_msg=name
        )


def test_taylor_coefficients_of_a_pytree_with_constants():
    fn = ft.partial(taylor_coefficients, lambda t: {"a": 2 * t, "b": (jnp.ones(2), 3)})
    out = jax.jit(fn, static_argnums=1)(1.5, 2)
    np.testing.assert_allclose(out["a"], [3.0, 2.0, 0.0])
    np.testing.assert_allclose(out["b"][0], [[1, 1], [0, 0], [0, 0]])
    np.testing.assert_array_equal(out["b"][1], [3, 0, 0])


# --- Errors ---------------------------------------------------------------------------


@pytest.mark.x64
def test_errors():
    sx, sy, _ = pauli(jnp.float64)
    t = jnp.float64(1.0)
    with pytest.raises(TypeError, match="(?i)callable"):
        kdeqx.OperatorSeries(sy, sx, order=3)
    with pytest.raises(ValueError, match=">= 0"):
        kdeqx.OperatorSeries(lambda t: sy, sx, order=-1)
    for bad_order in [2.0, True]:
        with pytest.raises(TypeError):
            kdeqx.OperatorSeries(lambda t: sy, sx, order=bad_order)  # pyright: ignore
    with pytest.raises(ValueError, match="square"):
        kdeqx.OperatorSeries(lambda t: sy, jnp.ones((2, 3)), order=2)
    with pytest.raises(ValueError, match="square"):
        kdeqx.OperatorSeries(lambda t: jnp.ones((2, 3)) * t, sx, order=2)(t)
    with pytest.raises(ValueError, match="square"):
        kdeqx.OperatorSeries(lambda t: jnp.ones(2) * t, sx, order=2)(t)
    with pytest.raises(ValueError, match="same shape"):
        kdeqx.OperatorSeries(lambda t: jnp.eye(3) * t, sx, order=2)(t)
    series = kdeqx.OperatorSeries(lambda t: jnp.cos(t) * sy, sx, order=2)
    with pytest.raises(ValueError, match="scalar"):
        series(jnp.ones(3))
    with pytest.raises(TypeError, match="real"):
        series(jnp.complex128(1.0))


@pytest.mark.x64
def test_unsupported_primitive_is_named():
    def hamiltonian(t):
        return jnp.diag(jnp.sort(jnp.stack([t, -t])))

    series = kdeqx.OperatorSeries(hamiltonian, jnp.eye(2), order=2)
    with pytest.raises(NotImplementedError, match="`sort`"):
        series(jnp.float64(1.0))


# --- Compilation ----------------------------------------------------------------------


def test_program_size_does_not_grow_with_order():
    t = jnp.float32(1.0)
    equations, hlo = [], []
    for order in [9, 60]:
        series = question(jnp.float32, order)
        equations.append(count_equations(jax.make_jaxpr(series.normalised)(t).jaxpr))
        hlo.append(len(jax.jit(lambda t: series(t)).lower(t).as_text()))
    assert equations[0] == equations[1]
    assert hlo[1] < 1.02 * hlo[0]


@pytest.mark.x64
def test_small_series_start_quickly_and_agree_inside_transformations(monkeypatch):
    """At the top level a small series is compiled with the quick-start options; inside
    `jit`, `vmap` and `grad` it is compiled with the caller's program. Both agree with
    the closed form."""
    from kdeqx.series import _series

    asked = []

    def spy(*args, **kwargs):
        asked.append(True)
        return _backend.quick_start_options(*args, **kwargs)

    monkeypatch.setattr(_series, "quick_start_options", spy)
    order, t = 14, jnp.float64(0.7)
    series = question(jnp.float64, order)
    assert series.size == 2
    expected = question_closed_form(0.7, order)
    top = series.normalised(t)
    assert asked
    asked.clear()
    inside = [
        jax.jit(lambda: series.normalised(t))(),
        jax.jit(lambda t: series.normalised(t))(t),
        jax.vmap(series.normalised)(jnp.stack([t, t]))[1],
    ]
    jax.grad(lambda t: series.normalised(t)[3, 0, 1].real)(t)
    assert not asked
    for got in [top, *inside]:
        assert np.max(relative_errors(got, expected)) < 1e-12
    # Beyond the quick-start size, the default options.
    monkeypatch.setattr(_series, "QUICK_START_UP_TO", 1)
    assert np.max(relative_errors(series.normalised(t), expected)) < 1e-12
    assert not asked


@pytest.mark.x64
@pytest.mark.parametrize("case", ["paired", "non_hermitian", "real_mlp"])
def test_quick_start_in_two_programs_agrees_with_one(monkeypatch, case):
    """Past `SPLIT_FROM_WORK` a top-level call expands in one program, reads the
    Hermitian shortcuts, and runs a recursion holding only their branches: the
    results are those of the one program a `jit` compiles."""
    from kdeqx.series import _series

    if case == "paired":
        series = question(jnp.float64, 20)
    elif case == "non_hermitian":
        hamiltonian, observable = non_hermitian_4x4(jnp.float64)
        series = kdeqx.OperatorSeries(hamiltonian, observable, order=20)
    else:
        series = mlp_series(order=20, depth=2)
    t = jnp.float64(0.4)
    # `normalised` differs from `normalised_frexp` only by the finish, `values()`.
    evaluations = [series, series.normalised_frexp]
    # Inside `jit`: one program.
    expected = [jax.jit(lambda t, f=f: f(t))(t) for f in evaluations]
    split = []
    quick_terms = _series._quick_terms

    def spy():
        split.append(True)
        return quick_terms()

    monkeypatch.setattr(_series, "SPLIT_FROM_WORK", 0)
    monkeypatch.setattr(_series, "_quick_terms", spy)
    for evaluate, want in zip(evaluations, expected):
        got = evaluate(t)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
    assert len(split) == 2
    shortcuts = series.hermitian_shortcuts(t)
    assert (
        shortcuts
        == {
            "paired": (True, True),
            "non_hermitian": (False, False),
            "real_mlp": (True, True),
        }[case]
    )


def test_size_of_array_and_callable_observables():
    sx, sy, _ = pauli(jnp.float32)
    assert kdeqx.OperatorSeries(lambda t: sy, sx, order=2).size == 2
    assert kdeqx.OperatorSeries(lambda t: sy, lambda t: t * sx, order=2).size == 2
    # Not one square matrix: no size, and the first evaluation says why.
    series = kdeqx.OperatorSeries(lambda t: sy, lambda t: jnp.ones(3) * t, order=2)
    assert series.size is None
    with pytest.raises(ValueError, match="square"):
        series(jnp.float32(1.0))


@pytest.mark.x64
def test_no_retracing():
    sx, sy, _ = pauli(jnp.float64)

    @eqx.debug.assert_max_traces(max_traces=1)
    def hamiltonian(t):
        return jnp.cos(t) * sy

    series = kdeqx.OperatorSeries(hamiltonian, sx, order=6)
    # Python floats are converted to arrays before the internal jit: no retrace.
    for t in [0.1, 0.2, jnp.float64(0.3)]:
        series.normalised(t)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def evaluate(series, t):
        return series(t)

    trainable = trainable_series(jnp.float64, order=3)
    for scale in [1.0, 2.0]:
        changed = eqx.tree_at(
            lambda s: s.hamiltonian.a, trainable, scale * trainable.hamiltonian.a
        )
        evaluate(changed, jnp.float64(scale))
