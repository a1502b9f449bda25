"""Every matrix product kdeqx computes asks for full precision: at the default, a TPU
multiplies float32 matrices in one bfloat16 pass, to about three significant digits.
A CPU computes the same either way, so this reads the programs' products."""

import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx
from kdeqx.series import _recursion


def _products(jaxpr) -> list:
    """Every `dot_general` of a program, its inner programs' included."""
    found = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    for inner in jex.subjaxprs(jaxpr):
        found += _products(inner)
    return found


def _assert_full_precision(fn, *args):
    products = _products(jax.make_jaxpr(fn)(*args).jaxpr)
    assert products, "the program holds no product to check"
    for eqn in products:
        precision = eqn.params["precision"]
        assert precision is not None, eqn
        assert all(p == lax.Precision.HIGHEST for p in precision), eqn


@pytest.mark.parametrize("path", ["factored", "at points", "dense"])
def test_operator_series_products_are_full_precision(path, monkeypatch):
    if path == "at points":
        monkeypatch.setattr(_recursion, "POINTS_FROM_WORK", 1)
        monkeypatch.setattr(_recursion, "POINTS_FROM_WORK_SMALL", 1)
    rng = np.random.default_rng(0)
    h0, h1, x0 = rng.normal(size=(3, 6, 6)) + 1j * rng.normal(size=(3, 6, 6))
    h0, h1 = (jnp.asarray(h + h.conj().T, jnp.complex64) for h in (h0, h1))
    x0 = jnp.asarray(x0, jnp.complex64)
    series = kdeqx.OperatorSeries(
        lambda t: h0 + jnp.cos(t) * h1, x0, order=10, factored=path != "dense"
    )
    t = jnp.float32(0.3)
    _assert_full_precision(lambda t: series.normalised(t), t)
    _assert_full_precision(jax.grad(lambda t: jnp.abs(series.normalised(t)).sum()), t)


@pytest.mark.parametrize("kernel", ["rbf", "mls"])
def test_local_fit_products_are_full_precision(kernel):
    rng = np.random.default_rng(0)
    points = rng.random((300, 3)).astype(np.float32)
    model = kdeqx.Interpolator(
        kdeqx.KDTree(points), jnp.asarray(np.sin(points[:, 0])), k=16, kernel=kernel
    )
    x = jnp.asarray(rng.random((20, 3)), jnp.float32)
    _assert_full_precision(lambda m, x: m(x), model, x)
    _assert_full_precision(jax.grad(lambda x: model(x).sum()), x)
