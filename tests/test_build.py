import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx

from .helpers import DATASETS, DTYPES, x64_off


def _leaves_of(tree):
    shape = (tree.num_leaves, tree.leaf_size)
    return (
        np.asarray(tree.leaf_points).reshape(*shape, tree.d),
        np.asarray(tree.leaf_indices).reshape(shape),
    )


@pytest.mark.x64
@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 1000])
def test_every_point_lands_in_exactly_one_slot(dataset, n):
    points = DATASETS[dataset](np.random.default_rng(n), n, 3)
    tree = kdeqx.KDTree(points)
    indices = np.asarray(tree.leaf_indices)
    real = indices[indices < n]
    np.testing.assert_array_equal(np.sort(real), np.arange(n))
    assert (indices[indices >= n] == n).all()
    np.testing.assert_array_equal(
        np.asarray(tree.leaf_points)[indices < n], points[real] * float(tree.scale)
    )


@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("halves", [False, True])
def test_node_boxes_are_tight_and_nested(dataset, halves):
    points = DATASETS[dataset](np.random.default_rng(0), 500, 3)
    tree = kdeqx.KDTree(points)
    if halves:  # the tree one level deeper, as queries for few neighbours walk it
        tree = tree._halves_as_leaves()
        assert tree.leaf_size == 16 and not tree.halves
    lo, hi = np.asarray(tree.node_lo).T, np.asarray(tree.node_hi).T
    min_index = np.asarray(tree.node_min_index)
    leaf_points, leaf_indices = _leaves_of(tree)
    first_leaf = tree.num_leaves - 1
    for leaf, (pts, idx) in enumerate(zip(leaf_points, leaf_indices)):
        real = idx < tree.n
        node = first_leaf + leaf
        if real.any():
            np.testing.assert_array_equal(lo[node], pts[real].min(0))
            np.testing.assert_array_equal(hi[node], pts[real].max(0))
            assert min_index[node] == idx[real].min()
        else:
            assert np.isposinf(lo[node]).all() and np.isneginf(hi[node]).all()
    for node in range(first_leaf):
        children = [2 * node + 1, 2 * node + 2]
        np.testing.assert_array_equal(lo[node], lo[children].min(0))
        np.testing.assert_array_equal(hi[node], hi[children].max(0))
        assert min_index[node] == min_index[children].min()


def test_median_split_balances_the_tree():
    # Every leaf but the last ones (which take the padding) is full.
    tree = kdeqx.KDTree(np.random.default_rng(0).random((1000, 2)), leaf_size=8)
    _, leaf_indices = _leaves_of(tree)
    counts = (leaf_indices < tree.n).sum(1)
    assert counts.sum() == 1000 and counts.max() == tree.leaf_size
    assert tree.num_leaves == 128


@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("n", [1, 20, 33, 500])
def test_halves_split_each_leaf_at_a_median(dataset, n):
    points = DATASETS[dataset](np.random.default_rng(n), n, 3)
    tree = kdeqx.KDTree(points)
    assert tree.leaf_size == 32 and tree.halves
    assert tree.node_lo.shape == (3, 4 * tree.num_leaves - 1)
    for pts, idx in zip(*_leaves_of(tree)):
        real = idx < n
        first, second = pts[:16][real[:16]], pts[16:][real[16:]]
        # The points fill the first half first, and the halves lie on either side
        # of one plane.
        assert len(first) == min(16, real.sum())
        if len(second):
            assert (first.max(0) <= second.min(0)).any()


def test_explicit_leaf_size_has_no_halves():
    tree = kdeqx.KDTree(np.random.default_rng(0).random((100, 2)), leaf_size=32)
    assert not tree.halves and tree._halves_as_leaves() is tree
    assert tree.node_lo.shape == (2, 2 * tree.num_leaves - 1)


def test_search_scale_is_an_exact_power_of_two():
    for magnitude in (1e-30, 1.0, 3.0, 1e30):
        tree = kdeqx.KDTree(np.array([[magnitude, -magnitude / 2]]))
        mantissa, _ = np.frexp(float(tree.scale))
        assert mantissa == 0.5
        assert 0.5 <= magnitude * float(tree.scale) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_is_kept(dtype):
    tree = kdeqx.KDTree(np.ones((10, 2), dtype))
    assert tree.points.dtype == dtype and tree.leaf_points.dtype == dtype
    distances, _ = tree.query(np.zeros(2, dtype), 1)
    assert distances.dtype == dtype


def test_integer_points_become_default_float():
    tree = kdeqx.KDTree(np.arange(12).reshape(6, 2))
    assert tree.points.dtype == jnp.result_type(float)


def test_build_under_jit_and_eager_agree():
    points = np.random.default_rng(1).random((300, 3))
    eager = kdeqx.KDTree(points)
    jitted = jax.jit(kdeqx.KDTree)(points)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, b)


def test_eval_shape_gives_the_skeleton():
    points = jax.ShapeDtypeStruct((1000, 3), jnp.float32)
    skeleton = eqx.filter_eval_shape(kdeqx.KDTree, points)
    real = kdeqx.KDTree(np.zeros((1000, 3), np.float32))
    shapes = lambda t: [(a.shape, a.dtype) for a in jax.tree.leaves(t)]  # noqa: E731
    assert shapes(skeleton) == shapes(real)


def _split_dimension_and_halves(tree, points):
    """The root's two halves of the data, as rows of `points`."""
    _, leaf_indices = _leaves_of(tree)
    half = tree.num_leaves // 2
    left, right = leaf_indices[:half].ravel(), leaf_indices[half:].ravel()
    return points[left[left < tree.n]], points[right[right < tree.n]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_root_splits_the_widest_dimension_at_its_median(dtype):
    rng = np.random.default_rng(3)
    points = (rng.random((1000, 3)) * [1.0, 5.0, 2.0]).astype(dtype)
    left, right = _split_dimension_and_halves(kdeqx.KDTree(points), points)
    assert len(left) == 512 and len(right) == 488  # the left half is always full
    assert left[:, 1].max() <= right[:, 1].min()


def test_the_build_does_not_need_x64():
    # The build sorts 64-bit keys inside a local x64 context; the same tree must come
    # out with x64 off (the default), under jit and under vmap.
    points = DATASETS["duplicates"](np.random.default_rng(5), 700, 3).astype(np.float32)
    expected = np.asarray(kdeqx.KDTree(points).leaf_indices)
    with x64_off():
        tree = eqx.filter_jit(kdeqx.KDTree)(points)
        batched = eqx.filter_vmap(kdeqx.KDTree)(np.stack([points, points[::-1]]))
        assert tree.leaf_indices.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(tree.leaf_indices), expected)
    np.testing.assert_array_equal(np.asarray(batched.leaf_indices[0]), expected)
    reversed_ = np.asarray(batched.leaf_indices[1])
    np.testing.assert_array_equal(np.sort(reversed_[reversed_ < 700]), np.arange(700))


@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("d", [1, 2, 3, 5])
# 600 points fill 150 of 256 leaves: the levels then partition only the leading
# positions (640 of 1,024 slots); 1,000 points fill all 1,024.
@pytest.mark.parametrize("n", [600, 1000])
def test_every_node_splits_its_widest_dimension_at_its_median(dataset, d, n):
    # Each node's first `size / 2` slots hold the points first in its widest dimension
    # (ties by index): checked at every level against the points themselves.
    points = DATASETS[dataset](np.random.default_rng(d), n, d).astype(np.float32)
    tree = kdeqx.KDTree(points, leaf_size=4)
    leaf_points, leaf_indices = _leaves_of(tree)
    coords, indices = leaf_points.reshape(-1, d), leaf_indices.ravel()
    size = indices.size
    while size > tree.leaf_size:
        for first in range(0, indices.size, size):
            node = slice(first, first + size)
            real = indices[node] < n
            if not real.any():
                continue
            here, ids = coords[node][real], indices[node][real]
            widest = np.argmax(here.max(0) - here.min(0))
            order = np.lexsort((ids, here[:, widest]))
            left = min(real.sum(), size // 2)
            assert real[: size // 2].sum() == left
            np.testing.assert_array_equal(
                np.sort(ids[:left]), np.sort(ids[order[:left]])
            )
        size //= 2
