import equinox as eqx
import jax
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx

from .helpers import DATASETS, DTYPES, lattice_queries


def _brute_ball(points, x, r):
    d = np.linalg.norm(x[:, None, :] - points[None], axis=-1)
    return [np.flatnonzero(row <= ri) for row, ri in zip(d, r)], d


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dataset", list(DATASETS))
def test_count_matches_scipy(dataset, dtype):
    rng = np.random.default_rng(list(DATASETS).index(dataset))
    points = DATASETS[dataset](rng, 500, 3).astype(dtype)
    if dataset == "lattice":
        x = lattice_queries(rng, 50, 3).astype(dtype)
        r = np.full(50, 1.5, dtype)  # no lattice distance is 1.5: no boundary rounding
    else:
        x = (points.min(0) + rng.random((50, 3)) * np.ptp(points, 0)).astype(dtype)
        r = (rng.random(50) * 0.3).astype(dtype)
    counts = kdeqx.KDTree(points).count_ball_point(x, r)
    reference = cKDTree(points).query_ball_point(x, r, return_length=True)
    np.testing.assert_array_equal(counts, reference)


def test_count_with_a_scalar_radius_and_single_query():
    rng = np.random.default_rng(0)
    points = rng.random((300, 2))
    tree = kdeqx.KDTree(points)
    x = rng.random(2)
    expected = cKDTree(points).query_ball_point(x, 0.2, return_length=True)
    assert tree.count_ball_point(x, 0.2) == expected
    assert tree.count_ball_point(x, 0.0) == 0
    assert (
        tree.count_ball_point(points[5], 0.0) == 1
    )  # the closed ball holds its centre


@pytest.mark.parametrize(
    "dtype, capacity, m, engine",
    [(dtype, capacity, 40, "walk") for dtype in DTYPES for capacity in (12, 100)]
    # beyond n: one dtype (it compiles the largest program)
    + [(np.float64, 1000, 40, "walk")]
    # More queries than lanes: the lanes' walk, which keeps the nearest 100 of an
    # overflowing ball by merging two leaves at a time.
    + [(np.float32, 100, 300, "walk")]
    # The overflowing balls searched again a few queries at a time, on each engine.
    + [(np.float32, 100, 300, "walk, in groups"), (np.float32, 100, 300, "blocks")],
)
def test_query_ball_point_returns_the_nearest_within_r(
    dtype, capacity, m, engine, monkeypatch, request
):
    # Capacities beyond 16 collect, then sort (or keep the nearest by bitonic networks
    # when a query overflows, only those queries again); beyond n, only n.
    from kdeqx._query import _radius

    if engine != "walk":
        monkeypatch.setattr(_radius, "AGAIN_AT_LEAST", 7)
        jax.clear_caches()  # read when a query is traced
        request.addfinalizer(jax.clear_caches)
    rng = np.random.default_rng(1)
    points = rng.random((800, 3)).astype(dtype)
    x = rng.random((m, 3)).astype(dtype)
    r = (rng.random(m) * (0.25 if capacity == 12 else 0.7)).astype(dtype)
    tree = kdeqx.KDTree(points, engine="blocks" if engine == "blocks" else "walk")
    # As numpy arrays: slicing a JAX array by varying bounds compiles each slice.
    distances, indices, counts = map(np.asarray, tree.query_ball_point(x, r, capacity))
    assert indices.shape == (m, capacity)
    if engine != "walk":
        assert np.sum(counts > capacity) > 7  # searched again in several groups
    inside, d = _brute_ball(points.astype(np.float64), x.astype(np.float64), r)
    reference = cKDTree(points).query_ball_point(x, r)
    for q in range(m):
        assert counts[q] == len(inside[q]) == len(reference[q])
        order = inside[q][np.lexsort((inside[q], d[q, inside[q]]))][:capacity]
        m = len(order)
        np.testing.assert_array_equal(indices[q, :m], order)
        assert (np.asarray(indices[q, m:]) == 800).all()
        assert np.isinf(distances[q, m:]).all()
        rtol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(distances[q, :m], d[q, order], rtol=rtol)


def test_overflow_is_visible_and_can_raise():
    points = np.zeros((20, 2))
    tree = kdeqx.KDTree(points)
    _, indices, counts = tree.query_ball_point(np.zeros(2), 1.0, 4)
    assert counts == 20
    np.testing.assert_array_equal(indices, [0, 1, 2, 3])
    with pytest.raises(eqx.EquinoxRuntimeError, match="more than max_neighbors=4"):
        query = eqx.filter_jit(
            lambda t, x: t.query_ball_point(x, 1.0, 4, raise_on_overflow=True)
        )
        jax.block_until_ready(query(tree, np.zeros(2)))


def test_vmap_over_trees_for_radius_queries():
    rng = np.random.default_rng(2)
    points = rng.random((3, 200, 2))
    x = rng.random((3, 10, 2))
    trees = jax.vmap(kdeqx.KDTree)(points)
    counts = jax.vmap(lambda t, x: t.count_ball_point(x, 0.15))(trees, x)
    for b in range(3):
        expected = cKDTree(points[b]).query_ball_point(x[b], 0.15, return_length=True)
        np.testing.assert_array_equal(counts[b], expected)


@pytest.mark.x64
def test_radius_distances_are_differentiable():
    rng = np.random.default_rng(3)
    points = rng.random((100, 2))
    x = rng.random((5, 2))
    tree = kdeqx.KDTree(points)

    def loss(x):
        distances, _, _ = tree.query_ball_point(x, 0.3, 8)
        return jax.numpy.where(jax.numpy.isfinite(distances), distances, 0).sum()

    grad = jax.grad(loss)(x)
    eps = 1e-6
    step = np.zeros_like(x)
    step[0, 0] = eps
    numeric = (loss(x + step) - loss(x - step)) / (2 * eps)
    np.testing.assert_allclose(grad[0, 0], numeric, rtol=1e-6)


@pytest.mark.parametrize("r", [-0.1, np.nan, np.inf])
def test_bad_radius(r):
    tree = kdeqx.KDTree(np.zeros((5, 2)))
    with pytest.raises(ValueError, match="`r` must be"):
        tree.count_ball_point(np.zeros(2), r)
    with pytest.raises(ValueError, match="`r` must be"):
        tree.query_ball_point(np.zeros(2), r, 3)


def test_bad_radius_under_jit():
    tree = kdeqx.KDTree(np.zeros((5, 2)))
    count = eqx.filter_jit(lambda t, r: t.count_ball_point(np.zeros(2), r))
    with pytest.raises(eqx.EquinoxRuntimeError, match="`r` must be >= 0"):
        jax.block_until_ready(count(tree, -1.0))


def test_bad_radius_shape_and_capacity():
    tree = kdeqx.KDTree(np.zeros((5, 2)))
    with pytest.raises(ValueError, match="batch shape"):
        tree.count_ball_point(np.zeros((4, 2)), np.ones(3))
    with pytest.raises(ValueError, match="`max_neighbors` must be >= 1"):
        tree.query_ball_point(np.zeros(2), 1.0, 0)


def _check_eps_contract(found: set, distances: np.ndarray, r: float, eps: float):
    """scipy's contract for an approximate radius search: every pair within
    `r / (1 + eps)` is found, none beyond `r (1 + eps)`."""
    pairs = np.argwhere(np.ones_like(distances, bool))
    within = {tuple(p) for p in pairs if distances[tuple(p)] <= r / (1 + eps)}
    allowed = {tuple(p) for p in pairs if distances[tuple(p)] <= r * (1 + eps)}
    assert within <= found, sorted(within - found)[:5]
    assert found <= allowed, sorted(found - allowed)[:5]


@pytest.mark.parametrize("p", [1.0, 2.0, np.inf])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_every_radius_method_keeps_the_eps_contract(eps, p):
    rng = np.random.default_rng(7)
    points, x, r = rng.random((400, 3)), rng.random((60, 3)), 0.2
    order = {1.0: 1, 2.0: 2, np.inf: np.inf}[p]
    to_x = np.linalg.norm(x[:, None] - points[None], ord=order, axis=-1)
    to_self = np.linalg.norm(points[:, None] - points[None], ord=order, axis=-1)
    tree, queries = kdeqx.KDTree(points), kdeqx.KDTree(x)
    capacity = 400

    counts = np.asarray(tree.count_ball_point(x, r, p=p, eps=eps))
    assert np.all(counts >= np.sum(to_x <= r / (1 + eps), axis=1))
    assert np.all(counts <= np.sum(to_x <= r * (1 + eps), axis=1))

    _, indices, counts = tree.query_ball_point(x, r, capacity, p=p, eps=eps)
    found = {(q, int(j)) for q, row in enumerate(np.asarray(indices)) for j in row}
    found = {(q, j) for q, j in found if j < len(points)}
    assert len(found) == int(np.sum(counts))
    _check_eps_contract(found, to_x, r, eps)

    _, indices, counts = queries.query_ball_tree(tree, r, capacity, p=p, eps=eps)
    found = {(q, int(j)) for q, row in enumerate(np.asarray(indices)) for j in row}
    _check_eps_contract({(q, j) for q, j in found if j < len(points)}, to_x, r, eps)

    pairs, _, count = tree.query_pairs(r, 20_000, p=p, eps=eps)
    found = {tuple(pair) for pair in np.asarray(pairs)[: int(count)].tolist()}
    upper = {(i, j) for i, j in np.argwhere(np.triu(np.ones_like(to_self), 1))}
    self_distances = np.where(np.triu(np.ones_like(to_self), 1) > 0, to_self, np.inf)
    _check_eps_contract(found, self_distances, r, eps)
    assert found <= upper


@pytest.mark.x64
def test_scipy_query_pairs_eps_scenario():
    """scipy's `test_query_pairs_eps`: on a grid of irrational spacing, pairs at the
    spacing round to just beyond it; `eps=0.1` admits them, as `r = 1.01 spacing`."""
    spacing = np.sqrt(2)
    axis = np.linspace(0, 3 * spacing, 4)
    grid = np.array([(a, b) for a in axis for b in axis])
    tree = kdeqx.KDTree(grid)
    assert tree.points.dtype == np.float64

    def pair_set(pairs, count):
        return {tuple(pair) for pair in np.asarray(pairs)[: int(count)].tolist()}

    approximate = pair_set(*tree.query_pairs(spacing, 100, eps=0.1)[::2])
    wider = pair_set(*tree.query_pairs(spacing * 1.01, 100)[::2])
    assert approximate == wider and len(wider) == 24
