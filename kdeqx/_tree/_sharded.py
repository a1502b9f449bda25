"""Points sharded over devices: one k-d tree per device, and exact merged answers."""

import functools as ft
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._custom_types import Array, ArrayLike, Float, Int
from .._engine._metric import Minkowski
from .._engine._search import rows_at
from .._query._pairs import counts_within, no_pairs, Pairs, pairs_within
from .._validate import as_period, index_dtype_for
from ._tree import (
    AbstractKDTree,
    check_engine,
    check_leaf_size,
    check_points,
    KDTree,
    scipy_alias,
)


def _split_rows(rows: Array, num_shards: int) -> tuple[Array, Array]:
    """Rows `[0, S q)` as `S` blocks of `q = n // S`, and the `n - S q` left over."""
    per_shard = rows.shape[0] // num_shards
    body = rows[: num_shards * per_shard]
    blocks = body.reshape(num_shards, per_shard, *rows.shape[1:])
    return blocks, rows[body.shape[0] :]


def _to_global(
    indices: Int[Array, "*batch k"], local_n: int, offset, n: int, dtype
) -> Int[Array, "*batch k"]:
    """Rows of one tree's points to rows of all points; its sentinel becomes `n`."""
    found = indices < local_n
    return jnp.where(found, indices.astype(dtype) + offset, n).astype(dtype)


def _candidates_last(gathered: Array, batch_ndim: int) -> Array:
    """An all-gather's `(S, *batch, k, *feature)` as `(*batch, S k, *feature)`."""
    moved = jnp.moveaxis(gathered, 0, batch_ndim)
    shape = moved.shape
    merged = shape[batch_ndim] * shape[batch_ndim + 1]
    return moved.reshape(*shape[:batch_ndim], merged, *shape[batch_ndim + 2 :])


def _k_best(
    distances: Float[Array, "*batch c"],
    indices: Int[Array, "*batch c"],
    rows: Array | None,
    k: int,
) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"], Array | None]:
    """The `k` lexicographically smallest `(distance, index)` candidates per query.

    That is the order every tree answers in, and a real index is a candidate at most
    once, so the selection is exact; the `(inf, n)` sentinels tie only with each other.
    `rows`, one per candidate of shape `(*batch, c, *feature)`, are carried along.
    """
    batch_ndim = distances.ndim - 1
    position = jnp.broadcast_to(jnp.arange(distances.shape[-1]), distances.shape)
    distances, indices, position = lax.sort(
        (distances, indices, position), dimension=batch_ndim, num_keys=2
    )
    distances, indices, position = (a[..., :k] for a in (distances, indices, position))
    if rows is None:
        return distances, indices, None
    feature_ndim = rows.ndim - distances.ndim
    position = position.reshape(*position.shape, *(1,) * feature_ndim)
    return distances, indices, jnp.take_along_axis(rows, position, axis=batch_ndim)


class ShardedKDTree(AbstractKDTree):
    """Exact k-d tree queries over points sharded across the devices of a mesh.

    With `S` devices along `axis_name`, the first `S q` points (`q = n // S`) are split
    into `S` contiguous blocks of `q`, and each device builds a `kdeqx.KDTree` over its
    own block; the `n - S q < S` points left over go into one small tree that every
    device holds. No point is padded or duplicated, so every answer is exact: a query
    runs on every device against its local tree, local row numbers are mapped to the
    global numbering (block `s` starts at row `s q`), the candidates per query of every
    device are all-gathered, and each device keeps the best by `(distance, index)`.
    The result is the one a single `KDTree` over all points returns (distances sorted,
    ties by lower index, missing neighbours `(inf, n)`), replicated over the mesh.
    Every query method is `kdeqx.AbstractKDTree`'s.

    **Memory per device:** the local tree over `q = n // S` points (the `(q, d)` points
    plus search arrays of about `2 max(q, leaf_size)` slots, a few times `q d` in all),
    plus the left-over tree of fewer than `S` points, plus the queries, which every
    device needs in full: `Q d`, and `S Q k` gathered candidates during a query.

    **Communication per query batch:** `query` and `query_ball_point` all-gather `Q k`
    (distance, index) pairs from each device (`(S - 1) Q k` pairs received per device;
    `k` is `max_neighbors` for `query_ball_point`); `interpolate` also carries each
    candidate's value row, so no device ever needs all of `values`; counts (of
    `count_ball_point` and `query_ball_point`) are one all-reduce of `Q` integers. The
    queries themselves are broadcast to all devices if they are not already
    replicated. Building the trees moves each block of points to its device once and
    nothing between devices after that.
    """

    shards: KDTree | None
    leftover: KDTree
    mesh: Mesh = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    # Each device's tree checks its block of points and its copy of the queries.
    checks_traced_inputs: ClassVar[bool] = False

    def __init__(
        self,
        points: ArrayLike,
        mesh: Mesh,
        axis_name: str = "shards",
        *,
        box: None | float | ArrayLike = None,
        leaf_size: int | None = None,
        engine: str = "auto",
        leafsize: int | None = None,
        boxsize: None | float | ArrayLike = None,
    ):
        """**Arguments:**

        - `points`: the data, shape `(n, d)`, finite; float32 and float64 are kept
            (float64 where JAX has x64 enabled, as for `KDTree`). A
            `jax.Array` already sharded over `axis_name` on its first axis (with `S`
            dividing `n`) is split without ever being gathered onto one device.
        - `mesh`: a `jax.sharding.Mesh`, for example `jax.make_mesh((S,), ("shards",))`.
            Other mesh axes (if any) hold copies of the same trees.
        - `axis_name`: the mesh axis to shard the points over; its size `S` is the
            number of trees.
        - `box`: periodic box lengths, as for `kdeqx.KDTree`.
        - `leaf_size`: points per leaf bucket, as for `kdeqx.KDTree`.
        - `engine`: how each device's tree is searched, as for `kdeqx.KDTree`.
        - `leafsize`, `boxsize`: scipy's names for `leaf_size` and `box`, as for
            `kdeqx.KDTree`.
        """
        leaf_size = scipy_alias("leaf_size", leaf_size, "leafsize", leafsize)
        box = scipy_alias("box", box, "boxsize", boxsize)
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"`mesh` must be a `jax.sharding.Mesh`, got {type(mesh).__name__}."
            )
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"`axis_name` {axis_name!r} is not an axis of the mesh, whose axes are "
                f"{tuple(mesh.axis_names)}."
            )
        points = check_points("points", points, traced=False)
        leaf_size = check_leaf_size(leaf_size)
        resolved = check_engine(engine)
        period = as_period(box, points.shape[1], points.dtype)
        self.shards, self.leftover = _build(
            points,
            period,
            mesh=mesh,
            axis_name=axis_name,
            leaf_size=leaf_size,
            engine=resolved,
        )
        self.mesh = mesh
        self.axis_name = axis_name

    @property
    def period(self) -> Float[Array, " d"] | None:
        return self.leftover.period

    @property
    def num_shards(self) -> int:
        """Number of local trees `S` (the size of the mesh axis)."""
        return self.mesh.shape[self.axis_name]

    @property
    def per_shard(self) -> int:
        """Points in each local tree, `q = n // S`."""
        return 0 if self.shards is None else self.shards.points.shape[-2]

    @property
    def n(self) -> int:
        return self.num_shards * self.per_shard + self.leftover.n

    @property
    def d(self) -> int:
        return self.leftover.d

    @property
    def dtype(self) -> jnp.dtype:
        return self.leftover.dtype

    def _knn(self, x, bound, k, metric):
        distances, indices, _, _ = _merged(self, x, bound, metric, "knn", k, None)
        return distances, indices

    def _count(self, x, r, metric):
        return _merged(self, x, r, metric, "count", 0, None)[3]

    def _collect(self, x, r, max_neighbors, metric):
        answer = _merged(self, x, r, metric, "ball", max_neighbors, None)
        distances, indices, _, counts = answer
        return distances, indices, counts

    def _points(self):
        if self.shards is None:
            return self.leftover.points
        replicated = NamedSharding(self.mesh, PartitionSpec())
        blocks = jax.device_put(self.shards.points, replicated).reshape(-1, self.d)
        return jnp.concatenate([blocks, self.leftover.points])

    def _pairs(self, x, r, capacity, metric, above):
        return _merged_pairs(self, x, r, capacity, metric, above)

    def _self_pairs(self, r, capacity, metric, sort):
        del sort  # the merge of every device's pairs sorts them anyway
        return self._pairs(self._points(), r, capacity, metric, True)

    def _self_matrix(self, r, capacity, metric):
        return self._pairs(self._points(), r, capacity, metric, False)

    def _counts_within(self, x, radii, metric, x_weights, weights):
        return _merged_counts(self, x, radii, metric, x_weights, weights)

    def _knn_rows(self, x, k, values, metric):
        bound = jnp.asarray(jnp.inf, x.dtype)
        answer = _merged(self, x, bound, metric, "knn", k, values)
        distances, indices, rows, _ = answer
        return distances, indices, rows


def _local_tree(block: KDTree) -> KDTree:
    """This device's tree, from its `(1, ...)` block of the batch of trees."""
    return jax.tree.map(lambda a: a[0], block)


def _on_mesh(fn, mesh: Mesh, in_specs: tuple, out_specs):
    """`jax.shard_map(fn)`, with every argument first laid out as `in_specs` says.

    The layout is a no-op for arguments already placed so; it lets callers pass
    arrays on any device or sharding, on meshes with explicit or automatic axes.
    """
    # The trees' own input checks (`eqx.error_if`) lower through a host callback, whose
    # result JAX cannot prove identical on every device: `check_vma=False` accepts it.
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )

    def laid_out_then_mapped(*args):
        args = [
            jax.device_put(arg, NamedSharding(mesh, spec))
            for arg, spec in zip(args, in_specs, strict=True)
        ]
        return mapped(*args)

    return laid_out_then_mapped


@eqx.filter_jit
def _build(
    points: Float[Array, "n d"],
    period: Float[Array, " d"] | None,
    *,
    mesh: Mesh,
    axis_name: str,
    leaf_size: int | None,
    engine: str,
) -> tuple[KDTree | None, KDTree]:
    """The batch of local trees (sharded; `None` if `q = 0`) and the left-over tree
    (replicated)."""
    blocks, rest = _split_rows(points, mesh.shape[axis_name])
    replicate = ft.partial(jax.device_put, device=NamedSharding(mesh, PartitionSpec()))
    leftover = KDTree(
        replicate(rest),
        box=period,
        leaf_size=leaf_size,
        split_queries=False,
        engine=engine,  # pyright: ignore[reportArgumentType]
    )
    leftover = replicate(leftover)
    if blocks.shape[1] == 0:
        return None, leftover

    def build_on_device(block, period):
        local = KDTree(
            block[0],
            box=period,
            leaf_size=leaf_size,
            split_queries=False,
            engine=engine,  # pyright: ignore[reportArgumentType]
        )
        return jax.tree.map(lambda a: a[None], local)

    sharded, replicated = PartitionSpec(axis_name), PartitionSpec()
    shards = _on_mesh(build_on_device, mesh, (sharded, replicated), sharded)(
        blocks, period
    )
    return shards, leftover


_Kind = Literal["knn", "count", "ball"]


def _local_answer(tree: KDTree, kind: _Kind, x, threshold, metric: Minkowski, k: int):
    """One tree's `(distances, indices, counts)` for a query kind, `None` where the
    kind has none; at most `n` candidates of a tree of `n >= 1` points."""
    k = min(k, tree.n)
    if kind == "knn":
        return (*tree._knn(x, threshold, k, metric), None)
    if kind == "count":
        return None, None, tree._count(x, threshold, metric)
    return tree._collect(x, threshold, k, metric)


@eqx.filter_jit
def _merged(
    tree: ShardedKDTree,
    x: Float[Array, "*batch d"],
    threshold: Float[Array, "*batch"] | Float[Array, ""],
    metric: Minkowski,
    kind: _Kind,
    k: int,
    values: Float[Array, "n ..."] | None,
):
    """Every tree's answer to a query kind, merged: the `k` best candidates of all
    trees (with their rows of `values`, if given) and the sum of their counts.

    Returns `(distances, indices, rows, counts)`, `None` where the kind has none.
    """
    n, per_shard = tree.n, tree.per_shard
    leftover_start = tree.num_shards * per_shard
    index_dtype = index_dtype_for(n)
    batch_ndim = x.ndim - 1
    if values is None:
        value_blocks = value_rest = None
    else:
        value_blocks, value_rest = _split_rows(values, tree.num_shards)

    def in_global_numbering(distances, local_indices, local_n, offset, value_rows):
        """One tree's candidates: global indices, and their rows of `values`."""
        indices = _to_global(local_indices, local_n, offset, n, index_dtype)
        rows = None if value_rows is None else rows_at(value_rows, local_indices)
        return distances, indices, rows

    def on_device(shards, leftover, x, threshold, metric, value_blocks, value_rest):
        candidates, counts = [], []
        if shards is not None:
            distances, indices, local_counts = _local_answer(
                _local_tree(shards), kind, x, threshold, metric, k
            )
            if local_counts is not None:
                local_counts = local_counts.astype(index_dtype)
                counts.append(lax.psum(local_counts, tree.axis_name))
            if distances is not None:
                # In the global index dtype: `s q` may not fit in 32 bits.
                offset = lax.axis_index(tree.axis_name).astype(index_dtype) * per_shard
                block = None if value_blocks is None else value_blocks[0]
                local = in_global_numbering(
                    distances, indices, per_shard, offset, block
                )
                gathered = lax.all_gather(local, tree.axis_name)
                candidates.append(
                    jax.tree.map(lambda a: _candidates_last(a, batch_ndim), gathered)
                )
        if leftover.n > 0:
            distances, indices, rest_counts = _local_answer(
                leftover, kind, x, threshold, metric, k
            )
            if rest_counts is not None:
                counts.append(rest_counts.astype(index_dtype))
            if distances is not None:
                candidates.append(
                    in_global_numbering(
                        distances, indices, leftover.n, leftover_start, value_rest
                    )
                )
        total = sum(counts, start=jnp.zeros(x.shape[:-1], index_dtype))
        if kind == "count":
            return None, None, None, total
        if not candidates:  # n = 0: only sentinels
            missing = jnp.full((*x.shape[:-1], k), jnp.inf, x.dtype)
            return missing, jnp.full(missing.shape, n, index_dtype), None, total
        distances, indices, rows = zip(*candidates, strict=True)
        best = _k_best(
            jnp.concatenate(distances, axis=-1),
            jnp.concatenate(indices, axis=-1),
            None if values is None else jnp.concatenate(rows, axis=batch_ndim),
            k,
        )
        return *best, (None if kind == "knn" else total)

    sharded, replicated = PartitionSpec(tree.axis_name), PartitionSpec()
    in_specs = (sharded, replicated, replicated, replicated, replicated)
    in_specs = (*in_specs, sharded, replicated)
    return _on_mesh(on_device, tree.mesh, in_specs, replicated)(
        tree.shards, tree.leftover, x, threshold, metric, value_blocks, value_rest
    )


@eqx.filter_jit
def _merged_pairs(
    tree: ShardedKDTree,
    x: Float[Array, "m d"],
    r: Float[Array, ""],
    capacity: int,
    metric: Minkowski,
    above: bool,
) -> Pairs:
    """Every tree's pairs in the global numbering, merged: the first `capacity` in
    order, and the sum of the counts (all-gathered, then the same on every device)."""
    m, n, per_shard = x.shape[0], tree.n, tree.per_shard
    leftover_start = tree.num_shards * per_shard
    index_dtype = index_dtype_for(max(m, n) + 1)

    def found_by(local_tree, x, r, metric, offset):
        local = pairs_within(local_tree, x, r, capacity, metric, above, offset)
        cols = _to_global(local.cols, local_tree.n, offset, n, index_dtype)
        return Pairs(
            local.rows.astype(index_dtype),
            cols,
            local.distances,
            local.count.astype(index_dtype),
        )

    def on_device(shards, leftover, x, r, metric):
        found = []
        if shards is not None:
            offset = lax.axis_index(tree.axis_name).astype(index_dtype) * per_shard
            gathered = lax.all_gather(
                found_by(_local_tree(shards), x, r, metric, offset), tree.axis_name
            )
            found.append(
                Pairs(
                    gathered.rows.reshape(-1),
                    gathered.cols.reshape(-1),
                    gathered.distances.reshape(-1),
                    jnp.sum(gathered.count),
                )
            )
        if leftover.n > 0:
            offset = jnp.asarray(leftover_start, index_dtype)
            found.append(found_by(leftover, x, r, metric, offset))
        if not found:
            return no_pairs(m, n, capacity, x.dtype, index_dtype)
        merged = _concatenated(found)
        # The distances travel with the pairs: a sort by two keys and a payload.
        sorted_ = lax.sort((merged.rows, merged.cols, merged.distances), num_keys=2)
        rows, cols, distances = (a[:capacity] for a in sorted_)
        return Pairs(rows, cols, distances, merged.count)

    sharded, replicated = PartitionSpec(tree.axis_name), PartitionSpec()
    in_specs = (sharded, replicated, replicated, replicated, replicated)
    return _on_mesh(on_device, tree.mesh, in_specs, replicated)(
        tree.shards, tree.leftover, x, r, metric
    )


def _concatenated(found: list[Pairs]) -> Pairs:
    return Pairs(
        jnp.concatenate([f.rows for f in found]),
        jnp.concatenate([f.cols for f in found]),
        jnp.concatenate([f.distances for f in found]),
        sum((f.count for f in found[1:]), start=found[0].count),
    )


@eqx.filter_jit
def _merged_counts(
    tree: ShardedKDTree,
    x: Float[Array, "m d"],
    radii: Float[Array, " radii"],
    metric: Minkowski,
    x_weights: Float[Array, " m"] | None,
    weights: Float[Array, " n"] | None,
) -> Array:
    """Every tree's pair counts, summed (an all-reduce of `len(radii)` numbers)."""
    if weights is None:
        weight_blocks = weight_rest = None
    else:
        weight_blocks, weight_rest = _split_rows(weights, tree.num_shards)

    def on_device(shards, leftover, x, radii, metric, x_weights, blocks, rest):
        totals = []
        if shards is not None:
            block = None if blocks is None else blocks[0]
            local = counts_within(
                _local_tree(shards), x, radii, metric, x_weights, block
            )
            totals.append(lax.psum(local, tree.axis_name))
        if leftover.n > 0:
            totals.append(counts_within(leftover, x, radii, metric, x_weights, rest))
        return sum(totals[1:], start=totals[0])

    if tree.n == 0:
        return counts_within(tree.leftover, x, radii, metric, x_weights, weight_rest)
    sharded, replicated = PartitionSpec(tree.axis_name), PartitionSpec()
    in_specs = (sharded, replicated, replicated, replicated, replicated, replicated)
    in_specs = (*in_specs, sharded, replicated)
    return _on_mesh(on_device, tree.mesh, in_specs, replicated)(
        tree.shards,
        tree.leftover,
        x,
        radii,
        metric,
        x_weights,
        weight_blocks,
        weight_rest,
    )
