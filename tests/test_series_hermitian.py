"""OperatorSeries' shortcuts: a Hermitian generator makes `V` unitary, so
`W = V^H`; a constant Hermitian observable besides pairs the Cauchy product's terms
as adjoints; diagonal factored matrices scale rows or columns instead of multiplying.
All are decided at run time, exactly; checked here against the general recursion (the
same steps with the shortcuts off) and, for derivatives, against finite differences
along directions that leave the Hermitian (or diagonal) matrices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx
from kdeqx.series import _recursion
from kdeqx.series._recursion import _coefficients, FactoredTerms
from kdeqx.series._series import _generator_terms

from .test_series import random_matrix, relative_errors


N = 6
ORDER = 12


def _matrix(seed, hermitian):
    return random_matrix(jax.random.key(seed), N, hermitian, jnp.float64) / N


def _dense_hermitian(t):
    """A Hermitian generator with no factored form: an elementwise function of `t`
    times a Hermitian matrix."""
    angles = jnp.abs(jnp.real(_matrix(5, True)))
    return _matrix(0, True) * jnp.cos(t * (angles + angles.T))


def _driven(t):
    return _matrix(0, True) + jnp.cos(1.3 * t) * _matrix(1, True)


def _diagonal(seed, hermitian):
    return jnp.diag(jnp.diagonal(_matrix(seed, hermitian)))


# name: (hamiltonian, observable, W = V^H, adjoint pairs); built inside the tests,
# where float64 is on.
CASES = {
    "driven, constant observable": lambda: (
        _driven,
        _matrix(2, True),
        True,
        True,
    ),
    "driven, observable in time": lambda: (
        _driven,
        lambda t: _matrix(2, True) + jnp.sin(t) * _matrix(3, True),
        True,
        False,
    ),
    "driven, non-Hermitian observable": lambda: (
        _driven,
        _matrix(2, False),
        True,
        False,
    ),
    "no factored form": lambda: (_dense_hermitian, _matrix(2, True), True, True),
    "non-Hermitian generator": lambda: (
        lambda t: _matrix(0, False) + jnp.cos(1.3 * t) * _matrix(1, True),
        _matrix(2, True),
        False,
        False,
    ),
}


def _reassembled(scaled):
    return (
        np.asarray(scaled.mantissa)
        * np.ldexp(1.0, np.asarray(scaled.exponent))[:, None, None]
    )


def general_recursion(series, order):
    """`t -> X_k / k!` of `series` by the general recursion: no shortcuts, the
    direct Cauchy product."""

    @jax.jit
    def general(t):
        h, x = _generator_terms(series, t)
        return _coefficients(h, x, order, fast=False)

    return lambda t: _reassembled(general(t))


@pytest.mark.x64
@pytest.mark.parametrize("name", sorted(CASES))
def test_shortcuts_are_taken_where_they_hold(name):
    hamiltonian, observable, unitary, paired = CASES[name]()
    series = kdeqx.OperatorSeries(hamiltonian, observable, ORDER)
    assert series.hermitian_shortcuts(0.4) == (unitary, paired)


@pytest.mark.x64
@pytest.mark.parametrize("name", sorted(CASES))
def test_shortcuts_agree_with_the_general_recursion(name):
    hamiltonian, observable, _, _ = CASES[name]()
    series = kdeqx.OperatorSeries(hamiltonian, observable, ORDER)
    t = jnp.float64(0.4)
    mantissa, exponent = series.normalised_frexp(t)
    got = np.asarray(mantissa) * np.ldexp(1.0, np.asarray(exponent))[:, None, None]
    expected = general_recursion(series, ORDER)(t)
    assert np.all(relative_errors(got, expected) < 1e-12)


def _assert_derivatives_match_finite_differences(loss):
    """Forward and reverse derivatives of `loss` at zero against central
    differences."""
    zero = jnp.float64(0.0)
    h = 1e-6
    finite_difference = (loss(zero + h) - loss(zero - h)) / (2 * h)
    _, forward = jax.jvp(loss, (zero,), (jnp.float64(1.0),))
    reverse = jax.grad(loss)(zero)
    assert abs(forward - finite_difference) < 1e-6 * abs(finite_difference)
    assert abs(reverse - finite_difference) < 1e-6 * abs(finite_difference)


@pytest.mark.x64
def test_derivatives_leave_the_hermitian_matrices():
    """Along a direction that makes the generator non-Hermitian, `W = V^H` no longer
    holds: forward and reverse derivatives must still match finite differences (they
    take the general recursion's). One case: the derivative rule is the same for
    every kind of generator."""
    hamiltonian, observable, _, _ = CASES["driven, constant observable"]()
    direction = _matrix(7, False)
    t = jnp.float64(0.4)

    @jax.jit
    def loss(step):
        series = kdeqx.OperatorSeries(
            lambda s: hamiltonian(s) + step * direction, observable, ORDER
        )
        return jnp.sum(jnp.abs(series.normalised(t)) ** 2)

    _assert_derivatives_match_finite_differences(loss)


# Diagonal factored matrices: (hamiltonian, observable). `W` takes the shortcut from
# the right (`W H`), `V` and `P = X_0 V` from the left.
DIAGONAL_CASES = {
    "driven, diagonal observable": lambda: (_driven, _diagonal(2, True)),
    "diagonal non-Hermitian generator": lambda: (
        lambda t: _diagonal(0, False) + jnp.cos(1.3 * t) * _diagonal(1, False),
        lambda t: _matrix(2, False) + jnp.sin(t) * _matrix(3, True),
    ),
}
# An order of their own, so that no program traced without the shortcut (it starts
# at `DIAGONAL_FROM`, above these sizes) is reused from the jit caches.
DIAGONAL_ORDER = 11


@pytest.fixture
def diagonal_shortcut_at_any_size(monkeypatch):
    monkeypatch.setattr(_recursion, "DIAGONAL_FROM", 1)


@pytest.mark.x64
def test_diagonal_matrices_are_found_exactly(diagonal_shortcut_at_any_size):
    scalars = jnp.ones((1, 3), jnp.complex128)
    diagonal = _diagonal(2, True)[None]
    almost = diagonal.at[0, 0, N - 1].set(1e-300)
    assert FactoredTerms.of(scalars, diagonal, 5).diagonal
    assert not FactoredTerms.of(scalars, almost, 5).diagonal


@pytest.mark.x64
@pytest.mark.parametrize("name", sorted(DIAGONAL_CASES))
def test_diagonal_shortcut_agrees_with_the_products(
    name, diagonal_shortcut_at_any_size
):
    hamiltonian, observable = DIAGONAL_CASES[name]()
    series = kdeqx.OperatorSeries(hamiltonian, observable, DIAGONAL_ORDER)

    @jax.jit
    def both(t):
        h, x = _generator_terms(series, t)
        assert isinstance(h, FactoredTerms) and isinstance(x, FactoredTerms)
        fast = _coefficients(h, x, DIAGONAL_ORDER, fast=True)
        general = _coefficients(h, x, DIAGONAL_ORDER, fast=False)
        return fast, general, h.diagonal, x.diagonal

    fast, general, *diagonal = both(jnp.float64(0.4))
    assert [bool(flag) for flag in diagonal] == [
        name.startswith("diagonal"),
        name.endswith("diagonal observable"),
    ]
    errors = relative_errors(_reassembled(fast), _reassembled(general))
    assert np.all(errors < 1e-12)


@pytest.mark.x64
def test_derivatives_leave_the_diagonal_observable(diagonal_shortcut_at_any_size):
    """A diagonal observable scales `V`'s rows on the fast path; along a direction off
    its diagonal the derivative needs the products, and must match finite
    differences."""
    hamiltonian, observable = DIAGONAL_CASES["driven, diagonal observable"]()
    direction = _matrix(8, True)
    t = jnp.float64(0.4)

    @jax.jit
    def loss(step):
        x0 = observable + step * direction
        series = kdeqx.OperatorSeries(hamiltonian, x0, DIAGONAL_ORDER)
        return jnp.sum(jnp.abs(series.normalised(t)) ** 2)

    _assert_derivatives_match_finite_differences(loss)
