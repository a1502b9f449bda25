"""Queries between point sets: `query_pairs`, `query_ball_tree`,
`sparse_distance_matrix` and `count_neighbors`, against scipy's cKDTree and numpy
brute force, and the converters to scipy's shapes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx


N, M = 300, 200


def minkowski(diff, p):
    diff = np.abs(diff)
    return diff.max(-1) if p == np.inf else (diff**p).sum(-1) ** (1 / p)


def all_distances(a, b, p, box=None):
    diff = np.asarray(a, np.float64)[:, None] - np.asarray(b, np.float64)[None]
    if box is not None:  # axes with a length <= 0 are not periodic
        length = np.where(box > 0, box, 1.0)
        diff = np.where(box > 0, diff - length * np.round(diff / length), diff)
    return minkowski(diff, p)


def two_sets(dtype, seed=0, duplicates=False):
    rng = np.random.default_rng(seed)
    a, b = rng.random((N, 3)), rng.random((M, 3))
    if duplicates:  # exact repeats: pairs at distance 0
        a[N // 2 :] = a[: N - N // 2]
        b[:50] = a[:50]
    return a.astype(dtype), b.astype(dtype)


@eqx.filter_jit
def pairs_of(tree, r, capacity, p=2.0, eps=0.0):
    return tree.query_pairs(r, capacity, p=p, eps=eps)


@pytest.mark.parametrize(
    "p, dtype", [(p, np.float64) for p in (1.0, 2.0, 3.0, np.inf)] + [(2.0, np.float32)]
)
def test_query_pairs_match_scipy_in_order(p, dtype):
    points, _ = two_sets(dtype, duplicates=True)
    r = 0.12
    pairs, distances, count = pairs_of(kdeqx.KDTree(points), r, 4000, p)
    expected = cKDTree(points).query_pairs(r, p=p, output_type="ndarray")
    expected = expected[np.lexsort((expected[:, 1], expected[:, 0]))]
    assert int(count) == len(expected)
    np.testing.assert_array_equal(kdeqx.pair_array(pairs, count), expected)
    assert kdeqx.pair_set(pairs, count) == cKDTree(points).query_pairs(r, p=p)
    true = minkowski(points[expected[:, 0]] - points[expected[:, 1]], p)
    np.testing.assert_allclose(distances[: len(expected)], true, rtol=2e-6, atol=1e-7)
    # Padding: (n, n) at distance inf.
    assert np.all(np.asarray(pairs[len(expected) :]) == N)
    assert np.all(np.isinf(distances[len(expected) :]))


@pytest.mark.x64
def test_query_pairs_in_a_periodic_box_and_approximately():
    points, _ = two_sets(np.float64)
    box = np.array([1.0, 1.0, 0.0])
    tree = kdeqx.KDTree(points, box=box)
    reference = cKDTree(points, boxsize=[1.0, 1.0, 10.0])
    pairs, _, count = pairs_of(tree, 0.1, 4000)
    assert kdeqx.pair_set(pairs, count) == reference.query_pairs(0.1)
    # eps: every pair within r / (1 + eps), none beyond r (1 + eps), as scipy's.
    eps = 0.5
    pairs, _, count = pairs_of(tree, 0.1, 4000, eps=eps)
    found = kdeqx.pair_set(pairs, count)
    inner, outer = (
        reference.query_pairs(r) for r in (0.1 / (1 + eps), 0.1 * (1 + eps))
    )
    assert inner <= found <= outer


@pytest.mark.x64
@pytest.mark.parametrize("leaf_size", [1, 33])  # the deepest tree; 2-word masks
def test_query_pairs_with_any_leaf_size_on_hostile_data(leaf_size):
    # Leaves walked as blocks, pairs carried as bitmasks of one or more words: a
    # lattice (distances exactly at r), duplicates, in a periodic box, every norm.
    rng = np.random.default_rng(leaf_size)
    lattice = np.stack(np.meshgrid(*[np.arange(6) / 6] * 3), -1).reshape(-1, 3)
    points = np.concatenate([lattice, lattice[:40], rng.random((150, 3))])
    box = np.array([1.0, 1.0, 0.0])
    for p, period in [(1.0, None), (2.0, box), (np.inf, box), (3.0, None)]:
        tree = kdeqx.KDTree(points, leaf_size=leaf_size, box=period)
        boxsize = None if period is None else [1.0, 1.0, 10.0]
        reference = cKDTree(points, boxsize=boxsize)
        pairs, distances, count = pairs_of(tree, 1 / 6, 20000, p)
        expected = reference.query_pairs(1 / 6, p=p, output_type="ndarray")
        expected = expected[np.lexsort((expected[:, 1], expected[:, 0]))]
        np.testing.assert_array_equal(kdeqx.pair_array(pairs, count), expected)
        true = all_distances(points, points, p, period)[expected[:, 0], expected[:, 1]]
        np.testing.assert_allclose(distances[: len(expected)], true, atol=1e-12)


@pytest.mark.x64
def test_unsorted_query_pairs_are_the_same_pairs_in_walk_order():
    points, _ = two_sets(np.float64, duplicates=True)
    tree = kdeqx.KDTree(points)
    unsorted = eqx.filter_jit(lambda t, c: t.query_pairs(0.12, c, sort=False))
    pairs, distances, count = unsorted(tree, 4000)
    expected = cKDTree(points).query_pairs(0.12, output_type="ndarray")
    m = int(count)
    assert m == len(expected)
    found = np.asarray(pairs)
    assert np.all(found[:m, 0] < found[:m, 1]) and np.all(found[m:] == N)
    assert not np.all(np.diff(found[:m, 0] * N + found[:m, 1]) > 0)  # not sorted
    order = np.lexsort((found[:m, 1], found[:m, 0]))
    np.testing.assert_array_equal(found[:m][order], pairs_of(tree, 0.12, 4000)[0][:m])
    true = all_distances(points, points, 2.0)[found[:m, 0], found[:m, 1]]
    np.testing.assert_allclose(distances[:m], true, rtol=1e-12)
    assert np.all(np.isinf(distances[m:]))
    # Cut off: real pairs, the true count.
    kept, _, count = unsorted(tree, 10)
    assert int(count) == m
    assert kdeqx.pair_set(kept, 10) <= kdeqx.pair_set(pairs, m)
    # A sharded tree sorts either way.
    sharded = kdeqx.ShardedKDTree(points[:60], jax.make_mesh((1,), ("shards",)))
    np.testing.assert_array_equal(
        sharded.query_pairs(0.2, 200, sort=False)[0],
        kdeqx.KDTree(points[:60]).query_pairs(0.2, 200)[0],
    )
    with pytest.raises(TypeError, match="sort"):
        tree.query_pairs(0.12, 10, sort=1)  # type: ignore[arg-type]


def test_query_pairs_overflow_keeps_the_count_and_can_raise():
    points, _ = two_sets(np.float32)
    tree = kdeqx.KDTree(points)
    expected = cKDTree(points).query_pairs(0.2)
    pairs, distances, count = tree.query_pairs(0.2, 10)
    assert int(count) == len(expected) > 10
    kept = {tuple(pair) for pair in np.asarray(pairs).tolist()}
    assert len(kept) == 10 and kept <= expected
    kept = np.asarray(pairs, np.int64)
    assert np.all(np.diff(kept[:, 0] * N + kept[:, 1]) > 0)  # in order
    true = all_distances(points, points, 2.0)[kept[:, 0], kept[:, 1]]
    np.testing.assert_allclose(distances, true, rtol=1e-6)
    with pytest.raises(ValueError, match="cut off"):
        kdeqx.pair_set(pairs, count)
    with pytest.raises(ValueError, match="more than max_pairs=10"):
        jax.block_until_ready(tree.query_pairs(0.2, 10, raise_on_overflow=True))


def test_pairs_of_tiny_and_empty_trees():
    for n in (0, 1, 2):
        points = np.zeros((n, 2), np.float32)
        pairs, distances, count = kdeqx.KDTree(points).query_pairs(1.0, 3)
        assert int(count) == n * (n - 1) // 2
        if n == 2:
            assert np.asarray(pairs[0]).tolist() == [0, 1] and distances[0] == 0
        assert np.all(np.asarray(pairs[int(count) :]) == n)


def test_query_ball_tree_matches_scipy():
    a, b = two_sets(np.float32, duplicates=True)
    tree_a, tree_b = kdeqx.KDTree(a), kdeqx.KDTree(b)
    for p in (1.0, np.inf):
        distances, indices, counts = tree_a.query_ball_tree(tree_b, 0.15, 40, p=p)
        expected = cKDTree(a).query_ball_tree(cKDTree(b), 0.15, p=p)
        lists = kdeqx.ball_lists(indices, counts)
        assert [sorted(row) for row in lists] == [sorted(row) for row in expected]
        for row, count in zip(np.asarray(distances), np.asarray(counts), strict=True):
            assert np.all(np.diff(row[:count]) >= 0)  # nearest first


@pytest.mark.parametrize(
    "p, dtype", [(1.0, np.float64), (np.inf, np.float64), (2.0, np.float32)]
)
def test_sparse_distance_matrix_matches_scipy(p, dtype):
    a, b = two_sets(dtype, duplicates=True)
    matrix, count = kdeqx.KDTree(a).sparse_distance_matrix(
        kdeqx.KDTree(b), 0.15, 3000, p=p
    )
    expected = cKDTree(a).sparse_distance_matrix(
        cKDTree(b), 0.15, p=p, output_type="coo_matrix"
    )
    ours = kdeqx.to_scipy_sparse(matrix, count)
    assert ours.shape == (N, M) and ours.nnz == expected.nnz == int(count)
    np.testing.assert_allclose(ours.toarray(), expected.toarray(), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(
        matrix.todense(), expected.toarray(), rtol=2e-6, atol=1e-7
    )
    # Sorted by row then column, as BCOO's `indices_sorted` promises.
    rows, cols = ours.row, ours.col
    assert np.all((np.diff(rows) > 0) | ((np.diff(rows) == 0) & (np.diff(cols) > 0)))
    as_dict = kdeqx.distance_dict(matrix, count)
    assert set(as_dict) == set(zip(expected.row.tolist(), expected.col.tolist()))


@pytest.mark.x64
def test_sparse_distance_matrix_of_a_tree_with_itself():
    # `tree.sparse_distance_matrix(tree, r)` (scipy's idiom for one set) takes the
    # pairs of `query_pairs`' walk, mirrored, and the diagonal.
    a, _ = two_sets(np.float64, duplicates=True)
    box = np.array([1.0, 1.0, 0.0])
    for p, period, leaf_size in [(2.0, None, 32), (1.0, box, 8), (np.inf, box, 40)]:
        tree = kdeqx.KDTree(a, box=period, leaf_size=leaf_size)
        matrix, count = eqx.filter_jit(
            lambda t: t.sparse_distance_matrix(t, 0.15, 6000, p=p)
        )(tree)
        boxsize = None if period is None else [1.0, 1.0, 10.0]
        reference = cKDTree(a, boxsize=boxsize)
        expected = reference.sparse_distance_matrix(
            reference, 0.15, p=p, output_type="coo_matrix"
        )
        ours = kdeqx.to_scipy_sparse(matrix, count)
        assert ours.nnz == expected.nnz == int(count)
        on_diagonal = ours.row == ours.col
        assert set(ours.row[on_diagonal].tolist()) == set(range(N))
        np.testing.assert_allclose(ours.toarray(), expected.toarray(), atol=1e-12)
        keys = ours.row.astype(np.int64) * N + ours.col
        assert np.all(np.diff(keys) > 0)  # sorted, no repeats
    # Overflow: the true count, and the entries kept are real ones, in order.
    tree = kdeqx.KDTree(a)
    matrix, count = tree.sparse_distance_matrix(tree, 0.15, 500)
    reference = cKDTree(a)
    full = reference.sparse_distance_matrix(reference, 0.15, output_type="dict")
    assert int(count) == len(full) > 500
    kept = np.asarray(matrix.indices, np.int64)
    assert np.all(np.diff(kept[:, 0] * N + kept[:, 1]) > 0)
    for (i, j), d in zip(kept.tolist(), np.asarray(matrix.data).tolist()):
        assert abs(full.get((i, j), np.inf) - d) < 1e-12

    def total(points):
        tree = kdeqx.KDTree(points)
        return tree.sparse_distance_matrix(tree, 0.15, 6000)[0].data.sum()

    # Each pair counts twice; the diagonal's derivatives are zero, not NaN.
    grad = jax.grad(total)(a)
    pairs, _, found = kdeqx.KDTree(a).query_pairs(0.15, 6000)
    pairs = np.asarray(pairs)[: int(found)]
    diff = a[pairs[:, 0]] - a[pairs[:, 1]]
    norms = np.linalg.norm(diff, axis=-1, keepdims=True)
    unit = np.where(norms > 0, diff / np.where(norms > 0, norms, 1), 0)
    expected = np.zeros_like(a)
    np.add.at(expected, pairs[:, 0], 2 * unit)
    np.add.at(expected, pairs[:, 1], -2 * unit)
    np.testing.assert_allclose(grad, expected, atol=1e-9)


@pytest.mark.x64
@pytest.mark.parametrize(
    "p, periodic",
    [(1.0, False), (1.5, True), (2.0, False), (2.0, True), (np.inf, True)],
)
def test_count_neighbors_matches_scipy(periodic, p):
    if True:
        a, b = two_sets(np.float64, duplicates=True)
        box = 1.0 if periodic else None
        tree_a, tree_b = kdeqx.KDTree(a, box=box), kdeqx.KDTree(b, box=box)
        ref_a, ref_b = cKDTree(a, boxsize=box), cKDTree(b, boxsize=box)
        radii = np.array([0.3, 0.0, 0.05, 0.1, 0.2, 2.0])  # unsorted: allowed
        counts = tree_a.count_neighbors(tree_b, radii, p=p)
        assert counts.dtype == jnp.int64
        np.testing.assert_array_equal(counts, ref_a.count_neighbors(ref_b, radii, p=p))
        # A scalar radius gives a scalar; auto-pairs count (i, i) and both orders.
        auto = tree_a.count_neighbors(tree_a, 0.1, p=p)
        assert auto.shape == () and int(auto) == ref_a.count_neighbors(ref_a, 0.1, p=p)
        # Bins between sorted radii.
        edges = np.sort(radii)
        np.testing.assert_array_equal(
            tree_a.count_neighbors(tree_b, edges, p=p, cumulative=False),
            ref_a.count_neighbors(ref_b, edges, p=p, cumulative=False),
        )


@pytest.mark.x64
def test_weighted_count_neighbors_match_scipy_and_differentiate():
    a, b = two_sets(np.float64)
    rng = np.random.default_rng(3)
    wa, wb = rng.random(N), rng.random(M)
    tree_a, tree_b, ref_a, ref_b = (
        kdeqx.KDTree(a),
        kdeqx.KDTree(b),
        cKDTree(a),
        cKDTree(b),
    )
    radii = np.array([0.05, 0.1, 0.2])
    for weights in [(wa, wb), (wa, None), (None, wb)]:
        np.testing.assert_allclose(
            tree_a.count_neighbors(tree_b, radii, weights=weights),
            ref_a.count_neighbors(ref_b, radii, weights=weights),
            rtol=1e-12,
        )
    np.testing.assert_allclose(
        tree_a.count_neighbors(tree_a, radii, weights=wa),
        ref_a.count_neighbors(ref_a, radii, weights=wa),
        rtol=1e-12,
    )
    # d/dw_a of sum_ij wa_i wb_j [d_ij <= r] is sum_j wb_j [d_ij <= r].
    grad = jax.grad(lambda w: tree_a.count_neighbors(tree_b, 0.1, weights=(w, wb)))(wa)
    np.testing.assert_allclose(grad, (all_distances(a, b, 2) <= 0.1) @ wb, rtol=1e-12)


def test_count_neighbors_of_empty_trees():
    a, b = two_sets(np.float32)
    empty = kdeqx.KDTree(np.zeros((0, 3), np.float32))
    for first, second in [(empty, kdeqx.KDTree(b)), (kdeqx.KDTree(a), empty)]:
        assert np.all(np.asarray(first.count_neighbors(second, [0.1, 1.0])) == 0)


def test_pair_distances_differentiate():
    a, _ = two_sets(np.float32)

    def total(points):
        return jnp.sum(jnp.where(*_finite(kdeqx.KDTree(points).query_pairs(0.1, 900))))

    grad = jax.grad(total)(a)
    pairs, _, count = kdeqx.KDTree(a).query_pairs(0.1, 900)
    pairs = np.asarray(pairs)[: int(count)]
    diff = a[pairs[:, 0]].astype(np.float64) - a[pairs[:, 1]]
    unit = diff / np.linalg.norm(diff, axis=-1, keepdims=True)
    expected = np.zeros_like(a, np.float64)
    np.add.at(expected, pairs[:, 0], unit)
    np.add.at(expected, pairs[:, 1], -unit)
    np.testing.assert_allclose(grad, expected, atol=1e-4)


def _finite(answer):
    _, distances, _ = answer
    finite = jnp.isfinite(distances)
    return finite, distances, 0.0


def test_pairs_and_counts_under_vmap_over_trees():
    rng = np.random.default_rng(4)
    batch = rng.random((3, 100, 2)).astype(np.float32)
    trees = jax.vmap(kdeqx.KDTree)(batch)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def both(trees):
        pairs = jax.vmap(lambda t: t.query_pairs(0.1, 300))(trees)
        counts = jax.vmap(lambda t: t.count_neighbors(t, jnp.array([0.05, 0.1])))(trees)
        return pairs, counts

    (pairs, _, count), counts = both(trees)
    for i, points in enumerate(batch):
        reference = cKDTree(points)
        assert kdeqx.pair_set(pairs[i], count[i]) == reference.query_pairs(0.1)
        np.testing.assert_array_equal(
            counts[i], reference.count_neighbors(reference, [0.05, 0.1])
        )
    both(trees)  # no retrace


def test_bad_pair_arguments():
    a, b = two_sets(np.float32)
    tree, other = kdeqx.KDTree(a), kdeqx.KDTree(b)
    flat = kdeqx.KDTree(b[:, :2])
    with pytest.raises(ValueError, match="dimension"):
        tree.count_neighbors(flat, 0.1)
    with pytest.raises(ValueError, match="dimension"):
        tree.sparse_distance_matrix(flat, 0.1, 10)
    with pytest.raises(TypeError, match="kdeqx tree"):
        tree.query_ball_tree(b, 0.1, 4)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`r` must be >= 0"):
        tree.query_pairs(-0.1, 10)
    with pytest.raises(ValueError, match="`r` must be finite"):
        tree.count_neighbors(other, [0.1, np.inf])
    with pytest.raises(ValueError, match="scalar"):
        tree.query_pairs(np.array([0.1, 0.2]), 10)
    with pytest.raises(ValueError, match="non-decreasing"):
        tree.count_neighbors(other, [0.2, 0.1], cumulative=False)
    with pytest.raises(ValueError, match="one entry per point"):
        tree.count_neighbors(other, 0.1, weights=(np.ones(N), np.ones(M + 1)))
    with pytest.raises(ValueError, match="`weights` must be finite"):
        tree.count_neighbors(other, 0.1, weights=(np.full(N, np.nan), None))
    with pytest.raises(ValueError, match="for two trees"):
        tree.count_neighbors(other, 0.1, weights=np.ones(N))
    with pytest.raises(ValueError, match="`p` must be >= 1"):
        tree.query_pairs(0.1, 10, p=0.5)

    @jax.jit
    def counted(r):
        return tree.count_neighbors(other, r)

    with pytest.raises(Exception, match="`r` must be >= 0"):
        jax.block_until_ready(counted(jnp.array([-1.0])))
