"""The block engine's radius queries, interpolation, vmapped trees and fallbacks on
the CPU, against scipy and the walk (its kNN: `test_blocks.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx
from kdeqx._backend import _lanes
from kdeqx._engine import _blocks
from kdeqx._engine._blocks import CURVE_BITS, curve_order, walk_blocks
from kdeqx._engine._metric import Minkowski
from kdeqx._engine._search import search
from kdeqx._query._knn import _KNearest
from kdeqx._query._radius import _BallCollect

from .helpers import DATASETS, queries_around, ulp


@pytest.mark.parametrize("dataset", ["uniform", "clustered", "duplicates"])
def test_radius_queries_match_scipy_and_the_walk(dataset):
    rng = np.random.default_rng(4)
    points = DATASETS[dataset](rng, 1000, 3).astype(np.float32)
    x = queries_around(rng, points, dataset, 150, np.float32)
    r = (rng.random(150) * 0.3).astype(np.float32)
    tree = kdeqx.KDTree(points, engine="blocks")
    walk = kdeqx.KDTree(points, engine="walk")
    counts = tree.count_ball_point(x, r)
    reference = cKDTree(points).query_ball_point(x, r, return_length=True)
    np.testing.assert_array_equal(counts, reference)
    for capacity in (8, 64):  # kept nearest as they come; collected, then again
        got = tree.query_ball_point(x, r, max_neighbors=capacity)
        walked = walk.query_ball_point(x, r, max_neighbors=capacity)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(walked), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):  # summed in another order
                np.testing.assert_allclose(a, b, rtol=4 * ulp(np.float32))
            else:
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dataset", ["uniform", "duplicates"])
def test_full_balls_keep_the_nearest_and_count_every_point(dataset):
    """Balls of hundreds of points and a capacity of 24: collected, then searched
    again for the nearest (pruned by the last kept once full), counted in full."""
    rng = np.random.default_rng(12)
    points = DATASETS[dataset](rng, 3000, 3).astype(np.float32)
    x = rng.random((120, 3)).astype(np.float32)
    r, capacity = 0.25, 24
    tree = kdeqx.KDTree(points, engine="blocks", leaf_size=8)
    d, i, counts = jax.tree.leaves(tree.query_ball_point(x, r, max_neighbors=capacity))
    reference = cKDTree(points.astype(np.float64))
    np.testing.assert_array_equal(
        counts, reference.query_ball_point(x, r, return_length=True)
    )
    assert np.mean(counts > capacity) > 0.9
    walked = kdeqx.KDTree(points, engine="walk")
    walk_d, walk_i, _ = walked.query_ball_point(x, r, max_neighbors=capacity)
    np.testing.assert_array_equal(i, walk_i)
    # Both pruned by the farthest kept: the nearest, as scipy's distances say.
    nearest, _ = reference.query(x, k=capacity, distance_upper_bound=r * (1 + 1e-6))
    np.testing.assert_allclose(walk_d, nearest, rtol=1e-5)
    np.testing.assert_allclose(d, nearest, rtol=1e-5)
    d2 = ((points[None, :, :] - x[:, None, :]) ** 2).sum(-1)
    nearest = np.lexsort((np.broadcast_to(np.arange(3000), d2.shape), d2), axis=1)
    np.testing.assert_array_equal(i, nearest[:, :capacity])


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


def test_queries_searched_alone_in_groups_that_do_not_divide_them(monkeypatch, request):
    """Every block outgrows a tiny budget, so every query is searched alone, a group
    of `q // ALONE_FRACTION` at a time; the last group, cut short, searches the last
    queries (a slice past the end would move back onto queries searched already)."""
    from kdeqx._query._radius import _BallCount

    monkeypatch.setattr(_lanes, "_BLOCK_SHAPE", _lanes.BlockShape(4, 2, 4, 2))
    jax.clear_caches()  # the shape is read when a query is traced
    request.addfinalizer(jax.clear_caches)
    rng = np.random.default_rng(9)
    points = rng.random((600, 3)).astype(np.float32)
    x = rng.random((200, 3)).astype(np.float32)
    assert len(x) % (len(x) // _blocks.ALONE_FRACTION) != 0
    tree = kdeqx.KDTree(points, leaf_size=8, engine="blocks")
    r = np.float32(0.5)
    visitor = _BallCount(jnp.asarray(r * r), jnp.asarray(r * r), np.dtype(np.int32))
    run = jax.jit(lambda t, x: walk_blocks(t, x, visitor, Minkowski(2.0), None, True))
    _, overflowed = run(tree, x)
    assert overflowed == len(x) // 4  # every block
    expected = cKDTree(points).query_ball_point(x, r, return_length=True)
    counts = jax.jit(lambda t, x: t.count_ball_point(x, r))(tree, x)
    np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize(
    "dataset, shape, window, deep",
    [
        ("uniform", (4, 2, 4, 2), 32, False),
        ("clustered", (8, 1, 2, 1), 1, False),
        ("uniform", (4, 2, 8, 2), 32, True),
    ],
)
def test_tiny_budgets_take_every_fallback_and_stay_exact(
    monkeypatch, request, dataset, shape, window, deep
):
    """Budgets far too small: blocks overflow, narrow their reach in rounds, are
    searched query by query, and those take every leaf within reach, a window of
    leaves at a time (one chunk's: most windows have more within reach than
    fit); the answers stay exact. `deep`: a descent of a level a step, from the
    first level, as deep trees descend (the steps between the first and the last
    two as a loop, subtrees counted whole in it too)."""
    monkeypatch.setattr(_lanes, "_BLOCK_SHAPE", _lanes.BlockShape(*shape))
    monkeypatch.setattr(_blocks, "EVERY_WINDOW", window)
    if deep:
        monkeypatch.setattr(_blocks, "FIRST_LEVEL", 1)
        monkeypatch.setattr(_blocks, "STRIDE", 1)
        assert len(_blocks._schedule(7, 8)) > 1 + _blocks.UNROLLED + 2  # a loop
    # The queries' traces are cached by their static arguments, which hold no shape:
    # without this, they would reuse programs of the default shape.
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)  # nor may later tests reuse these
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
    count = jax.jit(lambda t, x, r: t.count_ball_point(x, r))
    np.testing.assert_array_equal(knn(tree, x)[1], knn(walk, x)[1])
    # More points for a first bound than the budget's leaves hold.
    many = jax.jit(lambda t, x: t.query(x, k=40))
    np.testing.assert_array_equal(many(tree, x)[1], many(walk, x)[1])
    for r in (0.2, 0.6):  # a few leaves within reach; many
        np.testing.assert_array_equal(count(tree, x, r), count(walk, x, r))
        expected = cKDTree(points).query_ball_point(x, r, return_length=True)
        np.testing.assert_array_equal(count(tree, x, r), expected)


def _balls_over_clusters(rng, central: float, widest: float):
    """3000 points in 6 tight clusters of the unit cube (wrapped into it); a query
    at each cluster's centre with radius `central`, and 60 uniform queries with
    radii up to `widest`."""
    centres = rng.random((6, 3))
    points = centres[rng.integers(0, 6, 3000)] + 0.01 * rng.normal(size=(3000, 3))
    points = np.mod(points, 1.0).astype(np.float32)
    x = np.concatenate([centres, rng.random((60, 3))]).astype(np.float32)
    r = np.concatenate([np.full(6, central), rng.random(60) * widest])
    return points, x, r.astype(np.float32)


@pytest.mark.parametrize("p, box", [(2.0, None), (1.0, None), (np.inf, 1.0)])
def test_counts_take_subtrees_within_the_ball_whole_and_stay_exact(p, box):
    """Radii that swallow whole clusters (subtrees counted by their size, not their
    leaves) and cut through others, against scipy; in a periodic box too."""
    points, x, r = _balls_over_clusters(np.random.default_rng(14), 0.05, 0.4)
    tree = kdeqx.KDTree(points, box=box, engine="blocks")
    reference = cKDTree(points.astype(np.float64), boxsize=box)
    expected = reference.query_ball_point(x, r, p=p, return_length=True)
    np.testing.assert_array_equal(tree.count_ball_point(x, r, p=p), expected)
    # One radius for all: one visitor shared by every query.
    expected = reference.query_ball_point(x, 0.2, p=p, return_length=True)
    np.testing.assert_array_equal(tree.count_ball_point(x, 0.2, p=p), expected)


def test_ball_lists_with_subtrees_counted_whole_are_searched_again():
    """Collecting the first found, dense balls count subtrees whole, unseen: those
    balls, full or not, are searched again for their nearest, and the lists equal
    the walk's (which sees every point) and scipy's."""
    points, x, r = _balls_over_clusters(np.random.default_rng(15), 0.03, 0.2)
    # Small leaves: a dense ball's frontier outgrows a block's budget.
    box = 1.0  # a periodic box: the queries are searched on one device, not split
    tree = kdeqx.KDTree(points, box=box, engine="blocks", leaf_size=8)
    walk = kdeqx.KDTree(points, box=box, engine="walk", leaf_size=8)
    capacity = 2048  # more than any ball holds
    metric = Minkowski(2.0)
    collect = jax.jit(
        lambda t, x, r: search(
            t,
            x,
            r,
            lambda r2: _BallCollect(capacity, r2, r2, np.dtype(np.int32), False),
            metric,
        )[0]
    )
    _, _, counts, listed = collect(tree, x, r)
    assert np.all(counts <= capacity)
    assert np.any(listed < counts)  # some balls did count subtrees whole
    reference = cKDTree(points.astype(np.float64), boxsize=box)
    lists = reference.query_ball_point(x, r)
    d, i, c = tree.query_ball_point(x, r, max_neighbors=capacity)
    want_d, want_i, want_c = walk.query_ball_point(x, r, max_neighbors=capacity)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(c, want_c)
    np.testing.assert_allclose(d, want_d, rtol=4 * ulp(np.float32))
    for row, expected in zip(np.asarray(i), lists, strict=True):
        assert sorted(row[row < len(points)]) == sorted(expected)


def test_query_order_is_a_stable_sort_of_the_codes_top_bits():
    """The radix passes that order queries on a TPU against NumPy's stable sort,
    with repeated keys; and the sorts elsewhere."""
    rng = np.random.default_rng(10)
    codes = rng.integers(0, 2**30, 1000).astype(np.uint32)
    codes[::7] = codes[0]
    for backend in ("tpu", "cpu"):
        order = jax.jit(lambda c: curve_order(c, 30, jnp.int32, backend))(codes)
        keys = codes >> (30 - CURVE_BITS) if backend == "tpu" else codes
        np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))


def test_queries_searched_a_group_of_blocks_at_a_time_stay_exact(monkeypatch, request):
    """Beyond `QUERIES_AT_ONCE` queries, blocks are searched a group at a time (the
    last group padded): kNN, counts with a radius per query and a graph's edges
    equal scipy's, ball lists the walk's."""
    monkeypatch.setattr(_blocks, "QUERIES_AT_ONCE", 40)
    jax.clear_caches()  # the constant is read when a query is traced
    request.addfinalizer(jax.clear_caches)
    rng = np.random.default_rng(21)
    points = rng.random((700, 3)).astype(np.float32)
    x = rng.random((333, 3)).astype(np.float32)
    r = (0.05 + 0.1 * rng.random(333)).astype(np.float32)
    tree = kdeqx.KDTree(points, leaf_size=8, engine="blocks")
    walk = kdeqx.KDTree(points, leaf_size=8, engine="walk")
    ref = cKDTree(points)
    d, i = tree.query(x, k=5)
    want_d, want_i = ref.query(x, k=5)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_allclose(d, want_d, rtol=1e-6)
    counts = tree.count_ball_point(x, r)
    np.testing.assert_array_equal(
        counts, ref.query_ball_point(x, r, return_length=True)
    )
    np.testing.assert_array_equal(
        tree.query_ball_point(x, r, max_neighbors=8)[0],
        walk.query_ball_point(x, r, max_neighbors=8)[0],
    )
    graph = kdeqx.radius_graph(points, 0.1, 20000, engine="blocks")
    pairs = ref.query_pairs(0.1)
    edges = np.stack([graph.senders, graph.receivers], 1)[: int(graph.count)]
    assert int(graph.count) == 2 * len(pairs)
    assert set(map(tuple, edges)) == pairs | {(j, i) for i, j in pairs}
