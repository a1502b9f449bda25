"""OperatorSeries' Hermitian shortcuts: a Hermitian generator makes `V` unitary, so
`W = V^H`; a constant Hermitian observable besides pairs the Cauchy product's terms
as adjoints. Both are decided at run time, exactly; checked here against the general
recursion (the same steps with the shortcuts off) and, for derivatives, against
finite differences along directions that leave the Hermitian matrices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx
from kdeqx.series._recursion import _coefficients
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

    @jax.jit
    def general(t):
        h, x = _generator_terms(series, t)
        return _coefficients(h, x, ORDER, fast=False)

    expected = _reassembled(general(t))
    assert np.all(relative_errors(got, expected) < 1e-12)


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

    zero = jnp.float64(0.0)
    h = 1e-6
    finite_difference = (loss(zero + h) - loss(zero - h)) / (2 * h)
    _, forward = jax.jvp(loss, (zero,), (jnp.float64(1.0),))
    reverse = jax.grad(loss)(zero)
    assert abs(forward - finite_difference) < 1e-6 * abs(finite_difference)
    assert abs(reverse - finite_difference) < 1e-6 * abs(finite_difference)
