import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx
from kdeqx._engine._merge import leaves_per_merge

from .helpers import (
    assert_knn_correct,
    count_equations,
    DATASETS,
    DTYPES,
    jit_query,
    lattice,
    lattice_queries,
    x64_off,
)


N = 300  # one size for all data sets, so the compiled query is reused across them


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 2, 3, 8])
@pytest.mark.parametrize("dataset", list(DATASETS))
def test_knn_matches_brute_force(dataset, d, dtype):
    rng = np.random.default_rng([list(DATASETS).index(dataset), d])
    points = DATASETS[dataset](rng, N, d).astype(dtype)
    if dataset == "lattice":
        x = lattice_queries(rng, 64, d).astype(dtype)
    else:
        span = points.max(0) - points.min(0) + 0.1
        x = (points.min(0) - 0.05 + span * rng.random((64, d))).astype(dtype)
        x[:8] = points[:8]  # queries exactly at data points: zero distances
    tree = kdeqx.KDTree(points)
    exact = dtype == np.float64 or dataset in ("lattice", "duplicates")
    for k in (1, 4, 16):
        distances, indices = jit_query(tree, x, k)
        assert distances.shape == (64, k) and indices.shape == (64, k)
        assert distances.dtype == dtype
        assert_knn_correct(points, x, k, distances, indices, exact_ties=exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2, 3])
def test_knn_matches_scipy(d, dtype):
    rng = np.random.default_rng(d)
    points = rng.random((2000, d)).astype(dtype)
    x = rng.random((500, d)).astype(dtype)
    distances, indices = jit_query(kdeqx.KDTree(points), x, 8)
    ref_d, ref_i = cKDTree(points.astype(np.float64)).query(x.astype(np.float64), 8)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(distances, ref_d, rtol=rtol)
    if dtype == np.float64:
        np.testing.assert_array_equal(indices, ref_i)
    else:  # float32 rounding may swap neighbours whose distances agree to ~1e-7
        agree = np.mean(np.asarray(indices) == ref_i)
        assert agree > 0.999


def test_ties_are_ordered_by_lower_index():
    # Every point coincides: all distances tie, so the answer is the lowest indices.
    points = np.zeros((50, 2))
    distances, indices = jit_query(kdeqx.KDTree(points), np.array([[1.0, 0.0]]), 4)
    np.testing.assert_array_equal(indices, [[0, 1, 2, 3]])
    np.testing.assert_array_equal(distances, [[1.0] * 4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_k_larger_than_n_pads_with_sentinels(dtype):
    points = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], dtype)
    distances, indices = kdeqx.KDTree(points).query(np.zeros(2, dtype), k=5)
    np.testing.assert_array_equal(indices, [0, 1, 2, 3, 3])
    np.testing.assert_allclose(distances, [0.0, 1.0, 2.0, np.inf, np.inf])


@pytest.mark.parametrize("dtype", DTYPES)
def test_distance_upper_bound_is_strict_like_scipy(dtype):
    rng = np.random.default_rng(0)
    points = rng.random((400, 3)).astype(dtype)
    x = rng.random((50, 3)).astype(dtype)
    tree = kdeqx.KDTree(points)
    distances, indices = jit_query(tree, x, 6, 0.1)
    assert_knn_correct(points, x, 6, distances, indices, exact_ties=True, ub=0.1)
    ref_d, ref_i = cKDTree(points).query(x, 6, distance_upper_bound=0.1)
    np.testing.assert_array_equal(indices, ref_i)
    # A point exactly at the bound is excluded, as in scipy.
    line = kdeqx.KDTree(np.array([[0.0], [1.0], [2.0]], dtype))
    _, indices = line.query(np.zeros(1, dtype), 3, distance_upper_bound=1.0)
    np.testing.assert_array_equal(indices, [0, 3, 3])


def test_distance_upper_bound_per_query():
    points = np.arange(10.0)[:, None]
    bounds = np.array([0.5, 1.5, 2.5])
    x = np.zeros((3, 1))
    distances, indices = kdeqx.KDTree(points).query(x, 4, distance_upper_bound=bounds)
    np.testing.assert_array_equal(
        indices, [[0, 10, 10, 10], [0, 1, 10, 10], [0, 1, 2, 10]]
    )
    assert np.isinf(distances[0, 1:]).all()


def test_query_shapes():
    rng = np.random.default_rng(1)
    tree = kdeqx.KDTree(rng.random((100, 3)))
    distances, indices = tree.query(rng.random(3), k=2)
    assert distances.shape == indices.shape == (2,)
    distances, indices = tree.query(rng.random((2, 5, 3)), k=3)
    assert distances.shape == indices.shape == (2, 5, 3)
    distances, indices = tree.query(np.zeros((0, 3)), k=3)
    assert distances.shape == (0, 3)


@pytest.mark.parametrize("leaf_size", [1, 2, 16, 64, None])
def test_leaf_size_does_not_change_answers(leaf_size):
    rng = np.random.default_rng(2)
    points = rng.random((333, 3))
    x = rng.random((40, 3))
    distances, indices = kdeqx.KDTree(points, leaf_size=leaf_size).query(x, 5)
    assert_knn_correct(points, x, 5, distances, indices, exact_ties=True)


def test_leaves_halves_as_a_tree_answer_every_query():
    # Queries for few neighbours walk the default tree one level deeper; that view is
    # a whole tree, so any query on it must answer as scipy does.
    rng = np.random.default_rng(3)
    points, x = rng.random((500, 3)), rng.random((40, 3))
    deeper = kdeqx.KDTree(points)._halves_as_leaves()
    distances, indices = deeper.query(x, 20)
    assert_knn_correct(points, x, 20, distances, indices, exact_ties=True)
    expected = cKDTree(points).query_ball_point(x, 0.15, return_length=True)
    np.testing.assert_array_equal(deeper.count_ball_point(x, 0.15), expected)


def test_single_point_and_empty_tree():
    one = kdeqx.KDTree(jnp.array([[1.0, 2.0]]))
    distances, indices = one.query(jnp.array([1.0, 3.0]), 2)
    np.testing.assert_allclose(distances, [1.0, np.inf])
    np.testing.assert_array_equal(indices, [0, 1])
    empty = kdeqx.KDTree(jnp.zeros((0, 2)))
    distances, indices = empty.query(jnp.ones((4, 2)), 3)
    assert np.isinf(distances).all() and (np.asarray(indices) == 0).all()


def test_huge_and_tiny_coordinates():
    rng = np.random.default_rng(3)
    for scale in (1e-30, 1e30):
        points = rng.random((200, 3)) * scale
        x = rng.random((20, 3)) * scale
        distances, indices = kdeqx.KDTree(points).query(x, 4)
        assert_knn_correct(points, x, 4, distances, indices, exact_ties=True)


def test_queries_do_not_need_x64():
    # float32 merges pack (distance, index) into uint64 keys inside a local x64
    # context; the answers must be the same with x64 off (the default). Lattice data
    # has exact ties, a bound leaves slots empty, and 3000 queries run on the lanes.
    rng = np.random.default_rng(11)
    points = DATASETS["lattice"](rng, 2000, 3).astype(np.float32)
    x = lattice_queries(rng, 3000, 3, side=12).astype(np.float32)
    bound = np.float32(1.2)
    with x64_off():
        tree = kdeqx.KDTree(points)
        distances, indices = jax.jit(
            lambda t, x: t.query(x, 6, distance_upper_bound=bound)
        )(tree, x)
        _, ball_indices, counts = jax.jit(
            lambda t, x: t.query_ball_point(x, bound, max_neighbors=8)
        )(tree, x)
        assert indices.dtype == np.int32 and distances.dtype == np.float32
    assert_knn_correct(
        points,
        x,
        6,
        np.asarray(distances),
        np.asarray(indices),
        exact_ties=True,
        ub=bound,
    )
    nearest = np.sort(np.linalg.norm(x[:, None] - points[None], axis=-1), axis=1)
    np.testing.assert_array_equal(np.asarray(counts), (nearest <= bound).sum(1))
    expected_ball = np.where(nearest[:, :8] <= bound, 0, 2000)  # sentinel positions
    np.testing.assert_array_equal(
        np.asarray(ball_indices) == 2000, expected_ball == 2000
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_distances_are_the_ranked_ones(dtype):
    """The returned distances are the ones the walk ranked by: sorted along `k`, and
    equal to the distances to the returned rows up to an ulp or two of rounding."""
    rng = np.random.default_rng(7)
    points = rng.random((3000, 3)).astype(dtype)
    x = rng.random((1500, 3)).astype(dtype)  # more queries than lanes
    distances, indices = jit_query(kdeqx.KDTree(points), x, 8)
    assert (np.diff(np.asarray(distances), axis=-1) >= 0).all()
    rows = points.astype(np.float64)[np.asarray(indices)]
    recomputed = np.linalg.norm(x.astype(np.float64)[:, None] - rows, axis=-1)
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(distances, recomputed, rtol=4 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [33, 100, 257])
def test_large_k_matches_brute_force(k, dtype):
    # Beyond 16 neighbours the k best are kept by bitonic networks, not ranks, and
    # fewer lanes (64-128 here) take turns over the 300 queries.
    rng = np.random.default_rng(k)
    points = lattice(rng, 600, 3).astype(dtype)  # exact distances, ties everywhere
    x = lattice_queries(rng, 300, 3, side=9).astype(dtype)
    distances, indices = jit_query(kdeqx.KDTree(points), x, k)
    assert_knn_correct(points, x, k, distances, indices, exact_ties=True)


@pytest.mark.parametrize("leaf_size", [8, 32])
def test_several_leaves_per_merge_match_brute_force(leaf_size):
    # For large k the walk gathers several leaves (up to 8) before each merge,
    # pruning meanwhile with the k-th distance from before them.
    k = 100
    assert leaves_per_merge(k, leaf_size) > 1
    rng = np.random.default_rng(leaf_size)
    points = lattice(rng, 500, 3)
    x = lattice_queries(rng, 200, 3, side=9)
    tree = kdeqx.KDTree(points, leaf_size=leaf_size)
    distances, indices = jit_query(tree, x, k)
    assert_knn_correct(points, x, k, distances, indices, exact_ties=True)


def test_k_far_beyond_n_costs_what_k_equal_n_costs():
    rng = np.random.default_rng(0)
    points, x = rng.random((40, 2)).astype(np.float32), rng.random((6, 2))
    tree = kdeqx.KDTree(points)
    distances, indices = jit_query(tree, x.astype(np.float32), 10**5)
    assert distances.shape == indices.shape == (6, 10**5)
    assert_knn_correct(
        points, x, 40, distances[:, :40], indices[:, :40], exact_ties=False
    )
    assert np.all(np.isinf(distances[:, 40:])) and np.all(indices[:, 40:] == 40)

    def program_size(k):
        jaxpr = jax.make_jaxpr(lambda t, x: t.query(x, k))(tree, x.astype(np.float32))
        return count_equations(jaxpr.jaxpr)

    # The same search as k = n, then sentinels appended: a few equations more.
    assert program_size(10**5) <= program_size(40) + 10


def test_scipys_names_for_leaf_size_and_box():
    rng = np.random.default_rng(11)
    points, x = rng.random((500, 3)), rng.random((60, 3))
    ours = kdeqx.KDTree(points, leafsize=8, boxsize=1.0)
    assert ours.leaf_size == 8
    reference = cKDTree(points, leafsize=8, boxsize=1.0).query(x, 4)
    np.testing.assert_array_equal(ours.query(x, k=4)[1], reference[1])
    with pytest.raises(TypeError, match="leafsize"):
        kdeqx.KDTree(points, leaf_size=8, leafsize=8)
    with pytest.raises(TypeError, match="boxsize"):
        kdeqx.KDTree(points, box=1.0, boxsize=1.0)
