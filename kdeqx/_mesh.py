"""Queries split over a mesh with explicit axes (`jax.make_mesh`'s default).

On such a mesh every array's type carries its sharding, and a gather from a replicated
array (the tree) by indices split over the mesh (one per query) has no unambiguous
sharding: JAX refuses to trace it. A query's answers for one query depend on that
query alone, though, so the walk runs with the mesh's axes made automatic, where the
compiler keeps the queries split, and hands back its answers split like the queries.
"""

import functools as ft

import equinox as eqx
import jax
from jax.sharding import AxisType, PartitionSpec


def _explicit_mesh(tree):
    """The mesh of the first array in `tree` sharded over explicit axes, or `None`."""
    for leaf in jax.tree.leaves(tree):
        if eqx.is_array(leaf):
            mesh = jax.typeof(leaf).sharding.mesh
            if not mesh.empty and AxisType.Explicit in mesh.axis_types:
                return mesh
    return None


def split_like_queries(fn):
    """Wraps `fn(data, queries, *args)`, each of whose outputs leads with the batch
    axes of `queries` (all its axes but the last).

    Off explicit meshes it is `fn`. On one, `fn` runs with the mesh's axes automatic,
    and every output comes back split as the batch axes of `queries` are (replicated
    along its other axes).
    """

    @ft.wraps(fn)
    def split(data, queries, *args):
        mesh = _explicit_mesh((data, queries, args))
        if mesh is None:
            return fn(data, queries, *args)
        # Arrays pass through `auto_axes`; Python configuration (`k`) is closed over.
        arrays, config = eqx.partition((data, queries, args), eqx.is_array)

        def run(arrays):
            data, queries, args = eqx.combine(arrays, config)
            return fn(data, queries, *args)

        spec = tuple(jax.typeof(queries).sharding.spec)
        batch_spec = spec[: queries.ndim - 1]
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.sharding.auto_axes(run, out_sharding=PartitionSpec(*batch_spec))(
                arrays
            )

    return split
