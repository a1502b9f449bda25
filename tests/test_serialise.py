import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdeqx


def test_serialise_round_trip_into_an_eval_shape_skeleton(tmp_path):
    rng = np.random.default_rng(0)
    points = rng.random((500, 3)).astype(np.float32)
    tree = kdeqx.KDTree(points)
    path = tmp_path / "tree.eqx"
    eqx.tree_serialise_leaves(path, tree)

    like = jax.ShapeDtypeStruct(points.shape, jnp.float32)
    skeleton = eqx.filter_eval_shape(kdeqx.KDTree, like)
    loaded = eqx.tree_deserialise_leaves(path, skeleton)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
    x = rng.random((20, 3)).astype(np.float32)
    for a, b in zip(tree.query(x, 4), loaded.query(x, 4)):
        np.testing.assert_array_equal(a, b)
