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

from .helpers import assert_knn_correct, DATASETS, queries_around, ulp


N = 400


@eqx.filter_jit
def _query(tree, x, k, **kwargs):
    return tree.query(x, k=k, **kwargs)


def test_engine_is_chosen_by_backend_and_checked():
    points = np.random.default_rng(0).random((50, 3))
    assert kdeqx.KDTree(points).engine == "walk"  # the CPU's
    assert kdeqx.KDTree(points, engine="blocks").engine == "blocks"
    with pytest.raises(ValueError, match="engine"):
        kdeqx.KDTree(points, engine="lanes")


@pytest.mark.parametrize(
    "dataset, dtype",
    [(dataset, np.float32) for dataset in DATASETS]
    + [("uniform", np.float64), ("duplicates", np.float64)],
)
def test_knn_matches_brute_force_and_the_walk(dataset, dtype):
    rng = np.random.default_rng(list(DATASETS).index(dataset))
    points = DATASETS[dataset](rng, N, 3).astype(dtype)
    x = queries_around(rng, points, dataset, 96, dtype)
    blocks = kdeqx.KDTree(points, engine="blocks")
    walk = kdeqx.KDTree(points, engine="walk")
    exact = dtype == np.float64 or dataset in ("lattice", "duplicates")
    for k in (1, 8, 40):  # a tile's k best by rounds of minima
        distances, indices = _query(blocks, x, k)
        assert distances.dtype == dtype
        assert_knn_correct(points, x, k, distances, indices, exact_ties=exact)
        walked = _query(walk, x, k)
        np.testing.assert_array_equal(indices, walked[1])
        # The same distances, summed in another order: equal to a few ulps.
        np.testing.assert_allclose(distances, walked[0], rtol=4 * ulp(dtype))


def test_knn_matches_scipy_in_float64():
    rng = np.random.default_rng(1)
    points, x = rng.random((3000, 3)), rng.random((700, 3))
    with jax.enable_x64(True):
        distances, indices = _query(kdeqx.KDTree(points, engine="blocks"), x, 8)
        reference = cKDTree(points).query(x, 8)
        np.testing.assert_allclose(distances, reference[0], rtol=1e-12)
        np.testing.assert_array_equal(indices, reference[1])


def test_answers_put_back_in_order_the_tpus_way(monkeypatch, request):
    """Answers put back in the queries' order by a gather through the inverse
    permutation (a TPU's way, on the CPU) are those of the scatter and scipy's, for
    the k nearest and the counts, over queries that fill no whole block."""
    from kdeqx._engine import _blocks

    rng = np.random.default_rng(21)
    points, x = rng.random((2000, 3)).astype(np.float32), rng.random((333, 3))
    x = x.astype(np.float32)
    tree = kdeqx.KDTree(points, engine="blocks")

    def answers():
        return _query(tree, x, 8), tree.count_ball_point(x, 0.1)

    scattered = answers()
    monkeypatch.setattr(_blocks, "scatters_element_by_element", lambda b=None: True)
    jax.clear_caches()  # read when a query is traced
    request.addfinalizer(jax.clear_caches)
    (distances, indices), counts = answers()
    np.testing.assert_array_equal(indices, scattered[0][1])
    np.testing.assert_array_equal(distances, scattered[0][0])
    np.testing.assert_array_equal(counts, scattered[1])
    reference = cKDTree(points)
    np.testing.assert_array_equal(indices, reference.query(x, 8)[1])
    want = reference.query_ball_point(x, 0.1, return_length=True)
    np.testing.assert_array_equal(counts, want)


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
        np.testing.assert_allclose(blocks[0], walked[0], rtol=4 * ulp(np.float32))
    one = np.full((40, 3), 0.25, np.float32)  # every point the same
    blocks = _query(kdeqx.KDTree(one, engine="blocks"), x[:4], 7)
    np.testing.assert_array_equal(blocks[1], np.tile(np.arange(7), (4, 1)))


def test_a_tree_of_one_leaf_measures_it_once():
    """Every point in the root (no more points than `leaf_size`): the stage's descent
    takes no step, and must still leave out the leaf the first pass measured (it
    used to return each neighbour twice). `knn_graph` builds such trees for small
    systems."""
    rng = np.random.default_rng(6)
    points, x = rng.random((12, 3)).astype(np.float32), rng.random((9, 3))
    tree = kdeqx.KDTree(points, leaf_size=32, engine="blocks")
    _, indices = _query(tree, x.astype(np.float32), 4)
    np.testing.assert_array_equal(indices, cKDTree(points).query(x, 4)[1])
    graphs = [kdeqx.knn_graph(points, 3, engine=e) for e in ("blocks", "walk")]
    for field in ("senders", "receivers", "shifts"):
        ours, walked = (np.asarray(getattr(g, field)) for g in graphs)
        np.testing.assert_array_equal(ours, walked)


@pytest.mark.parametrize("blocks, at_least", [(1, 1), (7, 1), (103, 1), (103, 64)])
@pytest.mark.parametrize("share", [0.0, 0.05, 0.5, 1.0])
def test_work_for_active_blocks_only_lands_in_their_rows(
    blocks, at_least, share, monkeypatch
):
    from kdeqx._engine import _blocks
    from kdeqx._engine._blocks import _for_active_blocks, ACTIVE_GROUPS

    monkeypatch.setattr(_blocks, "ACTIVE_AT_LEAST", at_least)
    rng = np.random.default_rng(blocks)
    active = rng.random(blocks) < share
    values = rng.standard_normal((blocks, 3)).astype(np.float32)
    default = rng.standard_normal((blocks, 3)).astype(np.float32)

    def work(rows, calls):
        # Rows past the last active block are the number of blocks.
        seen = jnp.where((rows < blocks)[:, None], 2 * jnp.asarray(values)[rows], 0)
        return seen, calls + 1

    out, calls = jax.jit(_for_active_blocks, static_argnums=1)(
        jnp.asarray(active), work, jnp.asarray(default), jnp.zeros((), jnp.int32)
    )
    np.testing.assert_array_equal(out, np.where(active[:, None], 2 * values, default))
    group = min(blocks, max(at_least, -(-blocks // ACTIVE_GROUPS)))
    assert calls == -(-active.sum() // group)  # as few groups as hold them


def test_smallest_first_in_order():
    from kdeqx._backend._sorting import smallest_first

    rng = np.random.default_rng(11)
    x = rng.random((50, 300)).astype(np.float32)
    values, positions = smallest_first(jnp.asarray(x), 16)
    np.testing.assert_array_equal(values, np.sort(x, axis=1)[:, :16])
    np.testing.assert_array_equal(np.take_along_axis(x, positions, 1), values)


@pytest.mark.parametrize("k", [1, 3, 8, 17, 45])  # 45: by a sort (the tile is 40)
def test_merging_a_tiles_k_best_keeps_the_k_smallest_pairs(k):
    from kdeqx._engine._merge import (
        best_of_pairs,
        merge_sorted_into_best,
        pairs_of_best,
        smallest_pairs,
    )

    rng = np.random.default_rng(k)
    for trial in range(6):
        # Few distinct distances: ties broken by index, empty entries `(bound, -1)`.
        best_d2 = rng.integers(0, 4, k).astype(np.float32)
        best_i = rng.permutation(100)[:k].astype(np.int32)
        if trial % 2:
            best_d2[k // 2 :], best_i[k // 2 :] = 3.0, -1
        order = np.lexsort((best_i, best_d2))
        best_d2, best_i = best_d2[order], best_i[order]
        tile_d2 = rng.integers(0, 4, 40).astype(np.float32)
        tile_i = (100 + rng.permutation(40)).astype(np.int32)
        tile = smallest_pairs(jnp.asarray(tile_d2), jnp.asarray(tile_i), k)
        for best in [
            best_of_pairs(jnp.asarray(best_d2), jnp.asarray(best_i)),
            (jnp.asarray(best_d2), jnp.asarray(best_i)),
        ]:
            merged = merge_sorted_into_best(best, *tile)
            d2, i = pairs_of_best(merged, jnp.float32, jnp.int32)
            all_d2 = np.concatenate([best_d2, tile_d2])
            all_i = np.concatenate([best_i, tile_i])
            expected = np.lexsort((all_i, all_d2))[:k]
            np.testing.assert_array_equal(d2, all_d2[expected])
            np.testing.assert_array_equal(i, all_i[expected])
