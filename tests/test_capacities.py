"""Capacities sized for the user (counted first, outside `jit`), overflow errors that
name the capacity needed, and scipy's keyword names."""

import jax
import numpy as np
import pytest
import scipy.spatial

import kdeqx
from kdeqx._backend._buckets import bucket


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    points = rng.random((2000, 3)).astype(np.float32)
    other = rng.random((700, 3)).astype(np.float32)
    x = rng.random((60, 3)).astype(np.float32)
    return (
        points,
        other,
        x,
        kdeqx.KDTree(points),
        scipy.spatial.cKDTree(points.astype(np.float64)),
    )


def test_ball_point_counts_first(data):
    points, _, x, tree, reference = data
    r = 0.12
    _, indices, counts = tree.query_ball_point(x, r)
    want = reference.query_ball_point(x.astype(np.float64), r)
    assert indices.shape[-1] == bucket(max(len(w) for w in want))
    got = kdeqx.ball_lists(indices, counts, sort=True)
    assert got == [sorted(w) for w in want]
    # scipy's order, from the query itself
    _, by_index, counts = tree.query_ball_point(x, r, return_sorted=True)
    assert kdeqx.ball_lists(by_index, counts) == got
    lengths = tree.query_ball_point(x, r, return_length=True, workers=-1)
    np.testing.assert_array_equal(lengths, [len(w) for w in want])


def test_ball_point_counts_within_the_approximate_reach(data):
    _, _, x, tree, reference = data
    r, eps = 0.1, 0.5
    _, indices, counts = tree.query_ball_point(x, r, eps=eps)
    assert int(counts.max()) <= indices.shape[-1]
    for row, count, inner, outer in zip(
        kdeqx.ball_lists(indices, counts),
        counts,
        reference.query_ball_point(x.astype(np.float64), r / (1 + eps)),
        reference.query_ball_point(x.astype(np.float64), r * (1 + eps)),
        strict=True,
    ):
        assert set(inner) <= set(row) <= set(outer) and len(row) == count


def test_pairs_and_matrices_count_first(data):
    points, other_points, _, tree, reference = data
    r = 0.06
    pairs, _, count = tree.query_pairs(r)
    assert pairs.shape[0] == bucket(int(count))
    assert kdeqx.pair_set(pairs, count) == reference.query_pairs(r)

    other = kdeqx.KDTree(other_points)
    other_reference = scipy.spatial.cKDTree(other_points.astype(np.float64))
    matrix, entries = tree.sparse_distance_matrix(other, r)
    want = reference.sparse_distance_matrix(
        other_reference, r, output_type="coo_matrix"
    )
    got = kdeqx.to_scipy_sparse(matrix, entries)
    assert got.nnz == want.nnz
    np.testing.assert_allclose(got.toarray(), want.toarray(), rtol=1e-6, atol=1e-7)
    mine, mine_entries = tree.sparse_distance_matrix(tree, r)
    np.testing.assert_allclose(
        kdeqx.to_scipy_sparse(mine, mine_entries).toarray(),
        reference.sparse_distance_matrix(reference, r).toarray(),
        rtol=1e-6,
        atol=1e-7,
    )

    _, indices, counts = tree.query_ball_tree(other, r)
    assert kdeqx.ball_lists(indices, counts, sort=True) == [
        sorted(row) for row in reference.query_ball_tree(other_reference, r)
    ]


def test_no_capacity_under_jit_says_what_to_pass(data):
    _, _, x, tree, _ = data
    with pytest.raises(TypeError, match="max_neighbors.*must be given"):
        jax.jit(lambda x: tree.query_ball_point(x, 0.1))(x)
    with pytest.raises(TypeError, match="max_pairs.*must be given"):
        jax.jit(lambda r: tree.query_pairs(r))(0.1)


def test_overflow_names_the_capacity_needed(data):
    _, _, x, tree, _ = data
    counts = tree.count_ball_point(x, 0.2)
    needed = int(counts.max())
    with pytest.raises(ValueError, match=f"max_neighbors={needed} or more"):
        tree.query_ball_point(x, 0.2, needed - 1, raise_on_overflow=True)
    tree.query_ball_point(x, 0.2, needed, raise_on_overflow=True)  # enough
    pairs = int(tree.query_pairs(0.05)[2])
    with pytest.raises(ValueError, match=f"max_pairs={pairs} or more"):
        tree.query_pairs(0.05, pairs - 1, raise_on_overflow=True)
    with pytest.raises(Exception, match="at least the returned count"):
        jax.jit(lambda r: tree.query_pairs(r, pairs - 1, raise_on_overflow=True)[0])(
            0.05
        ).block_until_ready()


def test_scipys_names(data):
    _, _, x, tree, reference = data
    np.testing.assert_array_equal(
        tree.query(x, k=3, workers=-1)[1],
        reference.query(x.astype(np.float64), k=3, workers=-1)[1],
    )
    with pytest.raises(TypeError, match="pair_set"):
        tree.query_pairs(0.1, output_type="set")
    with pytest.raises(TypeError, match="to_scipy_sparse"):
        tree.sparse_distance_matrix(tree, 0.1, output_type="dict")
    with pytest.raises(TypeError, match="workers"):
        tree.query(x, workers="all")
