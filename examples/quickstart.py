"""Quickstart: build a tree, query it, differentiate through it, batch it, save it."""

import os
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp

import kdeqx


n = 1_000_000 if os.environ.get("KDEQX_FULL") else 20_000

points = jax.random.uniform(jax.random.key(0), (n, 3))
tree = kdeqx.KDTree(points)
print(f"built a tree over {n:,} points: {tree.num_leaves:,} leaves of {tree.leaf_size}")

queries = jax.random.uniform(jax.random.key(1), (5, 3))
distances, indices = tree.query(queries, k=3)
print("3 nearest neighbours of 5 queries:\n", indices, "\n", distances)

# Distances are differentiable in the queries (and in the points).
grads = jax.grad(lambda x: tree.query(x, k=3)[0].sum())(queries)
print("gradient of the summed distances w.r.t. the queries:\n", grads)

# Missing neighbours follow scipy: distance inf, index n.
d, i = tree.query(queries[0], k=2, distance_upper_bound=1e-6)
print("nothing within 1e-6 of the first query:", d, i)

# A batch of trees is one vmap away.
batch = jax.random.uniform(jax.random.key(2), (4, 1000, 3))
trees = jax.vmap(kdeqx.KDTree)(batch)
d, i = jax.vmap(lambda t: t.query(jnp.full(3, 0.5), k=1))(trees)
print("nearest point to the centre in each of 4 trees:", i[:, 0])

# Save and load without rebuilding.
path = os.path.join(tempfile.mkdtemp(), "tree.eqx")
eqx.tree_serialise_leaves(path, tree)
skeleton = eqx.filter_eval_shape(
    kdeqx.KDTree, jax.ShapeDtypeStruct((n, 3), points.dtype)
)
loaded = eqx.tree_deserialise_leaves(path, skeleton)
print(
    "loaded tree answers the same:",
    bool((loaded.query(queries, 3)[1] == indices).all()),
)
