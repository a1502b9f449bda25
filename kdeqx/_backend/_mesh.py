"""Queries split over devices: over a mesh with explicit axes, and over the CPU's
devices.

On a mesh with explicit axes (`jax.make_mesh`'s default) every array's type carries its
sharding, and a gather from a replicated array (the tree) by indices split over the mesh
(one per query) has no unambiguous sharding: JAX refuses to trace it. A query's answers
depend on that query alone, though, so the walk runs with the mesh's axes made
automatic, where the compiler keeps the queries split, and hands back its answers split
like the queries.
"""

import functools as ft
import math

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import device_per_core_options


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


def split_over_cpu_devices(fn):
    """Wraps `fn(tree, queries, threshold, *config)`, whose outputs lead with the batch
    axes of `queries`, so that the queries are split over the CPU's devices.

    XLA:CPU runs one program with a few intra-op threads; several CPU devices (set
    with `jax.config.update("jax_num_cpu_devices", N)` before JAX starts) each walk
    their share of the queries with lanes of their own, and nothing is communicated
    but the queries and the answers. With one device, a tree whose `split_queries` is
    off, queries already split or inside a mesh, or too few queries, it is `fn`.
    `threshold` is a scalar or one per query.
    """

    @ft.wraps(fn)
    def split(tree, x, threshold, *config):
        devices = cpu_devices_for(tree, x)
        if len(devices) < 2:
            return fn(tree, x, threshold, *config)
        # Called eagerly, the tree (and queries committed to one device) go to every
        # device without copies; inside the caller's `jit`, JAX copies the tree.
        tree, x, threshold = shared_with_cpu_devices((tree, x, jnp.asarray(threshold)))
        # (Compiler options apply to an outermost `jit` alone; inside a trace, even
        # the threshold made here is a tracer.)
        traced = any(
            isinstance(a, jax.core.Tracer)
            for a in jax.tree.leaves((tree, x, threshold))
        )
        options = {} if traced else device_per_core_options(len(devices))
        split_queries = _split_queries_jitted(tuple(options.items()))
        return split_queries(fn, tuple(devices), tree, x, threshold, config)

    return split


@ft.cache
def _split_queries_jitted(compiler_options: tuple):
    """`_split_queries`, jitted with these compiler options (items of a dict: see
    `kdeqx._backend.device_per_core_options`), which apply where this `jit` is the
    outermost. Jitted, so that a call from outside any `jit` compiles once: an eager
    `shard_map` compiled its body again on every call, which took far longer than
    the query."""
    if not compiler_options:
        return eqx.filter_jit(_split_queries)
    # (`filter_jit` hands keyword arguments on to `jax.jit`; its type hints omit them.)
    return eqx.filter_jit(_split_queries, compiler_options=dict(compiler_options))  # pyright: ignore[reportCallIssue]


def _split_queries(fn, devices: tuple, tree, x, threshold, config: tuple):
    batch = x.shape[:-1]
    q = math.prod(batch)
    x = x.reshape(q, x.shape[-1])
    if jnp.ndim(threshold) > 0:  # one threshold per query: split with the queries
        answers = split_rows_over(
            devices,
            lambda t, x, th: fn(t, x, th, *config),
            (x, threshold.reshape(q)),
            shared=(tree,),
        )
    else:
        answers = split_rows_over(
            devices, lambda t, th, x: fn(t, x, th, *config), (x,), (tree, threshold)
        )
    return jax.tree.map(lambda a: a.reshape(*batch, *a.shape[1:]), answers)


def split_rows_over(devices, fn, rows: tuple, shared: tuple = ()):
    """`fn(*shared, *rows)`, for arrays `rows` whose leading axis is one row per query
    and an `fn` whose outputs lead with it too: each device computes a block of the
    rows (the last row repeated to whole blocks, its answers dropped), with a copy of
    each of `shared`."""
    q = rows[0].shape[0]
    size = q + (-q) % len(devices)
    mesh = Mesh(np.array(devices), ("cpu",))
    split, copied = PartitionSpec("cpu"), PartitionSpec()
    specs = (copied,) * len(shared) + (split,) * len(rows)
    arrays = (*shared, *(_padded_rows(a, size) for a in rows))
    placed = [
        jax.device_put(a, NamedSharding(mesh, spec))
        for a, spec in zip(arrays, specs, strict=True)
    ]
    answers = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=specs,
        out_specs=split,
        # The trees' own checks (`eqx.error_if`) are host callbacks, whose results
        # JAX cannot prove the same on every device.
        check_vma=False,
    )(*placed)
    return jax.tree.map(lambda a: a[:q], answers)


def _padded_rows(array, rows: int):
    missing = rows - array.shape[0]
    if missing == 0:
        return array
    last = jnp.broadcast_to(array[-1:], (missing, *array.shape[1:]))
    return jnp.concatenate([array, last])


# Fewer queries per device than this are answered on one device.
_MIN_QUERIES_PER_DEVICE = 256


def cpu_devices_for(tree, x) -> list:
    """The CPU devices to split the queries `x` over (none: do not split). A tree
    without `split_queries` (a `ShardedKDTree`) splits its own way."""
    if not getattr(tree, "split_queries", False) or jax.default_backend() != "cpu":
        return []
    devices = jax.local_devices()
    q = math.prod(x.shape[:-1])
    if len(devices) < 2 or q < _MIN_QUERIES_PER_DEVICE * len(devices):
        return []
    if not jax.sharding.get_abstract_mesh().empty or _explicit_mesh((tree, x)):
        return []  # inside `shard_map` or a mesh of the user's: theirs to split
    if not isinstance(x, jax.core.Tracer) and len(x.sharding.device_set) > 1:
        return []  # already split by the user
    return devices


# Below this many bytes the arrays are left as given: placing them as aliases costs
# a fixed amount of Python per call, about what a split query's copy of a tree of
# this size costs (eager queries, aliased against copied: see `benchmarks/sharded.py`).
_SHARE_FROM_BYTES = 2**22


def shared_with_cpu_devices(arrays):
    """`arrays` (a pytree) with each `jax.Array` on one device placed on every CPU
    device without a copy, where the CPU has several devices; otherwise (under a
    trace, inside a mesh, arrays already on several devices, fewer than
    `_SHARE_FROM_BYTES` none of which is committed to a device) as given.

    A query split over the CPU's devices hands each device the tree, and a tree on
    one device is copied to every other device on every call: a sizeable share of a
    large kNN query, the more so the more devices. CPU devices share the process's
    memory, so each device's buffer can alias the one array. If any placement would
    copy instead (JAX aliases aligned buffers only), nothing is placed: copies of a
    large tree would cost memory and gain nothing.
    """
    devices = jax.local_devices()
    flat, structure = jax.tree.flatten(arrays)
    leaves = [a for a in flat if isinstance(a, jax.Array)]
    if (
        jax.default_backend() != "cpu"
        or len(devices) < 2
        or any(isinstance(a, jax.core.Tracer) for a in leaves)
        or any(len(a.sharding.device_set) > 1 for a in leaves)
        or not jax.sharding.get_abstract_mesh().empty
    ):
        return arrays
    small = sum(a.nbytes for a in leaves) < _SHARE_FROM_BYTES
    if small and not any(getattr(a, "committed", True) for a in leaves):
        return arrays  # (arrays committed to one device are shared whatever their size)
    views = [np.asarray(a) for a in leaves]
    placed = [jax.device_put(views, device) for device in devices]  # one call each
    if any(
        view.size > 0 and copy.unsafe_buffer_pointer() != view.ctypes.data
        for copies in placed
        for view, copy in zip(views, copies, strict=True)
    ):
        return arrays  # copied, not aliased
    replicated = NamedSharding(Mesh(np.array(devices), ("cpu",)), PartitionSpec())
    shared = iter(
        jax.make_array_from_single_device_arrays(view.shape, replicated, list(copies))
        for view, *copies in zip(views, *placed, strict=True)
    )
    flat = [next(shared) if isinstance(a, jax.Array) else a for a in flat]
    return jax.tree.unflatten(structure, flat)


def split_sum_over_cpu_devices(fn):
    """Wraps `fn(tree, queries, row_weights, *config)`, whose output is a sum over
    the queries in which each query counts `row_weights` times, so that the queries
    are split over the CPU's devices (as `split_over_cpu_devices`) and the devices'
    sums added: one all-reduce of the output, whatever the number of queries.
    """

    @ft.wraps(fn)
    def split(tree, x, row_weights, *config):
        devices = cpu_devices_for(tree, x)
        if len(devices) < 2:
            return fn(tree, x, row_weights, *config)
        tree = shared_with_cpu_devices(tree)  # as in `split_over_cpu_devices`
        mesh = Mesh(np.array(devices), ("cpu",))
        q = x.shape[0]
        rows = q + (-q) % len(devices)
        # Whole blocks per device: the padding repeats the last query, weighing 0.
        x = _padded_rows(x, rows)
        row_weights = jnp.pad(row_weights, (0, rows - q))
        queries, shared = PartitionSpec("cpu"), PartitionSpec()
        specs = (shared, queries, queries)
        placed = [
            jax.device_put(a, NamedSharding(mesh, spec))
            for a, spec in zip((tree, x, row_weights), specs, strict=True)
        ]
        return jax.shard_map(
            lambda t, x, w: jax.lax.psum(fn(t, x, w, *config), "cpu"),
            mesh=mesh,
            in_specs=specs,
            out_specs=shared,
            check_vma=False,  # as in `split_over_cpu_devices`
        )(*placed)

    return split
