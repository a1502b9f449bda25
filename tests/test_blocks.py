"""The block engine (`engine="blocks"`) on the CPU: the same answers as the walk and
as the references (brute force, scipy), on every path it has (a block's search, the
rounds that narrow a reach, the queries searched alone, every leaf)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx
from kdeqx._backend import _lanes
from kdeqx._engine._blocks import walk_blocks
from kdeqx._engine._metric import Minkowski
from kdeqx._query._knn import _KNearest

from .helpers import assert_knn_correct, DATASETS, DTYPES, lattice_queries


N = 400


def _queries(rng, points, dataset, m, dtype):
    if dataset == "lattice":
        return lattice_queries(rng, m, points.shape[1]).astype(dtype)
    span = points.max(0) - points.min(0) + 0.1
    x = (points.min(0) - 0.05 + span * rng.random((m, points.shape[1]))).astype(dtype)
    x[:8] = points[:8]  # queries exactly at data points: zero distances
    return x


def _ulp(dtype) -> float:
    return float(np.finfo(dtype).eps)


@eqx.filter_jit
def _query(tree, x, k, **kwargs):
    return tree.query(x, k=k, **kwargs)


def test_engine_is_chosen_by_backend_and_checked():
    points = np.random.default_rng(0).random((50, 3))
    assert kdeqx.KDTree(points).engine == "walk"  # the CPU's
    assert kdeqx.KDTree(points, engine="blocks").engine == "blocks"
    with pytest.raises(ValueError, match="engine"):
        kdeqx.KDTree(points, engine="lanes")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dataset", list(DATASETS))
def test_knn_matches_brute_force_and_the_walk(dataset, dtype):
    rng = np.random.default_rng(list(DATASETS).index(dataset))
    points = DATASETS[dataset](rng, N, 3).astype(dtype)
    x = _queries(rng, points, dataset, 96, dtype)
    blocks = kdeqx.KDTree(points, engine="blocks")
    walk = kdeqx.KDTree(points, engine="walk")
    exact = dtype == np.float64 or dataset in ("lattice", "duplicates")
    for k in (1, 8, 40):  # rounds of minima up to 16, a sort beyond
        distances, indices = _query(blocks, x, k)
        assert distances.dtype == dtype
        assert_knn_correct(points, x, k, distances, indices, exact_ties=exact)
        walked = _query(walk, x, k)
        np.testing.assert_array_equal(indices, walked[1])
        # The same distances, summed in another order: equal to a few ulps.
        np.testing.assert_allclose(distances, walked[0], rtol=4 * _ulp(dtype))


def test_knn_matches_scipy_in_float64():
    rng = np.random.default_rng(1)
    points, x = rng.random((3000, 3)), rng.random((700, 3))
    with jax.enable_x64(True):
        distances, indices = _query(kdeqx.KDTree(points, engine="blocks"), x, 8)
        reference = cKDTree(points).query(x, 8)
        np.testing.assert_allclose(distances, reference[0], rtol=1e-12)
        np.testing.assert_array_equal(indices, reference[1])


@pytest.mark.parametrize("p", [1.0, 3.0, np.inf])
def test_other_norms_periodic_boxes_and_bounds_match_scipy(p):
    rng = np.random.default_rng(2)
    points = (rng.random((800, 3)) * 5).astype(np.float32)
    x = (rng.random((120, 3)) * 5).astype(np.float32)
    box = np.array([5.0, 5.0, 0.0], np.float32)  # the last axis not periodic
    tree = kdeqx.KDTree(points, box=box, engine="blocks")
    walk = kdeqx.KDTree(points, box=box, engine="walk")
    bound = 0.6
    distances, indices = _query(tree, x, 6, p=p, distance_upper_bound=bound)
    reference = cKDTree(points.astype(np.float64), boxsize=[5, 5, 1e9]).query(
        x.astype(np.float64), 6, p=p, distance_upper_bound=bound
    )
    np.testing.assert_allclose(distances, reference[0], rtol=1e-5)
    walked = _query(walk, x, 6, p=p, distance_upper_bound=bound)
    np.testing.assert_array_equal(indices, walked[1])


def test_eps_keeps_scipys_contract():
    rng = np.random.default_rng(3)
    points, x = rng.random((2000, 3)), rng.random((200, 3))
    tree = kdeqx.KDTree(points.astype(np.float32), engine="blocks")
    distances, _ = _query(tree, x.astype(np.float32), 5, eps=0.5)
    exact = cKDTree(points).query(x, 5)[0]
    assert np.all(np.asarray(distances) <= exact * 1.5 * (1 + 1e-5))
    assert np.all(np.asarray(distances) >= exact * (1 - 1e-5))


@pytest.mark.parametrize("dataset", ["uniform", "clustered", "duplicates"])
def test_radius_queries_match_scipy_and_the_walk(dataset):
    rng = np.random.default_rng(4)
    points = DATASETS[dataset](rng, 1000, 3).astype(np.float32)
    x = _queries(rng, points, dataset, 150, np.float32)
    r = (rng.random(150) * 0.3).astype(np.float32)
    tree = kdeqx.KDTree(points, engine="blocks")
    walk = kdeqx.KDTree(points, engine="walk")
    counts = tree.count_ball_point(x, r)
    reference = cKDTree(points).query_ball_point(x, r, return_length=True)
    np.testing.assert_array_equal(counts, reference)
    for capacity in (8, 64):
        got = tree.query_ball_point(x, r, max_neighbors=capacity)
        walked = walk.query_ball_point(x, r, max_neighbors=capacity)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(walked), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):  # summed in another order
                np.testing.assert_allclose(a, b, rtol=4 * _ulp(np.float32))
            else:
                np.testing.assert_array_equal(a, b)


def test_hostile_trees_and_queries():
    rng = np.random.default_rng(5)
    empty = kdeqx.KDTree(np.zeros((0, 3), np.float32), engine="blocks")
    distances, indices = _query(empty, rng.random((5, 3)).astype(np.float32), 2)
    assert np.all(np.isinf(distances)) and np.all(np.asarray(indices) == 0)
    few = rng.random((3, 3)).astype(np.float32)  # fewer points than k
    x = np.concatenate([rng.random((4, 3)), [[1e30, 0, 0], [-3e9, 2e9, 0]]])
    x = x.astype(np.float32)  # with far queries
    for points in (few, rng.random((700, 3)).astype(np.float32)):
        blocks = _query(kdeqx.KDTree(points, engine="blocks"), x, 5)
        walked = _query(kdeqx.KDTree(points, engine="walk"), x, 5)
        np.testing.assert_array_equal(blocks[1], walked[1])
        np.testing.assert_allclose(blocks[0], walked[0], rtol=4 * _ulp(np.float32))
    one = np.full((40, 3), 0.25, np.float32)  # every point the same
    blocks = _query(kdeqx.KDTree(one, engine="blocks"), x[:4], 7)
    np.testing.assert_array_equal(blocks[1], np.tile(np.arange(7), (4, 1)))


@pytest.mark.parametrize("kernel", ["idw", "gaussian"])
def test_interpolation_and_gradients_equal_the_walk(kernel):
    rng = np.random.default_rng(6)
    points = rng.random((600, 3)).astype(np.float32)
    values = np.sin(3 * points[:, 0]).astype(np.float32)
    x = jnp.asarray(rng.random((80, 3)).astype(np.float32))
    answers = []
    for engine in ("walk", "blocks"):
        tree = kdeqx.KDTree(points, engine=engine)
        extra = {"length_scale": 0.1} if kernel == "gaussian" else {}
        model = kdeqx.Interpolator(tree, values, k=8, kernel=kernel, **extra)
        value = eqx.filter_jit(lambda m, x: m(x))(model, x)
        grad = eqx.filter_jit(jax.grad(lambda x, m: m(x).sum()))(x, model)
        answers.append((value, grad))
    np.testing.assert_allclose(answers[0][0], answers[1][0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(answers[0][1], answers[1][1], rtol=1e-5, atol=1e-6)


def test_vmap_over_trees():
    rng = np.random.default_rng(7)
    points = rng.random((3, 300, 2)).astype(np.float32)
    x = rng.random((3, 40, 2)).astype(np.float32)
    trees = jax.vmap(lambda p: kdeqx.KDTree(p, engine="blocks"))(points)
    _, indices = jax.vmap(lambda t, x: t.query(x, k=4))(trees, x)
    for b in range(3):
        np.testing.assert_array_equal(indices[b], cKDTree(points[b]).query(x[b], 4)[1])


@pytest.mark.parametrize(
    "dataset, shape", [("uniform", (4, 2, 4, 2)), ("clustered", (8, 1, 2, 1))]
)
def test_tiny_budgets_take_every_fallback_and_stay_exact(monkeypatch, dataset, shape):
    """Budgets far too small: blocks overflow, narrow their reach in rounds, are
    searched query by query, and those take every leaf; the answers stay exact."""
    monkeypatch.setattr(_lanes, "_BLOCK_SHAPE", _lanes.BlockShape(*shape))
    rng = np.random.default_rng(8)
    points = DATASETS[dataset](rng, 600, 3).astype(np.float32)
    x = rng.random((90, 3)).astype(np.float32)
    tree = kdeqx.KDTree(points, leaf_size=8, engine="blocks")
    walk = kdeqx.KDTree(points, leaf_size=8, engine="walk")
    metric = Minkowski(2.0)
    visitor = _KNearest(6, jnp.asarray(jnp.inf, jnp.float32), np.dtype(np.int32))
    run = jax.jit(lambda t, x: walk_blocks(t, x, visitor, metric, None, count=True))
    _, overflowed = run(tree, x)
    assert overflowed > 0  # the fallbacks did run
    # Fresh programs: the shape is read when a query is traced.
    knn = jax.jit(lambda t, x: t.query(x, k=6))
    count = jax.jit(lambda t, x: t.count_ball_point(x, 0.2))
    np.testing.assert_array_equal(knn(tree, x)[1], knn(walk, x)[1])
    np.testing.assert_array_equal(count(tree, x), count(walk, x))
