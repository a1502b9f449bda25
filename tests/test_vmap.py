import jax
import numpy as np
import pytest

import kdeqx

from .helpers import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_over_a_batch_of_trees_matches_a_loop(dtype):
    rng = np.random.default_rng(0)
    points = rng.random((4, 150, 3)).astype(dtype)
    x = rng.random((4, 30, 3)).astype(dtype)
    trees = jax.vmap(kdeqx.KDTree)(points)
    distances, indices = jax.jit(jax.vmap(lambda t, x: t.query(x, 5)))(trees, x)
    for b in range(4):
        ref_d, ref_i = kdeqx.KDTree(points[b]).query(x[b], 5)
        np.testing.assert_array_equal(indices[b], ref_i)
        np.testing.assert_allclose(distances[b], ref_d, rtol=1e-6)


def test_vmap_over_queries_matches_batched_call():
    rng = np.random.default_rng(1)
    tree = kdeqx.KDTree(rng.random((200, 2)))
    x = rng.random((17, 2))
    by_vmap = jax.vmap(lambda x: tree.query(x, 3))(x)
    batched = tree.query(x, 3)
    for a, b in zip(by_vmap, batched):
        np.testing.assert_array_equal(a, b)


def test_vmap_with_per_tree_upper_bounds():
    rng = np.random.default_rng(2)
    trees = jax.vmap(kdeqx.KDTree)(rng.random((3, 100, 2)))
    x = rng.random((3, 10, 2))
    bounds = np.array([0.01, 0.1, 10.0])
    query = jax.vmap(lambda t, x, b: t.query(x, 4, distance_upper_bound=b))
    distances, indices = query(trees, x, bounds)
    for b in range(3):
        tree = jax.tree.map(lambda a: a[b], trees)
        ref = tree.query(x[b], 4, distance_upper_bound=bounds[b])
        np.testing.assert_array_equal(indices[b], ref[1])
