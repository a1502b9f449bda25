"""Points sharded over devices: one k-d tree per device, and exact merged answers."""

import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._custom_types import Array, ArrayLike, Float, Int
from ._interpolate import check_kernel, gaussian_weights, idw_weights, Kernel
from ._tree import KDTree
from ._validate import (
    as_float_array,
    check_finite,
    check_points_shape,
    check_queries_shape,
    check_radius,
    check_static_int,
    index_dtype_for,
    is_concrete,
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


def _rows_at(block: Array, indices: Int[Array, "*batch k"]) -> Array:
    """`block[indices]`, with some finite row where `indices` is the sentinel."""
    local_n = block.shape[0]
    if local_n == 0:
        return jnp.zeros((*indices.shape, *block.shape[1:]), block.dtype)
    return block[jnp.where(indices < local_n, indices, 0)]


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


class ShardedKDTree(eqx.Module):
    """Exact k-d tree queries over points sharded across the devices of a mesh.

    With `S` devices along `axis_name`, the first `S q` points (`q = n // S`) are split
    into `S` contiguous blocks of `q`, and each device builds a `kdeqx.KDTree` over its
    own block; the `n - S q < S` points left over go into one small tree that every
    device holds. No point is padded or duplicated, so every answer is exact: a query
    runs on every device against its local tree, local row numbers are mapped to the
    global numbering (block `s` starts at row `s q`), the `k` candidates per query of
    every device are all-gathered, and each device keeps the `k` best by
    `(distance, index)` out of the `S k + k` candidates. The result is the one a single
    `KDTree` over all points returns (distances sorted, ties by lower index, missing
    neighbours `(inf, n)`), and it is replicated over the mesh.

    **Memory per device:** the local tree over `q = n // S` points (the `(q, d)` points
    plus search arrays of about `2 max(q, leaf_size)` slots, a few times `q d` in all),
    plus the left-over tree of fewer than `S` points, plus the queries, which every
    device needs in full: `Q d`, and `S Q k` gathered candidates during a query.

    **Communication per query batch:** one all-gather of `Q k` (distance, index) pairs
    from each device (`(S - 1) Q k` pairs received per device); `interpolate` also
    carries each candidate's value row, `count_ball_point` is one all-reduce of `Q`
    counts. The queries themselves are broadcast to all devices if they are not
    already replicated. Building the trees moves each block of points to its device
    once and nothing between devices after that.

    Queries differentiate with respect to `x` and `values`, as with `KDTree`.
    """

    shards: KDTree | None
    leftover: KDTree
    mesh: Mesh = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        points: ArrayLike,
        mesh: Mesh,
        axis_name: str = "shards",
        *,
        box: None | float | ArrayLike = None,
        leaf_size: int = 32,
    ):
        """**Arguments:**

        - `points`: the data, shape `(n, d)`, finite; float32 and float64 are kept. A
            `jax.Array` already sharded over `axis_name` on its first axis (with `S`
            dividing `n`) is split without ever being gathered onto one device.
        - `mesh`: a `jax.sharding.Mesh`, for example `jax.make_mesh((S,), ("shards",))`.
            Other mesh axes (if any) hold copies of the same trees.
        - `axis_name`: the mesh axis to shard the points over; its size `S` is the
            number of trees.
        - `box`: periodic box lengths, as for `kdeqx.KDTree`.
        - `leaf_size`: points per leaf bucket, as for `kdeqx.KDTree`.
        """
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"`mesh` must be a `jax.sharding.Mesh`, got {type(mesh).__name__}."
            )
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"`axis_name` {axis_name!r} is not an axis of the mesh, whose axes are "
                f"{tuple(mesh.axis_names)}."
            )
        points = as_float_array("points", points)
        check_points_shape("points", points)
        _reject_nonfinite("points", points)
        if box is not None:
            _reject_nonfinite("box", as_float_array("box", box))
        self.shards, self.leftover = _build(
            points, box, mesh=mesh, axis_name=axis_name, leaf_size=leaf_size
        )
        self.mesh = mesh
        self.axis_name = axis_name

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
        """Number of points."""
        return self.num_shards * self.per_shard + self.leftover.n

    @property
    def d(self) -> int:
        """Dimension of the points."""
        return self.leftover.d

    def query(
        self,
        x: ArrayLike,
        k: int = 1,
        *,
        distance_upper_bound: float | ArrayLike = jnp.inf,
    ) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"]]:
        """Finds the `k` nearest points to each query, exactly as `KDTree.query`.

        **Arguments:**

        - `x`: queries, shape `(d,)` or `(..., d)`. Must be finite.
        - `k`: number of neighbours, a static Python int `>= 1`; `k > n` is allowed.
        - `distance_upper_bound`: only points at distance strictly less than this are
            returned (a scalar, or one value per query of shape `(...)`).

        **Returns:**

        `(distances, indices)`, each `(..., k)`, replicated over the mesh: sorted by
        distance, ties by lower index, indices in the numbering of `points`, missing
        neighbours `(inf, n)`.
        """
        k = check_static_int("k", k, 1)
        x = self._prepare_queries(x)
        bound = jnp.asarray(distance_upper_bound, x.dtype)
        bound = jnp.broadcast_to(bound, x.shape[:-1])
        distances, indices, _ = _nearest(self, x, bound, k, None)
        return distances, indices

    def count_ball_point(
        self, x: ArrayLike, r: float | ArrayLike
    ) -> Int[Array, "*batch"]:
        """Counts the points within distance `r` (inclusive) of each query.

        The sum of the local trees' counts (one all-reduce of `Q` integers).

        **Arguments:**

        - `x`: queries, shape `(d,)` or `(..., d)`.
        - `r`: radius, a scalar or one per query (shape `(...)`); finite and `>= 0`.

        **Returns:**

        Integer counts of shape `(...)`, replicated over the mesh.
        """
        x = self._prepare_queries(x)
        return _count(self, x, check_radius(r, x.shape[:-1], x.dtype))

    def interpolate(
        self,
        x: ArrayLike,
        values: ArrayLike,
        *,
        k: int = 8,
        power: float = 2.0,
        kernel: Kernel = "idw",
        length_scale: float | ArrayLike | None = None,
    ) -> Float[Array, "..."]:
        """Interpolates `values` at `x` from the `k` nearest points, as
        `KDTree.interpolate`.

        Each device looks up the value rows of its own candidates, which travel with
        them through the all-gather, so no device ever needs all of `values`.

        **Arguments:**

        - `x`: queries, shape `(d,)` or `(..., d)`.
        - `values`: the field at the points, shape `(n, ...)`, rows in the order of
            `points`. Must be finite.
        - `k`: neighbours per query (static Python int `>= 1`).
        - `power`: inverse-distance exponent (`kernel="idw"`), `> 0`.
        - `kernel`: `"idw"` (default) or `"gaussian"`.
        - `length_scale`: the Gaussian kernel's width, required for it, `> 0`.

        **Returns:**

        The weighted mean of the neighbours' values, shape `(..., *values.shape[1:])`,
        replicated over the mesh.
        """
        if self.n == 0:
            raise ValueError("Cannot interpolate from an empty tree (n = 0).")
        k = check_static_int("k", k, 1)
        check_kernel(kernel, power, length_scale)
        values = as_float_array("values", values)
        if values.ndim < 1 or values.shape[0] != self.n:
            raise ValueError(
                f"`values` must have one row per point, shape ({self.n}, ...), got "
                f"shape {tuple(values.shape)}."
            )
        _reject_nonfinite("values", values)
        x = self._prepare_queries(x)
        bound = jnp.full(x.shape[:-1], jnp.inf, x.dtype)
        distances, indices, rows = _nearest(self, x, bound, k, values)
        assert rows is not None
        found = indices < self.n
        if kernel == "idw":
            weights = idw_weights(distances, found, power)
        else:
            scale = _positive_length_scale(length_scale, distances.dtype)
            weights = gaussian_weights(distances, found, scale)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        feature_axes = (None,) * (values.ndim - 1)
        field = jnp.sum(weights[(..., *feature_axes)] * rows, axis=weights.ndim - 1)
        if is_concrete(values):
            return field
        # On the (small, replicated) result: `eqx.error_if` on `values` itself would
        # gather all of them onto every device.
        all_finite = jnp.all(jnp.isfinite(values))
        return eqx.error_if(field, ~all_finite, "`values` must be finite (no NaN/inf).")

    def _prepare_queries(self, x: ArrayLike) -> Float[Array, "*batch d"]:
        x = as_float_array("x", x, dtype=self.leftover.points.dtype)
        check_queries_shape("x", x, self.d)
        _reject_nonfinite("x", x)
        return x


def _reject_nonfinite(name: str, array: Array) -> None:
    """Raises `ValueError` if a concrete `array` holds NaN or inf.

    The test is reduced where the array lives, so a sharded array is not copied to
    the host (and one spread over several hosts still works). Traced arrays are checked
    at run time by each device's own tree, on its own block of points and the queries.
    """
    if is_concrete(array) and not bool(jnp.all(jnp.isfinite(array))):
        check_finite(name, array)  # raises, naming the first bad entry


def _positive_length_scale(length_scale, dtype) -> Float[Array, ""]:
    scale = jnp.asarray(length_scale, dtype)
    if is_concrete(scale):
        if not scale > 0:
            raise ValueError(f"`length_scale` must be > 0, got {scale}.")
        return scale
    return eqx.error_if(scale, scale <= 0, "`length_scale` must be > 0.")


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
    box,
    *,
    mesh: Mesh,
    axis_name: str,
    leaf_size: int,
) -> tuple[KDTree | None, KDTree]:
    """The batch of local trees (sharded; `None` if `q = 0`) and the left-over tree
    (replicated)."""
    blocks, rest = _split_rows(points, mesh.shape[axis_name])
    replicate = ft.partial(jax.device_put, device=NamedSharding(mesh, PartitionSpec()))
    leftover = replicate(KDTree(replicate(rest), box=box, leaf_size=leaf_size))
    if blocks.shape[1] == 0:
        return None, leftover

    def build_on_device(block, box):
        local = KDTree(block[0], box=box, leaf_size=leaf_size)
        return jax.tree.map(lambda a: a[None], local)

    sharded, replicated = PartitionSpec(axis_name), PartitionSpec()
    shards = _on_mesh(build_on_device, mesh, (sharded, replicated), sharded)(
        blocks, box
    )
    return shards, leftover


@eqx.filter_jit
def _nearest(
    tree: ShardedKDTree,
    x: Float[Array, "*batch d"],
    bound: Float[Array, "*batch"],
    k: int,
    values: Float[Array, "n ..."] | None,
) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"], Array | None]:
    """The exact `k` nearest of all points, and their rows of `values` if given."""
    n, per_shard = tree.n, tree.per_shard
    leftover_start = tree.num_shards * per_shard
    index_dtype = index_dtype_for(n)
    batch_ndim = x.ndim - 1
    if values is None:
        value_blocks = value_rest = None
    else:
        value_blocks, value_rest = _split_rows(values, tree.num_shards)

    def on_device(shards, leftover, x, bound, value_blocks, value_rest):
        distances, indices, rows = [], [], []
        if shards is not None:
            local = _local_tree(shards)
            d_local, i_local = local.query(x, k, distance_upper_bound=bound)
            # In the global index dtype: `s q` may not fit in 32 bits.
            offset = lax.axis_index(tree.axis_name).astype(index_dtype) * per_shard
            candidates = (
                d_local,
                _to_global(i_local, per_shard, offset, n, index_dtype),
                None if value_blocks is None else _rows_at(value_blocks[0], i_local),
            )
            gathered = lax.all_gather(candidates, tree.axis_name)
            gathered = jax.tree.map(lambda a: _candidates_last(a, batch_ndim), gathered)
            distances.append(gathered[0])
            indices.append(gathered[1])
            rows.append(gathered[2])
        if leftover.n > 0:
            d_rest, i_rest = leftover.query(x, k, distance_upper_bound=bound)
            distances.append(d_rest)
            indices.append(
                _to_global(i_rest, leftover.n, leftover_start, n, index_dtype)
            )
            rows.append(None if value_rest is None else _rows_at(value_rest, i_rest))
        if not distances:  # n = 0: only sentinels
            missing = jnp.full((*x.shape[:-1], k), jnp.inf, x.dtype)
            return missing, jnp.full(missing.shape, n, index_dtype), None
        return _k_best(
            jnp.concatenate(distances, axis=-1),
            jnp.concatenate(indices, axis=-1),
            None if value_blocks is None else jnp.concatenate(rows, axis=batch_ndim),
            k,
        )

    sharded, replicated = PartitionSpec(tree.axis_name), PartitionSpec()
    in_specs = (sharded, replicated, replicated, replicated, sharded, replicated)
    return _on_mesh(on_device, tree.mesh, in_specs, replicated)(
        tree.shards, tree.leftover, x, bound, value_blocks, value_rest
    )


@eqx.filter_jit
def _count(
    tree: ShardedKDTree,
    x: Float[Array, "*batch d"],
    r: Float[Array, "*batch"] | Float[Array, ""],
) -> Int[Array, "*batch"]:
    """The sum of every tree's count."""
    index_dtype = index_dtype_for(tree.n)

    def on_device(shards, leftover, x, r):
        counts = jnp.zeros(x.shape[:-1], index_dtype)
        if shards is not None:
            local = _local_tree(shards).count_ball_point(x, r).astype(index_dtype)
            counts = counts + lax.psum(local, tree.axis_name)
        if leftover.n > 0:
            counts = counts + leftover.count_ball_point(x, r).astype(index_dtype)
        return counts

    sharded, replicated = PartitionSpec(tree.axis_name), PartitionSpec()
    in_specs = (sharded, replicated, replicated, replicated)
    return _on_mesh(on_device, tree.mesh, in_specs, replicated)(
        tree.shards, tree.leftover, x, r
    )
