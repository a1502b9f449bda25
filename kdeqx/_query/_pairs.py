"""Queries between two sets of points: the pairs within a distance, in one shared
fixed-capacity output, and pair counts for many radii in `O(radii)` memory.

Both walk a tree once per query point with the lanes of `kdeqx._traverse.walk_many`:
a pair search appends every pair it finds to a `Sink` (so its memory is the capacity
the caller asks for, however the pairs spread over the queries), and a pair count
sums its queries' counts as the lanes finish (so nothing grows with the queries).
A tree's pairs with itself (`self_pairs`) are walked once per leaf instead, each
leaf a `Block` query, with the pairs carried as bitmasks.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from .._backend import axes_at, sort_index_pairs
from .._backend._mesh import split_sum_over_cpu_devices
from .._custom_types import Array, Bool, Float, Int
from .._engine._base import AbstractSearchTree
from .._engine._bits import bitmasks, laid_out, nth_set_bit, set_bit_count, WORD
from .._engine._blocks import emit_blocks, walk_blocks
from .._engine._metric import Block, minimum_image, Minkowski, wrap_into_box
from .._engine._search import (
    far_queries,
    FarQueries,
    measured_distances,
    neighbour_distances,
    rows_at,
    search_threshold,
)
from .._engine._traverse import AbstractEmitter, AbstractVisitor, Sink, walk_many
from .._validate import index_dtype_for


class Pairs(eqx.Module):
    """Pairs `(rows[e], cols[e])` of a query row and a tree row within a distance,
    sorted by row then column, in a fixed capacity.

    Entries past the pairs found are `(rows, cols) = (m, n)` (the sizes of the two
    sets) at distance `inf`. `count` is the true number of pairs, which may exceed the
    capacity (saturating at the largest value of its dtype).
    """

    rows: Int[Array, " capacity"]
    cols: Int[Array, " capacity"]
    distances: Float[Array, " capacity"]
    count: Int[Array, ""]


class _WithinRadius(AbstractEmitter):
    """Emits a record `(row, index)` for each point within `r` of one query (row
    `row`). With `above`, only points whose index plus `offset` exceeds `row`: the
    pairs `i < j` of a set with itself. The walk's state is unused: the sink counts."""

    r2: Float[Array, ""]
    accept2: Float[Array, ""]
    row: Int[Array, ""]
    offset: Int[Array, ""]
    above: bool = eqx.field(static=True)

    def leaf_records(self, d2, indices, leaf):
        inside = d2 <= self.accept2
        indices = indices.astype(self.row.dtype)
        if self.above:
            inside = inside & (indices + self.offset > self.row)
        return inside, (jnp.broadcast_to(self.row, indices.shape), indices), None


def no_pairs(m: int, n: int, capacity: int, dtype, index_dtype) -> Pairs:
    return Pairs(
        jnp.full(capacity, m, index_dtype),
        jnp.full(capacity, n, index_dtype),
        jnp.full(capacity, jnp.inf, dtype),
        jnp.zeros((), index_dtype),
    )


@eqx.filter_jit
def pairs_within(
    tree: AbstractSearchTree,
    x: Float[Array, "m d"],
    r: Float[Array, ""],
    capacity: int,
    metric: Minkowski,
    above: bool,
    offset: Int[Array, ""] | int = 0,
) -> Pairs:
    """The pairs `(i, j)` with `|x[i] - points[j]| <= r`, sorted (`Pairs`); with
    `above`, only those with `j + offset > i`. Distances are differentiable."""
    m, n = x.shape[0], tree.n
    index_dtype = index_dtype_for(max(m, n) + 1)
    if m == 0 or n == 0:
        return no_pairs(m, n, capacity, x.dtype, index_dtype)
    far = far_queries(tree, x, metric)
    # A far query beyond `r` of the whole tree pairs with nothing; the walk, which
    # answers it from nearer (see `FarQueries`), must then find nothing: radius -1.
    r2 = search_threshold(tree, r, metric)
    r2 = jnp.where(far.beyond(far.distance <= r), -1, r2)
    rows, cols, count = _sorted_records(
        tree,
        x,
        r2,
        jnp.arange(m, dtype=index_dtype),
        jnp.asarray(offset, index_dtype),
        capacity,
        metric,
        above,
        m,
    )
    return pair_distances(tree, x, rows, cols, count, metric)


def _sorted_records(tree, x, r2, rows, offset, capacity, metric, above, m: int):
    """The pairs, sorted: `(rows, cols, count)`, padded with `(m, n)`.

    On one device: split over the CPU devices in blocks of rows (each device's sorted
    pairs below the next's, all-gathered and concatenated inside `shard_map`), the
    search gained nothing with a core per device and lost on a shared core; the walk
    is not where the time goes (see `benchmarks/scipy_api.py`).
    """
    visitors = jax.vmap(
        lambda r2, row: _WithinRadius(r2, metric.accepts_within(r2), row, offset, above)
    )(r2, rows)
    empty = no_pairs(m, tree.n, capacity, x.dtype, rows.dtype)
    sink = Sink((empty.rows, empty.cols), empty.count)
    if tree.engine == "blocks":
        filled = emit_blocks(tree, x, visitors, metric, sink)
    else:
        _, filled = walk_many(tree, x, visitors, metric, sink=sink)
    assert filled is not None
    return *sort_index_pairs(*filled.records), filled.written


class _LeafPairs(AbstractEmitter):
    """The pairs of a tree with itself, from one of its leaves (number `leaf`)
    walked as a `Block`. With node keys that are each subtree's last leaf, it visits
    only leaves from its own on, and within its own only the slots after each
    point's: every pair once.

    For each of its points and each leaf visited, it emits one record: the point's
    slot, the leaf, and the leaf's slots within `r` as a bitmask (32-bit words),
    standing for as many pairs as bits set. A record is emitted only if it holds a
    pair, so `capacity` records hold at least `capacity` pairs.
    """

    r2: Float[Array, ""]
    accept2: Float[Array, ""]
    leaf: Int[Array, ""]

    def should_visit(self, state, box_d2, last_leaf) -> Bool[Array, ""]:
        return (box_d2 <= self.r2) & (last_leaf >= self.leaf)

    def leaf_records(self, d2, indices, leaf):
        size = d2.shape[0]
        slot = jnp.arange(size)
        # Slot b of the leaf lies after slot a of this one: one comparison.
        later = slot - slot[:, None] > (self.leaf - leaf) * size
        masks = bitmasks((d2 <= self.accept2) & later)
        found = jnp.sum(set_bit_count(masks), axis=1, dtype=jnp.int32)
        rows = (self.leaf * size + slot).astype(indices.dtype)
        leaves = jnp.broadcast_to(leaf.astype(indices.dtype), rows.shape)
        return found > 0, (rows, leaves, masks), found


def unpacked(slots, leaves, masks, capacity: int, leaf_size: int):
    """The first `capacity` pairs of slots `(a, b)` that records `(a, leaf, masks)`
    stand for, in the records' order: `(record, a, b, found)`, each pair's record
    and which of the outputs are pairs. The records that hold pairs come first (the
    sink's)."""
    word_counts = set_bit_count(masks)
    counts = jnp.sum(word_counts, axis=1)
    record, rank = laid_out(counts, capacity)
    # Within the record, the word that holds the pair, then the bit.
    word_counts = word_counts[record]
    word = jnp.zeros_like(rank)
    for w in range(masks.shape[1] - 1):
        skip = (word == w) & (rank >= word_counts[:, w])
        rank = jnp.where(skip, rank - word_counts[:, w], rank)
        word = jnp.where(skip, w + 1, word)
    bit = nth_set_bit(masks[record, word], rank)
    a = slots[record]
    b = leaves[record] * leaf_size + (word * WORD + bit).astype(leaves.dtype)
    return record, a, b, jnp.arange(capacity) < jnp.sum(counts)


def _last_leaves(tree: AbstractSearchTree) -> Int[Array, " nodes"]:
    """Per node (heap order), the number of the last leaf below it: right children
    all the way down, `(i + 2) * 2**levels - 2` for a node `levels` above the
    leaves."""
    num_leaves = tree.num_leaves
    depth = num_leaves.bit_length() - 1
    node = jnp.arange(2 * num_leaves - 1, dtype=jnp.int32)
    level = 31 - lax.clz(node + 1)  # floor(log2(node + 1))
    last = ((node + 2) << (depth - level)) - 2
    return (last - (num_leaves - 1)).astype(tree.leaf_indices.dtype)


@eqx.filter_jit
def self_pairs(
    tree: AbstractSearchTree,
    r: Float[Array, ""],
    capacity: int,
    metric: Minkowski,
    sort: bool = True,
) -> Pairs:
    """The pairs `i < j` of the tree's points within `r`, sorted unless `sort` is
    False (then in the walk's order, padding last) (`Pairs`).

    Each leaf walks the tree as one query (a `Block`, bounded box to box), so the
    walk and its pruning are paid per leaf rather than per point, and a visit
    measures a whole leaf against a whole leaf. The pairs travel as bitmasks.
    """
    n = tree.n
    index_dtype = index_dtype_for(n + 1)
    if n < 2:
        return no_pairs(n, n, capacity, tree.dtype, index_dtype)
    rows, cols, count = _pairs_in_order_met(tree, r, capacity, metric)
    if sort:
        rows, cols = sort_index_pairs(rows, cols)
    return Pairs(rows, cols, _distances_within(tree, rows, cols, metric), count)


@eqx.filter_jit
def self_matrix(
    tree: AbstractSearchTree, r: Float[Array, ""], capacity: int, metric: Minkowski
) -> Pairs:
    """Every pair `(i, j)` of the tree's points within `r`, both ways and `i = j`
    included (the sparse distance matrix of the tree with itself), sorted: the pairs
    `i < j` of `self_pairs`' walk, mirrored, and the diagonal."""
    n = tree.n
    index_dtype = index_dtype_for(n + 1)
    if n == 0:
        return no_pairs(n, n, capacity, tree.dtype, index_dtype)
    # `2 * half + n >= capacity` entries fill it; more pairs overflow it anyway.
    half = max(1, (capacity - n + 1) // 2)
    if n < 2:
        rows = cols = jnp.full(half, n, index_dtype)
        count = jnp.zeros((), index_dtype)
    else:
        rows, cols, count = _pairs_in_order_met(tree, r, half, metric)
    diagonal = jnp.arange(n, dtype=index_dtype)
    rows, cols = (
        jnp.concatenate([rows, cols, diagonal]),
        jnp.concatenate([cols, rows, diagonal]),
    )
    rows, cols = (a[:capacity] for a in sort_index_pairs(rows, cols))
    most = jnp.iinfo(index_dtype).max
    count = jnp.minimum(count, (most - n) // 2) * 2 + n
    return Pairs(rows, cols, _distances_within(tree, rows, cols, metric), count)


def _pairs_in_order_met(tree: AbstractSearchTree, r, capacity: int, metric: Minkowski):
    """The first `capacity` pairs `(i, j)`, `i < j`, that the leaf-by-leaf walk
    meets, unsorted (sorted on the block engine), padded with `(n, n)`, and how
    many pairs there are (`n >= 2`)."""
    n, size = tree.n, tree.leaf_size
    index_dtype = index_dtype_for(n + 1)
    searched = lax.stop_gradient(tree)
    if tree.engine == "blocks":
        # The block engine searches points, not leaves: each point is a query,
        # keeping the points after its own (sorted already).
        r2 = jnp.broadcast_to(search_threshold(tree, r, metric), (n,))
        rows = jnp.arange(n, dtype=index_dtype)
        zero = jnp.zeros((), index_dtype)
        return _sorted_records(
            searched, searched.points, r2, rows, zero, capacity, metric, True, n
        )
    leaf_count = tree.num_leaves
    # Padding slots at infinity: they pair with nothing (their distances are inf or
    # NaN, never within r).
    padding = (searched.leaf_indices == n)[:, None]
    points = jnp.where(padding, jnp.inf, searched.leaf_points)
    blocks = Block(points.reshape(leaf_count, size, -1), *searched._leaf_boxes())
    r2 = search_threshold(tree, r, metric)
    leaves = jnp.arange(leaf_count, dtype=tree.leaf_indices.dtype)
    accept2 = metric.accepts_within(r2)
    visitors = jax.vmap(lambda leaf: _LeafPairs(r2, accept2, leaf))(leaves)
    words = -(-size // WORD)
    slot_dtype = tree.leaf_indices.dtype
    sink = Sink(
        (
            jnp.zeros(capacity, slot_dtype),
            jnp.zeros(capacity, slot_dtype),
            jnp.zeros((capacity, words), jnp.uint32),
        ),
        jnp.zeros((), index_dtype),
    )
    _, filled = walk_many(
        tree, blocks, visitors, metric, sink=sink, node_keys=_last_leaves(tree)
    )
    assert filled is not None
    slots, leaves, masks = filled.records
    _, a, b, found = unpacked(slots, leaves, masks, capacity, size)
    i, j = rows_at(searched.leaf_indices, a), rows_at(searched.leaf_indices, b)
    rows = jnp.where(found, jnp.minimum(i, j), n).astype(index_dtype)
    cols = jnp.where(found, jnp.maximum(i, j), n).astype(index_dtype)
    return rows, cols, filled.written


def _distances_within(tree: AbstractSearchTree, rows, cols, metric: Minkowski):
    """The distances between points `rows` and `cols` of the tree (`inf` at the
    sentinel `n`), measured axis by axis in the search coordinates, where they
    cannot overflow, and differentiable as `neighbour_distances`."""
    searched = lax.stop_gradient(tree)
    scale, period = searched.scale, searched.period
    coords = wrap_into_box(searched.points, period) * scale
    diffs = [
        a - b for a, b in zip(axes_at(coords, rows), axes_at(coords, cols), strict=True)
    ]
    if period is not None:
        diffs = [
            minimum_image(diff, length * scale) for diff, length in zip(diffs, period)
        ]
    measured = metric.from_power(metric.powered_of_axes(diffs)) / scale
    measured = jnp.where(cols < tree.n, measured, jnp.inf)
    x = rows_at(tree.points, rows)
    return measured_distances(tree, x, cols[:, None], measured[:, None], metric.p)[:, 0]


def pair_distances(tree, x, rows, cols, count, metric: Minkowski) -> Pairs:
    """`Pairs` with the distances of `x[rows]` to `points[cols]`, measured from the
    coordinates (differentiable; `inf` at padding)."""
    distances = neighbour_distances(tree, rows_at(x, rows), cols[:, None], metric.p)
    return Pairs(rows, cols, distances[:, 0], count)


class _CountsWithin(AbstractVisitor):
    """For one query, the (weighted) number of points within each of the radii,
    given as powered distances, ascending. Unweighted int32 counts carry a float32
    copy that shows when their sum over many queries would overflow."""

    radii2: Float[Array, " radii"]
    weights: Float[Array, " n"] | None
    count_dtype: jnp.dtype = eqx.field(static=True)

    def init(self) -> tuple[Array, Array]:
        counts = jnp.zeros(self.radii2.shape, self.count_dtype)
        return counts, jnp.zeros(self.radii2.shape, jnp.float32)

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        return box_d2 <= self.radii2[-1]

    def reach(self, state) -> Float[Array, ""]:
        return self.radii2[-1]

    def visit_leaf(self, state, d2, indices) -> tuple[Array, Array]:
        counts, estimate = state
        inside = d2[:, None] <= self.radii2
        if self.weights is not None:
            weights = rows_at(self.weights, indices)[:, None]
            return counts + jnp.sum(jnp.where(inside, weights, 0), axis=0), estimate
        found = jnp.sum(inside, axis=0, dtype=self.count_dtype)
        if self.count_dtype != jnp.int32:  # int64 sums cannot wrap: no estimate
            return counts + found, estimate
        return counts + found, estimate + found.astype(jnp.float32)


def integer_count_dtype():
    """int64 where enabled, else int32."""
    return jnp.dtype(jnp.int64 if jax.config.read("jax_enable_x64") else jnp.int32)


# int32 sums of counts beyond this (checked in float32, to a relative 1e-7 per
# addition) may have wrapped.
_INT32_SAFE_TOTAL = 2.0e9


@eqx.filter_jit
def counts_within(
    tree: AbstractSearchTree,
    x: Float[Array, "m d"],
    radii: Float[Array, " radii"],
    metric: Minkowski,
    x_weights: Float[Array, " m"] | None,
    weights: Float[Array, " n"] | None,
) -> Array:
    """`sum_i x_weights[i] sum_j weights[j] [|x[i] - points[j]| <= radii[k]]` for
    each `k` (weights 1 where not given), radii ascending.

    Unweighted counts are integers: int64 with x64 enabled; int32 otherwise, with a
    runtime error where a count exceeds 2e9 (it could have wrapped).
    """
    weighted = x_weights is not None or weights is not None
    count_dtype = x.dtype if weighted else integer_count_dtype()
    if x.shape[0] == 0 or tree.n == 0:
        return jnp.zeros(radii.shape, count_dtype)
    if weighted:
        x_weights = jnp.ones(x.shape[0], x.dtype) if x_weights is None else x_weights
        weights = jnp.ones(tree.n, x.dtype) if weights is None else weights
    far = far_queries(tree, x, metric)
    # The walk answers far queries from nearer: they are counted apart, below.
    near_weights = jnp.where(far.far, 0, 1 if x_weights is None else x_weights)
    visitor = _CountsWithin(search_threshold(tree, radii, metric), weights, count_dtype)
    counts, estimate = _summed_walk(tree, x, near_weights, visitor, metric)
    far_counts = _far_counts(far, radii, x_weights, weights, tree.n, count_dtype)
    counts, estimate = counts + far_counts, estimate + far_counts.astype(jnp.float32)
    if count_dtype == jnp.int32:
        counts = eqx.error_if(
            counts,
            jnp.any(estimate > _INT32_SAFE_TOTAL),
            "count_neighbors: a count exceeds what int32 holds safely (2e9); enable "
            "x64 (`jax.config.update('jax_enable_x64', True)`) for int64 counts.",
        )
    return counts


@split_sum_over_cpu_devices
def _summed_walk(tree, x, row_weights, visitor, metric):
    """The visitor's final states over all queries, each weighted, summed."""
    if tree.engine == "blocks":  # the states of every query, then their sum
        states, _ = walk_blocks(tree, x, visitor, metric, None)
        return jax.tree.map(lambda s: _weighted_sum(s, row_weights), states)
    states, _ = walk_many(
        tree, x, visitor, metric, None, summed=True, query_weights=row_weights
    )
    return states


def _weighted_sum(states: Array, weights: Array) -> Array:
    weights = weights.astype(states.dtype).reshape(-1, *(1,) * (states.ndim - 1))
    return jnp.sum(states * weights, axis=0, dtype=states.dtype)


def _far_counts(far: FarQueries, radii, x_weights, weights, n: int, count_dtype):
    """The counts of the far queries, from each of whom every point lies at
    `far.distance`: for each radius, the weight of the far queries within it times
    the weight of all the points (one radius at a time: `O(m)` memory)."""
    if x_weights is None:
        x_weights = jnp.ones(far.far.shape, count_dtype)
    total = n if weights is None else jnp.sum(weights)

    def within(radius):
        inside = far.far & (far.distance <= radius)
        return jnp.sum(jnp.where(inside, x_weights, 0), dtype=count_dtype)

    return lax.map(within, radii) * jnp.asarray(total, count_dtype)
