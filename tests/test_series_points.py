"""OperatorSeries' Cauchy product from values at points on circles
(`kdeqx.series._points`): against numpy's direct sums for coefficients of every
profile (factorial decay, wild exponents, exact zeros), paired or not, on the CPU's
Gauss parts and on the complex products other backends take; and, lowered to small
problems, the whole series against the general recursion."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx
from kdeqx.series import _points, _recursion
from kdeqx.series._points import cauchy_product_at_points, circles, losses
from kdeqx.series._scaled import Scaled

from .test_series import random_matrix, relative_errors
from .test_series_factored import largest_intermediate, values
from .test_series_hermitian import general_recursion


def _random_series(rng, length, n, profile):
    """Complex coefficients whose sizes follow `profile`: `factorial` as
    `3^k / k!` (a propagator's), `wild` spanning 2^-600..2^0 with a zero row."""
    mantissa = rng.normal(size=(length, n, n)) + 1j * rng.normal(size=(length, n, n))
    k = np.arange(length)
    if profile == "factorial":
        exponent = np.round(
            [(j * math.log(3.0) - math.lgamma(j + 1)) / math.log(2) for j in k]
        ).astype(int)
    else:
        exponent = -rng.integers(0, 60, length) * k
        mantissa[4] = 0
    return mantissa * np.ldexp(1.0, exponent)[:, None, None]


def _operands(rng, length, n, profile, paired):
    """`(W, P)`, with `W = B^H` and `P = A B` for a Hermitian `A` where `paired`."""
    if paired:
        b = _random_series(rng, length, n, profile)
        a = rng.normal(size=(n, n)) + 1j * rng.normal(size=(n, n))
        w, p = np.conj(np.swapaxes(b, -1, -2)), (a + a.conj().T) @ b
    else:
        w = _random_series(rng, length, n, profile)
        p = _random_series(rng, length, n, profile)
    return Scaled.of(jnp.asarray(w)), Scaled.of(jnp.asarray(p))


def _direct(w: Scaled, p: Scaled) -> np.ndarray:
    wv, pv = np.asarray(w.values()), np.asarray(p.values())
    length = wv.shape[0]
    terms = [[wv[a] @ pv[m - a] for a in range(m + 1)] for m in range(length)]
    return np.stack([sum(row) for row in terms])


@pytest.mark.x64
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("pairing", ["none", "none at run time", "hermitian"])
@pytest.mark.parametrize("profile", ["factorial", "wild"])
@pytest.mark.parametrize("length", [11, 41])
def test_product_at_points_equals_the_direct_sums(backend, pairing, profile, length):
    """To 1e-13 of each coefficient's size, whichever circles serve it and whichever
    are summed directly; `backend="gpu"` runs the complex products other backends
    take (here on the CPU)."""
    rng = np.random.default_rng(length)
    paired = pairing == "hermitian"
    w, p = _operands(rng, length, 3, profile, paired)
    flag = False if pairing == "none" else jnp.asarray(paired)
    product = jax.jit(cauchy_product_at_points, static_argnames="backend")
    got = product(w, p, flag, backend=backend).values()
    assert np.all(relative_errors(got, _direct(w, p)) < 1e-13)


@pytest.mark.x64
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("paired", [False, True])
def test_product_at_points_reads_w_as_adjoint_planes(backend, paired):
    """`W = B^H` given as `B`'s planes read as adjoints (no copy of `W`): the same
    coefficients as `W` given itself, on the CPU's transposed Gauss parts and on
    the complex products other backends take."""
    rng = np.random.default_rng(7)
    w, p = _operands(rng, 41, 3, "factorial", paired=True)
    b = _points.PlaneSeries.of(Scaled(_points.adjoint(w.mantissa), w.exponent))
    from_planes = _points.PlaneSeries(b.planes, b.exponent, adjoint=True)
    product = jax.jit(cauchy_product_at_points, static_argnames="backend")
    got = product(from_planes, p, paired, backend=backend).values()
    assert np.all(relative_errors(got, _direct(w, p)) < 1e-13)
    expected = product(w, p, paired, backend=backend).values()
    assert np.all(relative_errors(got, expected) < 1e-14)


@pytest.mark.x64
@pytest.mark.parametrize("along_rows", [False, True])
def test_weighted_sums_of_planes(along_rows):
    """`sum_i weights[:, i] x[i]` for `x` given as real and imaginary planes, by a
    contraction and along the rows: numpy's sums, to rounding."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 4, 4)) + 1j * rng.normal(size=(7, 4, 4))
    weights = rng.normal(size=(3, 7)) + 1j * rng.normal(size=(3, 7))
    planes = _points.planes_of(jnp.asarray(x))
    got = _points.weighted_sums(jnp.asarray(weights), planes, along_rows)
    np.testing.assert_allclose(got, np.einsum("ji,ikl->jkl", weights, x), rtol=1e-13)


@pytest.mark.x64
def test_circles_serve_a_propagator_and_leave_wild_coefficients_to_direct_sums():
    """Factorial decay (K = 40): a few circles serve every coefficient but the
    lowest, which are cheaper summed directly. Wild exponents: most coefficients
    lie far below their neighbours, where no circle is accurate."""
    rng = np.random.default_rng(0)
    radii = jnp.arange(-32, 32.01, 0.25)
    for profile, expected in [("factorial", (1, 3)), ("wild", (0, 1))]:
        w, p = _operands(rng, 41, 3, profile, paired=False)
        loss, zero = losses(w.exponent, p.exponent, radii)
        # The circle's bound includes every term of the direct sum's.
        assert jnp.all(loss >= -1e-3)
        reachable = jnp.any(loss <= _points.LOSS_BITS, axis=1)
        _, used = circles(loss, reachable & ~zero, _points.MAX_CIRCLES, False)
        assert expected[0] <= int(jnp.sum(used)) <= expected[1], profile
        if profile == "wild":
            assert int(jnp.sum(~reachable & ~zero)) > 20


@pytest.mark.x64
def test_exact_zeros_stay_exact():
    """An even `W` and an odd `P` make every even coefficient of `W P` exactly
    zero: no circle's rounding may appear there."""
    rng = np.random.default_rng(1)
    w, p = _operands(rng, 33, 3, "factorial", paired=False)
    k = np.arange(33)
    w = Scaled(
        jnp.where((k % 2 == 0)[:, None, None], w.mantissa, 0),
        jnp.where(k % 2 == 0, w.exponent, -(2**20)),
    )
    p = Scaled(
        jnp.where((k % 2 == 1)[:, None, None], p.mantissa, 0),
        jnp.where(k % 2 == 1, p.exponent, -(2**20)),
    )
    got = np.asarray(jax.jit(cauchy_product_at_points)(w, p).values())
    assert np.all(got[::2] == 0)
    assert np.all(relative_errors(got, _direct(w, p))[1::2] < 1e-13)


def _forced_points(monkeypatch):
    monkeypatch.setattr(_recursion, "POINTS_FROM_WORK", 1)
    monkeypatch.setattr(_recursion, "POINTS_FROM_WORK_SMALL", 1)
    monkeypatch.setattr(_recursion, "POINTS_ORDER_FROM", 1)


def _matrix(seed, hermitian, n=5):
    return random_matrix(jax.random.key(seed), n, hermitian, jnp.float64) / n


CASES = {
    "driven, Hermitian, diagonal observable": lambda: (
        lambda t: _matrix(0, True) + jnp.cos(1.3 * t) * _matrix(1, True),
        jnp.diag(jnp.arange(5.0)).astype(jnp.complex128),
    ),
    "driven, not Hermitian, observable in time": lambda: (
        lambda t: _matrix(2, False) + jnp.exp(-t) * _matrix(3, False),
        lambda t: _matrix(4, True) + jnp.sin(t) * _matrix(5, False),
    ),
    "driven, Hermitian, observable in time": lambda: (
        lambda t: _matrix(0, True) + jnp.sin(t) * _matrix(6, True),
        lambda t: _matrix(4, True) + t * _matrix(5, True),
    ),
}


@pytest.mark.x64
@pytest.mark.parametrize("name", sorted(CASES))
def test_series_at_points_equals_the_general_recursion(monkeypatch, name):
    """Lowered to n = 5 and K = 30, the product at points gives the general
    recursion's coefficients to 1e-12, at one time and under `vmap` over times."""
    _forced_points(monkeypatch)
    hamiltonian, observable = CASES[name]()
    order = 30
    series = kdeqx.OperatorSeries(hamiltonian, observable, order)
    general = general_recursion(series, order)
    t = jnp.float64(0.4)
    assert np.all(relative_errors(values(series, t), general(t)) < 1e-12)
    batch = jnp.asarray([0.4, -1.1])
    batched = jax.vmap(series.normalised)(batch)
    for i, ti in enumerate(batch):
        assert np.all(relative_errors(batched[i], general(ti)) < 1e-12)


@pytest.mark.x64
@pytest.mark.parametrize("name", sorted(CASES))
def test_product_at_points_reads_the_propagators_planes(monkeypatch, name):
    """From `PLANES_FROM` on (lowered here to n = 5), the propagators hand `P` to the
    product at points as planes, and where the shortcuts are known in advance (a
    top-level call split in two programs) and `H` is Hermitian, `W = V^H` as `V`'s
    own planes read as adjoints: the general recursion's coefficients either way."""
    from kdeqx.series import _series

    _forced_points(monkeypatch)
    monkeypatch.setattr(_recursion, "PLANES_FROM", 1)
    monkeypatch.setattr(_series, "SPLIT_FROM_WORK", 0)
    left_read = []
    original = _recursion.cauchy_product_at_points

    def spy(left, right, *args, **kwargs):
        left_read.append(getattr(left, "adjoint", None))
        assert isinstance(right, _points.PlaneSeries)
        return original(left, right, *args, **kwargs)

    monkeypatch.setattr(_recursion, "cauchy_product_at_points", spy)
    hamiltonian, observable = CASES[name]()
    series = kdeqx.OperatorSeries(hamiltonian, observable, 30)
    general = general_recursion(series, 30)
    t = jnp.float64(0.4)
    split = series.normalised(t)  # the shortcuts known in advance
    unitary = series.hermitian_shortcuts(t)[0]
    assert left_read == [True if unitary else None]
    within_jit = jax.jit(lambda t: series.normalised(t))(t)  # read at run time
    assert left_read[1:] == [None]
    for got in [split, within_jit]:
        assert np.all(relative_errors(got, general(t)) < 1e-12)


@pytest.mark.x64
def test_product_at_points_is_taken_where_it_pays(monkeypatch):
    """At the thresholds' defaults, a factored series whose direct product costs
    `POINTS_FROM_WORK` multiply-adds (`POINTS_FROM_WORK_SMALL` up to n = 128 on the
    CPU) takes the product at points, smaller ones (in size or order) and unfactored
    ones the direct product; lowered, a small one takes it too."""
    calls = []
    original = _recursion.cauchy_product_at_points

    def counted(*args, **kwargs):
        calls.append(args[0].mantissa.shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(_recursion, "cauchy_product_at_points", counted)
    t = jnp.float64(0.3)

    def trace(n, order):
        def coefficients(h):
            series = kdeqx.OperatorSeries(lambda t: jnp.cos(t) * h, h, order)
            return series.normalised(t)

        jax.eval_shape(coefficients, jax.ShapeDtypeStruct((n, n), jnp.complex128))

    small = jax.default_backend() == "cpu"
    for n, order, taken in [
        (256, 40, True),
        (256, 30, False),
        (128, 40, small),
        (128, 31, small),
        (128, 30, False),
        (64, 90, small),
        (64, 89, False),
        (1024, 8, True),
    ]:
        trace(n, order)
        assert len(calls) == taken, (n, order)
        calls.clear()
    trace(1024, 7)
    assert not calls
    # A generator with no factored form keeps the direct product at any size.
    jax.eval_shape(
        lambda h: kdeqx.OperatorSeries(lambda t: jnp.cos(t * h), h, 40).normalised(t),
        jax.ShapeDtypeStruct((256, 256), jnp.complex128),
    )
    assert not calls
    _forced_points(monkeypatch)
    trace(5, 3)
    assert len(calls) == 1


def test_a_tpu_takes_the_product_at_points_only_for_larger_products():
    """A TPU compiles the product at points slowly: there it starts at n = 1024
    (K = 40); elsewhere at n = 256, or at n = 128 on the CPU, where small series
    compile for a quick start."""
    h = _recursion.FactoredTerms.of(
        jnp.ones((1, 3), jnp.complex64), jnp.eye(2, dtype=jnp.complex64)[None], 5
    )
    for n, backend, taken in [
        (256, "cpu", True),
        (128, "cpu", True),
        (64, "cpu", False),
        (128, "gpu", False),
        (256, "tpu", False),
        (512, "tpu", False),
        (1024, "tpu", True),
        (1024, "gpu", True),
    ]:
        assert _recursion._at_points_pays(h, n, 40, backend) == taken, (n, backend)


@pytest.mark.x64
def test_memory_and_program_stay_small_at_points(monkeypatch):
    """The product at points holds `O(K n^2)` entries (values at `2K + 2` points, in
    Gauss's three parts) and its program does not grow with the order."""
    _forced_points(monkeypatch)
    n, order = 16, 80
    h = _matrix(2, False, n)
    x = _matrix(3, False, n)
    t = jnp.float64(0.1)
    series = kdeqx.OperatorSeries(lambda t: h + jnp.cos(t) * x, x, order)
    jaxpr = jax.make_jaxpr(series.normalised_frexp)(t).jaxpr
    assert largest_intermediate(jaxpr) <= 10 * (order + 8) * n * n
    sizes = []
    for order in [9, 60]:
        series = kdeqx.OperatorSeries(lambda t: h + jnp.cos(t) * x, x, order)
        sizes.append(len(jax.jit(lambda t: series.normalised(t)).lower(t).as_text()))
    assert sizes[1] < 1.02 * sizes[0]


@pytest.mark.x64
@pytest.mark.parametrize("paired", [False, True])
def test_product_at_points_in_float32(paired):
    """In complex64 each coefficient is within the budget of `LOSS_BITS` bits of the
    direct sum's rounding (`2**8` float32 epsilons, `1.5e-5` of its size; the
    largest seen, 3e-6, a fifth of that), against the float64 sums of the same
    coefficients."""
    rng = np.random.default_rng(3)
    w, p = _operands(rng, 41, 3, "factorial", paired)
    w32 = Scaled(w.mantissa.astype(jnp.complex64), w.exponent)
    p32 = Scaled(p.mantissa.astype(jnp.complex64), p.exponent)
    got = jax.jit(cauchy_product_at_points)(w32, p32, jnp.asarray(paired)).values()
    expected = _direct(
        Scaled(w32.mantissa.astype(jnp.complex128), w.exponent),
        Scaled(p32.mantissa.astype(jnp.complex128), p.exponent),
    )
    assert np.all(relative_errors(got, expected) < 2.0**8 * 2.0**-24)
