"""OperatorSeries' factored path, for generators `sum_l f_l(t) A_l`: which generators
take it, that it gives the general path's values and gradients (and the independent
references'), and that its memory and program stay small."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx
from kdeqx.series import _recursion
from kdeqx.series._recursion import _cauchy_product
from kdeqx.series._scaled import Scaled
from kdeqx.series._taylor import (
    FactoredCoefficients,
    MAX_FACTORED_TERMS,
    taylor_coefficients,
    taylor_expansion,
)

from .test_series import (
    complex_dtype,
    flat_grads,
    Generator,
    loss,
    nested_jacfwd,
    pauli,
    random_matrix,
    relative_errors,
    trainable_series,
)


DTYPES = [jnp.float32, jnp.float64]


def matrices(count, n, dtype, seed=0):
    """Non-Hermitian complex matrices of norm about 1."""
    keys = jax.random.split(jax.random.key(seed), count)
    return [random_matrix(k, n, False, dtype) / np.sqrt(2 * n) for k in keys]


DRIVES = [
    lambda t: jnp.cos(1.3 * t),
    lambda t: jnp.exp(-t),
    lambda t: t * t,
    lambda t: jnp.exp(2j * t),
]


def driven(dtype, terms, n=5):
    """`H0 + sum_j f_j(t) H_j` with `terms - 1` drives, non-Hermitian matrices, and a
    time-dependent observable of two terms."""
    h = matrices(terms, n, dtype)
    x = matrices(2, n, dtype, seed=1)

    def hamiltonian(t):
        return h[0] + sum(f(t) * m for f, m in zip(DRIVES, h[1:]))

    def observable(t):
        return x[0] + jnp.sin(2 * t) * x[1]

    return hamiltonian, observable


def values(series, t):
    """`X_k / k!` from `normalised_frexp`, reassembled in float64."""
    mantissa, exponent = series.normalised_frexp(t)
    return (
        np.asarray(mantissa, np.complex128)
        * np.ldexp(1.0, np.asarray(exponent))[:, None, None]
    )


# --- Which generators are factored ----------------------------------------------------


@pytest.mark.x64
def test_factored_terms_are_found_while_tracing():
    sx, sy, sz = pauli(jnp.float32)
    h0, h1, h2 = matrices(3, 2, jnp.float32)

    def hermitised(t):
        a = jnp.exp(1j * t) * h1
        return h0 + a + a.conj().T

    def coefficient_vector(t):
        drives = jnp.stack([jnp.cos(t), jnp.sin(t), t**2])
        return jnp.einsum("j,jab->ab", drives, jnp.stack([h0, h1, h2]))

    def too_many(t):
        return sum(jnp.cos(k * t) * h0 for k in range(MAX_FACTORED_TERMS + 1))

    cases = [
        (lambda t: jnp.cos(t) * sy, sx, (1, 1)),
        (lambda t: h0 + jnp.cos(t) * h1, sx, (2, 1)),
        (coefficient_vector, lambda t: jnp.sin(2 * t) * sx + sz, (3, 2)),
        (hermitised, sx, (3, 1)),
        (lambda t: (jnp.cos(t) * h1) @ (t * h2) + h0, sx, (2, 1)),
        (lambda t: jnp.tanh(jnp.cos(t) * h1), sx, (None, 1)),
        (too_many, lambda t: t * sx @ (t * sy), (None, 1)),
    ]
    for hamiltonian, observable, expected in cases:
        series = kdeqx.OperatorSeries(hamiltonian, observable, order=6)
        assert series.factored_terms() == expected
    unfactored = kdeqx.OperatorSeries(cases[1][0], sx, order=6, factored=False)
    assert unfactored.factored_terms() == (None, None)
    # With J terms at least as dear as the coefficients (K + 2 products), the
    # general path is taken.
    assert kdeqx.OperatorSeries(coefficient_vector, sx, 0).factored_terms() == (
        None,
        1,
    )


@pytest.mark.x64
def test_taylor_expansion_keeps_the_factored_form_exactly():
    h0, h1 = (np.asarray(m) for m in matrices(2, 3, jnp.float64))
    functions = {
        "driven": (lambda t: h0 + jnp.cos(t) * h1, 2),
        "conjugated": (lambda t: jnp.conj(jnp.exp(1j * t) * h1) + t * h0, 2),
        "transposed_sum": (lambda t: (lambda a: a + a.T)(jnp.exp(t) * h1), 1),
        "indexed": (lambda t: (jnp.cos(t) * h1)[1:, :2] * 3.0 + h0[:2, :2], 2),
        "real_part": (lambda t: (jnp.exp(1j * t) * h1).real, None),
        "nonlinear": (lambda t: jnp.exp(jnp.cos(t) * h1.real), None),
    }
    t = jnp.float64(0.7)
    for name, (fn, terms) in functions.items():
        expansion = taylor_expansion(fn, t, 9)
        dense = taylor_coefficients(fn, t, 9)
        if terms is None:
            assert not isinstance(expansion, FactoredCoefficients), name
            continue
        assert isinstance(expansion, FactoredCoefficients), name
        assert expansion.scalars.shape == (terms, 10), name
        assembled = jnp.tensordot(expansion.scalars.T, expansion.matrices, 1)
        np.testing.assert_allclose(assembled, dense, rtol=1e-14, atol=1e-15)


@pytest.mark.x64
def test_the_constant_term_is_known_while_tracing():
    """A constant part is the last term, flagged, with the unit series (one, then
    zeros), which the recursion relies on to skip its sums."""
    h0, h1 = (np.asarray(m) for m in matrices(2, 3, jnp.float64))
    cases = {
        "driven": (lambda t: h0 + jnp.cos(t) * h1, True),
        "no constant": (lambda t: jnp.cos(t) * h1 + t * h0, False),
        "constant only": (lambda t: h0, True),
        "constant product": (lambda t: (jnp.sin(t) * h1) @ h0 + h0 @ h0, True),
    }
    unit = np.eye(1, 10)[0]
    for name, (fn, constant) in cases.items():
        expansion = taylor_expansion(fn, jnp.float64(0.7), 9)
        assert isinstance(expansion, FactoredCoefficients), name
        assert expansion.constant_last is constant, name
        if constant:
            np.testing.assert_array_equal(expansion.scalars[-1], unit)


# --- The same results as the general path ---------------------------------------------


@pytest.mark.x64
@pytest.mark.parametrize("sums", ["contraction", "along rows", "rows so far"])
def test_sums_spare_the_constant_terms(monkeypatch, sums):
    """From `PLANES_FROM` on (lowered here), a factored generator and observable read
    the propagator as real planes, and their constant terms (`H0`, a constant `X_0`)
    scale its newest coefficient instead of summing over all of them: values and
    derivatives are the general path's, with and without constant terms. The sums
    of the other terms each way a backend may take them: by a contraction (the
    CPU's), along the rows (a TPU's), and over the rows up to the step's own alone
    (a TPU's from `SUMS_IN_PARTS_FROM` on)."""
    if sums != "contraction":
        monkeypatch.setattr(_recursion, "SUMS_ALONG_ROWS_ON", (jax.default_backend(),))
    if sums == "rows so far":
        monkeypatch.setattr(_recursion, "SUMS_IN_PARTS_FROM", 1)
    h0, h1, h2 = matrices(3, 4, jnp.float64)
    x0, x1 = matrices(2, 4, jnp.float64, seed=1)
    cases = [
        (lambda t: h0 + jnp.cos(t) * h1, x0),  # both with a constant term
        (lambda t: jnp.cos(t) * h1 + t * h2, lambda t: jnp.exp(-t) * x1),  # neither
        (lambda t: h0 + jnp.exp(1j * t) * h2, lambda t: x0 + t * x1),  # both, J = 2
    ]
    t = jnp.float64(0.4)
    monkeypatch.setattr(_recursion, "PLANES_FROM", 1)
    for hamiltonian, observable in cases:
        fast = kdeqx.OperatorSeries(hamiltonian, observable, 12)
        general = kdeqx.OperatorSeries(hamiltonian, observable, 12, factored=False)
        assert np.all(relative_errors(values(fast, t), values(general, t)) < 1e-12)

    def grad(series):
        return jax.grad(lambda t: jnp.sum(jnp.abs(series.normalised(t)) ** 2))(t)

    # Sums along the rows are differentiated where the rows so far are summed, each
    # part along the rows.
    if sums == "along rows":
        return
    hamiltonian, observable = cases[2]
    fast = kdeqx.OperatorSeries(hamiltonian, observable, 7)
    general = kdeqx.OperatorSeries(hamiltonian, observable, 7, factored=False)
    np.testing.assert_allclose(grad(fast), grad(general), rtol=1e-12)


@pytest.mark.x64
@pytest.mark.parametrize(
    "dtype, terms",
    [(jnp.float64, terms) for terms in (1, 2, 4)] + [(jnp.float32, 2)],
)
def test_factored_path_equals_general_path(dtype, terms):
    """To 1e-12 in float64. In float32 high orders lose digits to cancellation in the
    Cauchy product on either path, so there each path is held to the float64 result:
    the factored one must be as accurate as the general one."""
    hamiltonian, observable = driven(dtype, terms)
    reference_problem = driven(jnp.float64, terms)
    for order in [0, 1, 33]:
        fast = kdeqx.OperatorSeries(hamiltonian, observable, order)
        general = kdeqx.OperatorSeries(hamiltonian, observable, order, factored=False)
        # Factored while J terms cost fewer products than K + 2 coefficients.
        assert fast.factored_terms() == tuple(
            j if j < order + 2 else None for j in (terms, 2)
        )
        t = jnp.asarray(0.4, dtype)
        if dtype == jnp.float64:
            errors = relative_errors(values(fast, t), values(general, t))
            assert np.all(errors < 1e-12), order
            continue
        reference = kdeqx.OperatorSeries(*reference_problem, order, factored=False)
        expected = values(reference, jnp.float64(0.4))
        fast_errors = relative_errors(values(fast, t), expected)
        general_errors = relative_errors(values(general, t), expected)
        assert np.all(fast_errors <= 4 * general_errors + 1e-5), order


@pytest.mark.x64
def test_general_path_in_parts_equals_the_whole_product(monkeypatch):
    """From `PARTS_FROM` on (lowered here so that a small problem takes it), the
    general path multiplies only the parts of the order whose coefficients can meet
    the generator's: values and derivatives are those of the whole product."""
    hamiltonian, observable = driven(jnp.float64, 2)
    t = jnp.float64(0.4)

    def series():
        # New callables, so that nothing compiled before is reused.
        return kdeqx.OperatorSeries(
            lambda t: hamiltonian(t), lambda t: observable(t), 9, factored=False
        )

    def grad(series):
        return jax.grad(lambda t: jnp.sum(jnp.abs(series.normalised(t)) ** 2))(t)

    monkeypatch.setattr(_recursion, "PARTS_FROM", 10**9)
    whole = series()
    whole_values, whole_grad = values(whole, t), grad(whole)
    monkeypatch.setattr(_recursion, "PARTS_FROM", 1)
    for parts in [2, 3, 8]:  # 8 parts of 11 coefficients: some of one, some of two
        monkeypatch.setattr(_recursion, "PARTS", parts)
        in_parts = series()
        assert np.all(relative_errors(values(in_parts, t), whole_values) < 1e-13), parts
        if parts == 3:  # a gradient compiles slowly: one number of parts suffices
            np.testing.assert_allclose(grad(in_parts), whole_grad, rtol=1e-12)


@pytest.mark.x64
def test_factored_path_against_nested_jacfwd():
    hamiltonian, observable = driven(jnp.float64, 4, n=3)
    series = kdeqx.OperatorSeries(hamiltonian, observable, order=5)
    assert series.factored_terms() == (4, 2)
    got = series(jnp.float64(0.4))
    expected = nested_jacfwd(hamiltonian, observable, 5)(jnp.float64(0.4))
    assert np.all(relative_errors(got, expected) < 1e-11)


@pytest.mark.x64
def test_factored_gradients_equal_general_gradients():
    """`cos(omega t) a + b b^T`: the gradient with respect to a, b, omega, the
    observable and t is the general path's."""
    series = trainable_series(jnp.float64, order=12)
    assert series.factored_terms() == (2, 1)
    general = kdeqx.OperatorSeries(
        series.hamiltonian, series.observable, 12, factored=False
    )
    t = jnp.float64(0.4)

    def grads(series):
        return flat_grads(eqx.filter_grad(lambda args: loss(*args))((series, t)))

    expected = grads(general)
    np.testing.assert_allclose(grads(series), expected, rtol=1e-10, atol=1e-14)
    assert isinstance(series.hamiltonian, Generator)


class MLPDrives(eqx.Module):
    """`H(t) = sum_j mlp(t)_j A_j`: an MLP's outputs drive constant matrices."""

    mlp: eqx.nn.MLP
    matrices: jax.Array

    def __call__(self, t):
        return jnp.einsum("j,jab->ab", self.mlp(t), self.matrices)


@pytest.mark.x64
def test_mlp_drives_are_factored_and_differentiable():
    mlp = eqx.nn.MLP("scalar", 3, 8, 2, activation=jnp.tanh, key=jax.random.key(6))
    a = jnp.stack([jnp.real(m) for m in matrices(3, 4, jnp.float64)])
    generator = MLPDrives(mlp, (a + jnp.swapaxes(a, 1, 2)) / 2)
    observable = jnp.diag(jnp.arange(4.0))
    series = kdeqx.OperatorSeries(generator, observable, order=10)
    assert series.factored_terms() == (3, 1)
    general = kdeqx.OperatorSeries(generator, observable, 10, factored=False)
    t = jnp.float64(0.3)
    errors = relative_errors(values(series, t), values(general, t))
    assert np.all(errors < 1e-12)
    got, expected = (flat_grads(eqx.filter_grad(loss)(s, t)) for s in (series, general))
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-14)


@pytest.mark.x64
def test_vmap_over_drive_amplitudes():
    h0, h1 = matrices(2, 3, jnp.float64)
    sx = pauli(jnp.float64)[0]
    x0 = jnp.zeros((3, 3), complex_dtype(jnp.float64)).at[:2, :2].set(sx)

    def normalised(amplitude):
        series = kdeqx.OperatorSeries(
            lambda t: h0 + amplitude * jnp.cos(t) * h1, x0, order=8
        )
        return series.normalised(jnp.float64(0.2))

    amplitudes = jnp.array([0.0, 0.5, 2.0])
    batched = jax.vmap(normalised)(amplitudes)
    for got, amplitude in zip(batched, amplitudes):
        np.testing.assert_allclose(got, normalised(amplitude), rtol=1e-12, atol=1e-15)


# --- Memory and program size ----------------------------------------------------------


def largest_intermediate(jaxpr) -> int:
    """The most entries of any value in a jaxpr, its sub-jaxprs included."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(var.aval.shape, dtype=np.int64)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, largest_intermediate(inner))
    return largest


@pytest.mark.x64
@pytest.mark.parametrize("factored", [True, False])
def test_memory_is_linear_in_the_order(factored):
    """No intermediate holds the `K^2 n^2` entries of all products at once: the
    largest is a few times `K n^2` (the Gauss trick's three parts of a padded copy,
    for three series at once on the general path)."""
    n, order = 6, 80
    hamiltonian, observable = driven(jnp.float32, 3, n=n)
    series = kdeqx.OperatorSeries(hamiltonian, observable, order, factored=factored)
    jaxpr = jax.make_jaxpr(series.normalised_frexp)(jnp.float32(0.1)).jaxpr
    assert largest_intermediate(jaxpr) <= 10 * (order + 8) * n * n


@pytest.mark.x64
@pytest.mark.parametrize("factored", [True, False])
def test_program_size_does_not_grow_with_order(factored):
    hamiltonian, observable = driven(jnp.float32, 3)
    t = jnp.float32(0.1)
    sizes = []
    for order in [9, 60]:
        series = kdeqx.OperatorSeries(hamiltonian, observable, order, factored=factored)
        sizes.append(len(jax.jit(lambda t: series.normalised(t)).lower(t).as_text()))
    assert sizes[1] < 1.02 * sizes[0]


@pytest.mark.x64
@pytest.mark.parametrize("window", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("pairing", ["none", "none at run time", "hermitian"])
def test_cauchy_product_in_windows(window, pairing):
    """`Y[m] = sum_a W[a] P[m - a]` against numpy for every window size (the default
    depends on n), with coefficients spanning 2^-600..2^0 and a zero row; with
    `hermitian`, `W = B^H` and `P = A B` for a Hermitian `A`, whose products pair up
    as adjoints."""
    rng = np.random.default_rng(7)
    length, n = 11, 3
    hermitian = pairing == "hermitian"

    def random_scaled():
        mantissa = rng.normal(size=(length, n, n)) + 1j * rng.normal(
            size=(length, n, n)
        )
        exponent = -rng.integers(0, 60, length) * np.arange(length)
        mantissa[4] = 0
        return mantissa * np.ldexp(1.0, exponent)[:, None, None]

    if hermitian:
        b = random_scaled()
        a = rng.normal(size=(n, n)) + 1j * rng.normal(size=(n, n))
        w_values, p_values = np.conj(np.swapaxes(b, -1, -2)), (a + a.conj().T) @ b
    else:
        w_values, p_values = random_scaled(), random_scaled()
    w, p = Scaled.of(jnp.asarray(w_values)), Scaled.of(jnp.asarray(p_values))
    # A Python `False` takes the scan (the general path), a traced flag the loop.
    flag = False if pairing == "none" else jnp.asarray(hermitian)
    got = _cauchy_product(w, p, hermitian=flag, window=window).values()
    wv, pv = np.asarray(w.values()), np.asarray(p.values())
    expected = np.stack(
        [sum(wv[a] @ pv[m - a] for a in range(m + 1)) for m in range(length)]
    )
    assert np.all(relative_errors(got, expected) < 1e-13)
