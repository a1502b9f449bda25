import equinox as eqx
import jax
import numpy as np
import pytest

import kdeqx

from .helpers import x64_off


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_points_of_wrong_rank(shape):
    with pytest.raises(ValueError, match=r"shape \(n, d\), got shape"):
        kdeqx.KDTree(np.zeros(shape))


def test_points_with_no_columns():
    with pytest.raises(ValueError, match="d >= 1"):
        kdeqx.KDTree(np.zeros((5, 0)))


@pytest.mark.parametrize(
    "points",
    [np.zeros((4, 2), complex), np.zeros((4, 2), bool)],
    ids=["complex", "bool"],
)
def test_points_of_wrong_dtype(points):
    with pytest.raises(TypeError, match="must be real"):
        kdeqx.KDTree(points)


def test_queries_of_mismatched_dimension():
    tree = kdeqx.KDTree(np.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 3\).*got shape \(5, 2\)"):
        tree.query(np.zeros((5, 2)))
    with pytest.raises(ValueError, match="got shape"):
        tree.query(np.float64(1.0))


@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one(k):
    with pytest.raises(ValueError, match="`k` must be >= 1"):
        kdeqx.KDTree(np.zeros((4, 2))).query(np.zeros(2), k)


def test_k_not_an_int():
    # Under the test suite's runtime type checking, the annotation catches it first.
    with pytest.raises(TypeError, match="k"):
        kdeqx.KDTree(np.zeros((4, 2))).query(np.zeros(2), 2.0)


def test_bad_leaf_size():
    with pytest.raises(ValueError, match="leaf_size"):
        kdeqx.KDTree(np.zeros((4, 2)), leaf_size=0)
    with pytest.raises(TypeError, match="leaf_size"):
        kdeqx.KDTree(np.zeros((4, 2)), leaf_size=8.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_points_raise_eagerly_and_under_jit(bad):
    points = np.zeros((6, 2))
    points[3, 1] = bad
    with pytest.raises(ValueError, match=r"`points` must be finite.*index \(3, 1\)"):
        kdeqx.KDTree(points)
    with pytest.raises(eqx.EquinoxRuntimeError, match="`points` must be finite"):
        jax.block_until_ready(eqx.filter_jit(kdeqx.KDTree)(points))
    with pytest.raises(Exception, match="`points` must be finite"):
        jax.block_until_ready(jax.jit(kdeqx.KDTree)(points))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_queries_raise_eagerly_and_under_jit(bad):
    tree = kdeqx.KDTree(np.random.default_rng(0).random((6, 2)))
    x = np.zeros((3, 2))
    x[2, 0] = bad
    with pytest.raises(ValueError, match="`x` must be finite"):
        tree.query(x)
    with pytest.raises(eqx.EquinoxRuntimeError, match="`x` must be finite"):
        jax.block_until_ready(eqx.filter_jit(lambda t, x: t.query(x))(tree, x))
    with pytest.raises(Exception, match="`x` must be finite"):
        jax.block_until_ready(jax.jit(lambda t, x: t.query(x))(tree, x))


@pytest.mark.x64
def test_index_limits_never_wrap_around():
    too_many = jax.ShapeDtypeStruct((2**31, 1), np.float32)
    tree = eqx.filter_eval_shape(kdeqx.KDTree, too_many)  # x64 is on in the tests
    assert tree.leaf_indices.dtype == np.int64
    with x64_off():
        with pytest.raises(ValueError, match="need 64-bit integers"):
            eqx.filter_eval_shape(kdeqx.KDTree, too_many)
    fits = eqx.filter_eval_shape(
        kdeqx.KDTree, jax.ShapeDtypeStruct((2**20, 1), np.float32)
    )
    assert fits.leaf_indices.dtype == np.int32


def test_non_finite_values_and_radius_under_jit():
    tree = kdeqx.KDTree(np.random.default_rng(0).random((6, 2)))
    values = np.array([0.0, 1.0, np.nan, 0.0, 0.0, 0.0])
    interpolate = eqx.filter_jit(lambda t, v: t.interpolate(np.zeros(2), v, k=2))
    with pytest.raises(eqx.EquinoxRuntimeError, match="`values` must be finite"):
        jax.block_until_ready(interpolate(tree, values))
    count = eqx.filter_jit(lambda t, r: t.count_ball_point(np.zeros(2), r))
    with pytest.raises(eqx.EquinoxRuntimeError, match="`r` must be finite"):
        jax.block_until_ready(count(tree, np.nan))


def test_non_finite_box():
    with pytest.raises(ValueError, match="`box` must be finite"):
        kdeqx.KDTree(np.zeros((4, 2)), box=np.array([1.0, np.inf]))
