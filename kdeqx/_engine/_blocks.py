"""The block engine: queries taken in blocks, leaves measured as dense tiles.

The walk (`_traverse.py`) moves each query on its own, one node per step, which suits
a CPU. A vector machine pays for every sequential step and every scalar-indexed
gather, so this engine does the same search as a few large array operations:

1. The queries are ordered along a Morton curve (on a TPU by radix passes over the
   codes' top bits: it compiles a long sort for many seconds) and cut into blocks of
   consecutive queries (`kdeqx._backend.query_block_size`), each bounded by its
   bounding box.
2. For a visitor whose reach narrows as it sees points (the k nearest), a first pass
   shows each query the points of a few leaves around the one it descends to
   (`AbstractVisitor.first_points`): its state then bounds how far a point may be
   and still count (`AbstractVisitor.reach`). Other visitors reach a fixed distance
   (a radius).
3. A second pass goes down the tree level by level with each block's frontier of at
   most `budget` nodes, keeping every node whose box lies within the block's reach
   (the farthest of its queries'), nearest first (`kdeqx._backend.smallest_first_of`),
   but for the leaves of the first pass, whose points the states hold already.
4. The kept leaves are folded into the queries' states a chunk at a time, nearest
   first, as `(block, chunk points)` tiles of powered distances, until a chunk's
   nearest box lies beyond every reach in its block.

Every step is exact: boxes bound their points' distances from below, and a reach
bounds from above. A block whose frontier outgrows the budget is not cut short: it
takes every leaf of the tree, chunk by chunk, pruned by box distance (slow, never
wrong). The number of sequential steps depends on the tree's depth and on the chunks
a block needs, not on the number of queries.
"""

import functools as ft
import typing

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from .._backend import (
    gather_clamped,
    query_block_shape,
    radix_order,
    redone_in_groups,
    scatters_element_by_element,
    smallest_first_of,
    sorts_compile_slowly,
)
from .._custom_types import Array, Bool, Float, Int, PyTree, UInt
from ._base import AbstractSearchTree
from ._metric import minimum_image, Minkowski
from ._traverse import _Steps, AbstractVisitor, morton_bits, morton_codes, Sink


_State = PyTree


def walk_blocks(
    tree: AbstractSearchTree,
    x: Float[Array, "q d"],
    visitors: AbstractVisitor,
    metric: Minkowski,
    visitor_axis: int | None = 0,
    count: bool = False,
) -> tuple[_State, Bool[Array, ""] | Int[Array, ""]]:
    """`walk_many(tree, x, visitors, metric, visitor_axis)` by blocks: the same final
    states, from dense tiles.

    **Returns:** `(states, overflowed)`: the visitors' final states in the order of
    `x`, and whether some block's frontier outgrew the budget (its answers are exact
    all the same; the flag, or with `count=True` the number of such blocks, is for
    benchmarks and tests).
    """
    states, _, overflowed = _walk_blocks(tree, x, visitors, metric, visitor_axis, count)
    return states, overflowed


def emit_blocks(
    tree: AbstractSearchTree,
    x: Float[Array, "q d"],
    visitors: AbstractVisitor,
    metric: Minkowski,
    sink: Sink,
) -> Sink:
    """`walk_many(tree, x, visitors, metric, sink=sink)[1]` by blocks, for visitors
    (one per query) whose records do not depend on the leaf they come from: the
    same records appended, in another order. A block emits only once its search is
    complete, so no record is appended twice."""
    _, emitted, _ = _walk_blocks(tree, x, visitors, metric, 0, False, sink)
    assert emitted is not None
    return emitted


def _walk_blocks(tree, x, visitors, metric, visitor_axis, count, sink=None):
    """[`walk_blocks`][] and [`emit_blocks`][] in one: `(states, sink, flag)`."""
    steps = _Steps(tree, metric)
    q = x.shape[0]
    index_dtype = tree.leaf_indices.dtype
    shape = query_block_shape(tree.leaf_size)
    size = shape.block_size

    points = typing.cast(Array, jax.vmap(steps.search_point)(x))
    codes = morton_codes(points, steps.tree.node_lo[:, 0], steps.tree.node_hi[:, 0])
    order = curve_order(codes, morton_bits(x.shape[1]), index_dtype)
    blocks = -(-q // size)
    # Padding queries repeat the last query along the curve: they widen no box.
    rows = jnp.concatenate([order, jnp.full(blocks * size - q, order[-1])])
    rows = rows.reshape(blocks, size)
    xb = gather_clamped(points, rows)  # (blocks, size, d)
    vb = visitors if visitor_axis is None else _rows(visitors, rows)
    init = _states_at_init(vb, visitor_axis, (blocks, size))
    reach = jax.vmap(jax.vmap(_reach, (visitor_axis, 0)), (visitor_axis, 0))
    # The padding queries repeat a real one: they must not emit its records again.
    flat = blocks * size
    real = (jnp.arange(flat) < q).reshape(blocks, size)

    def search(xb, vb, init, real, sink):
        """`(states, overflowed, sink)` of the blocks `xb`."""
        flat = xb.shape[0] * size
        first_points = visitors.first_points()
        start, seen = init, None
        if first_points > 0:
            leaves = max(shape.nearest_leaves, -(-first_points // tree.leaf_size))
            tiles = _Tiles(steps, xb)
            nearest, first = _first_states(steps, tiles, vb, visitor_axis, init, leaves)
            own_reach = reach(vb, first)
            if sink is None:
                # The stage goes on from the first pass, without its leaves.
                start, seen = first, nearest
        else:
            own_reach = reach(vb, init)
        states, overflowed, sink = _stage(
            steps,
            xb,
            vb,
            visitor_axis,
            start,
            own_reach,
            shape.budget,
            shape.chunk,
            exhaustive=False,
            sink=sink,
            real=real,
            seen=seen,
        )
        # The queries of blocks that overflowed again, each a block of its own,
        # within its own reach: a curve's jump can make a block wide.
        states, sink = _alone(
            steps,
            xb.reshape(flat, 1, -1),
            _flat(vb, visitor_axis),
            visitor_axis,
            _flat(init, 0),
            own_reach.reshape(flat, 1),
            _flat(states, 0),
            jnp.repeat(overflowed, size) & real.reshape(flat),
            shape,
            sink,
        )
        return states, overflowed, sink

    at_once = max(1, QUERIES_AT_ONCE // size)
    if blocks <= at_once:
        states, overflowed, sink = search(xb, vb, init, real, sink)
    else:
        # A group of blocks at a time, so that the temporaries stay bounded.
        groups = -(-blocks // at_once)
        per = -(-blocks // groups)
        grouped = ft.partial(_in_groups, groups=groups, per=per)
        per_query = None if visitor_axis is None else grouped(vb)

        def one_group(sink, group):
            xg, vg, ig, rg = group
            states, overflowed, sink = search(
                xg, vb if vg is None else vg, ig, rg, sink
            )
            return sink, (states, overflowed)

        # The padding blocks repeat the last one: they must not emit its records.
        padded = jnp.zeros((groups * per - blocks, size), bool)
        real = jnp.concatenate([real, padded]).reshape(groups, per, size)
        sink, (states, overflowed) = lax.scan(
            one_group, sink, (grouped(xb), per_query, grouped(init), real)
        )
        # Each group's states are one per query (`_alone`'s), `(per * size, 1, ...)`.
        states = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:flat], states)
        overflowed = overflowed.reshape(-1)[:blocks]

    flag = jnp.sum(overflowed) if count else jnp.any(overflowed)
    return _in_input_order(states, order, flat), sink, flag


def _in_input_order(states: PyTree, order: Int[Array, " q"], flat: int) -> PyTree:
    """States `(blocks, size, ...)`, rows along the curve `order` (then padding), as
    states `(q, ...)` in the queries' order.

    A TPU scatters element by element, so there the rows are gathered through the
    inverse permutation instead (one scatter of `q` positions), as rows are gathered
    elsewhere in this engine."""
    q = order.shape[0]

    def rows(s):
        return s.reshape(flat, *s.shape[2:])

    if not scatters_element_by_element():

        def scattered(s):
            s = rows(s)[:q]
            return jnp.zeros_like(s).at[order].set(s, unique_indices=True)

        return jax.tree.map(scattered, states)
    positions = jnp.arange(q, dtype=order.dtype)
    inverse = jnp.zeros_like(order).at[order].set(positions, unique_indices=True)
    return jax.tree.map(lambda s: gather_clamped(rows(s), inverse), states)


# The block engine searches at most this many queries at once (a group of blocks
# at a time beyond it), which bounds its temporaries: see `benchmarks/large.py`,
# the seed's size on an accelerator.
QUERIES_AT_ONCE = 1 << 17


def _in_groups(tree: PyTree, groups: int, per: int) -> PyTree:
    """Arrays of blocks `(blocks, ...)` as `(groups, per, ...)`, the last group
    padded with copies of the last block."""

    def split(a):
        pad = jnp.repeat(a[-1:], groups * per - a.shape[0], axis=0)
        return jnp.concatenate([a, pad]).reshape(groups, per, *a.shape[1:])

    return jax.tree.map(split, tree)


def curve_order(
    codes: UInt[Array, " q"], bits: int, index_dtype, backend: str | None = None
) -> Int[Array, " q"]:
    """A permutation that orders Morton codes of `bits` bits, stably: on a TPU by
    their top `CURVE_BITS` bits (`radix_order`), elsewhere by one sort of the whole
    codes (fast to compile and run there). `backend` defaults to
    `jax.default_backend()`."""
    if not sorts_compile_slowly(backend):
        positions = jnp.arange(codes.shape[0], dtype=index_dtype)
        return lax.sort((codes, positions), num_keys=1)[1]
    return radix_order(codes >> max(0, bits - CURVE_BITS), CURVE_BITS, index_dtype)


# Queries are ordered by the top `CURVE_BITS` bits of their Morton codes (cells of
# about `2**(-CURVE_BITS / d)` of the tree's extent).
CURVE_BITS = 16


def _flat(tree: PyTree, axis: int | None) -> PyTree:
    """Blocks of queries `(blocks, size, ...)` as blocks of one `(blocks * size, 1,
    ...)` (a shared visitor, `axis=None`, as it is)."""
    if axis is None:
        return tree
    return jax.tree.map(lambda a: a.reshape(-1, 1, *a.shape[2:]), tree)


def _alone(steps, x, visitors, visitor_axis, init, reach, states, redo, shape, sink):
    """`states` with those where `redo` is set replaced by a search of each such
    query alone (blocks of one), a group of them at a time; and the `sink` (or
    `None`) with their records appended."""
    group = max(1, x.shape[0] // ALONE_FRACTION)
    budget, chunk = (
        ALONE_BUDGET_FACTOR * shape.budget,
        ALONE_BUDGET_FACTOR * shape.chunk,
    )

    def search_alone(rows, valid, sink):
        found, _, sink = _stage(
            steps,
            gather_clamped(x, rows),
            visitors if visitor_axis is None else _rows(visitors, rows),
            visitor_axis,
            _rows(init, rows),
            jnp.where(valid[:, None], gather_clamped(reach, rows), -jnp.inf),
            budget,
            chunk,
            exhaustive=True,
            sink=sink,
            real=valid[:, None],
        )
        return found, sink

    return redone_in_groups(redo, group, search_alone, states, sink)


# Queries of blocks that overflowed are searched alone, `1 / ALONE_FRACTION` of all
# queries at a time, with `ALONE_BUDGET_FACTOR` times the budget and chunk.
ALONE_FRACTION = 64
ALONE_BUDGET_FACTOR = 4


def _stage(
    steps,
    xb,
    vb,
    visitor_axis,
    init,
    own_reach,
    budget: int,
    chunk: int,
    exhaustive: bool,
    sink: Sink | None = None,
    real: Bool[Array, "blocks size"] | None = None,
    seen: Int[Array, "blocks m"] | None = None,
):
    """The states of blocks of queries `xb`, from `init`, after every leaf within
    each block's reach (the largest of its queries' `own_reach`, narrowing as the
    states do) is folded in, `chunk` leaves at a time; and which blocks' frontiers
    outgrew `budget`.

    A block that outgrows the budget folds in the `budget` nearest leaves within
    its reach. If its reach narrows as it sees points (the k nearest), those bound
    it anew, and it starts again from `init` within the new reach, up to
    `NARROWING_ROUNDS` times. A block that still outgrows the budget takes every
    leaf, pruned by box, if `exhaustive`; if not, its states are incomplete and it
    stays flagged (the caller searches it again).

    With a `sink`, the records of the `real` queries of each block whose search
    completes are appended to it (an incomplete one emits nothing: its queries are
    searched again). With `seen`, each block's leaves whose points `init` holds
    already (`-1`: none), those are left out. **Returns:** `(states, overflowed,
    sink)`.
    """
    # Taking every leaf would fold the seen ones again.
    assert seen is None or not exhaustive
    tree = steps.tree
    index_dtype = tree.leaf_indices.dtype
    reach_of_states = jax.vmap(jax.vmap(_reach, (visitor_axis, 0)), (visitor_axis, 0))

    def reach_of(states) -> Float[Array, "blocks size"]:
        return reach_of_states(vb, states)

    tiles = _Tiles(steps, xb)
    narrows = vb.first_points() > 0
    rounds = NARROWING_ROUNDS if narrows else 1

    # Subtrees within a ball are taken whole only by queries searched alone (the
    # blocks of dense regions, which outgrew the budget): elsewhere the bounds from
    # above doubled the descent's work on boxes and seldom spared a leaf (see
    # `benchmarks/accelerator.py`, `count_ball_point` on uniform points and blobs).
    whole = _whole_within(vb, visitor_axis, own_reach.shape) if exhaustive else None
    if whole is not None:
        assert sink is None, "a visitor that takes subtrees whole emits nothing"

    def one_round(reach, active, last, sink):
        """The states of the `active` blocks after a search within `reach`, and
        which of them outgrew the budget (those take every leaf if `last`)."""
        reach = jnp.where(active[:, None], reach, -jnp.inf)
        leaves, near_d2, overflowed, counted = _descend_active(
            steps, tiles, budget, reach, whole, seen, active
        )
        complete = active & (~overflowed | (last & exhaustive))
        emitting = None if sink is None else complete[:, None] & real
        states, sink = _fold_chunks(
            tiles,
            vb,
            visitor_axis,
            init,
            reach_of,
            reach,
            leaves,
            near_d2,
            overflowed & last if exhaustive else None,
            chunk,
            sink,
            emitting,
        )
        if counted is not None:
            # A block that outgrew the budget has no complete frontier: it is
            # searched again, or takes every leaf (none of them whole).
            counted = jnp.where(overflowed[:, None], 0, counted)
            states = _visit_whole(vb, visitor_axis, states, counted)
        return states, overflowed & active, sink

    # Every round is one trace of the loop's body: each descent is a few top-k
    # selections, which are slow to compile on a TPU.
    total = rounds + 1 if exhaustive else rounds

    def again(carry):
        r, reach, states, active, sink = carry
        narrowed = jnp.minimum(reach, reach_of(states))
        reach = jnp.where(active[:, None] & (r > 0), narrowed, reach)
        found, still, sink = one_round(reach, active, r == total - 1, sink)
        states = jax.tree.map(
            lambda f, s: jnp.where(_along(active, s), f, s), found, states
        )
        return r + 1, reach, states, still, sink

    everywhere = jnp.ones(own_reach.shape[0], bool)
    _, _, states, overflowed, sink = lax.while_loop(
        lambda c: (c[0] < total) & jnp.any(c[3]),
        again,
        (jnp.zeros((), index_dtype), own_reach, init, everywhere, sink),
    )
    return states, overflowed, sink


# How many times a block of narrowing visitors whose frontier outgrew the budget
# starts again within the reach its nearest leaves gave it.
NARROWING_ROUNDS = 3


def _along(flags: Bool[Array, " blocks"], s: Array) -> Bool[Array, "..."]:
    return flags.reshape(-1, *(1,) * (s.ndim - 1))


def _fold_chunks(
    tiles,
    vb,
    visitor_axis,
    init,
    reach_of,
    reach,
    leaves,
    near_d2,
    every,
    chunk,
    sink=None,
    emitting=None,
):
    """`init` with each block's listed `leaves` folded in, nearest first, `chunk`
    at a time, until the next chunk's nearest box lies beyond the block's reach
    (as the states narrow it). Blocks flagged in `every` (unless `None`) take every
    leaf of the tree within reach instead, in index order (`_every_within_reach`).
    With a `sink`, the records of the queries flagged in `emitting` are appended to
    it.

    **Returns:** `(states, sink)`."""
    budget = leaves.shape[1]
    index_dtype = leaves.dtype
    chunks = budget // chunk

    def within_reach(leaves, reach):
        """`leaves`, `-1` where no query of the block is within reach of them."""
        near = jnp.any(tiles.leaf_box_d2(leaves) <= reach[:, :, None], axis=1)
        return jnp.where(near, leaves, -1)

    def chunk_leaves(c, reach, scanned):
        """Each block's leaves of chunk `c` (`-1`: none), whether it has any left
        within reach, and (for `every`) how far the scan of all leaves has got."""
        start = c * chunk
        listed = lax.dynamic_slice_in_dim(
            leaves, jnp.minimum(start, budget - chunk), chunk, axis=1
        )
        nearest_box = lax.dynamic_index_in_dim(
            near_d2, jnp.minimum(start, budget - 1), axis=1, keepdims=False
        )
        # Listed nearest first: once a chunk's nearest is beyond every reach, so
        # are the rest.
        listed_left = (c < chunks) & (nearest_box <= jnp.max(reach, axis=1))
        listed = jnp.where(listed_left[:, None], listed, -1)
        if every is None:
            return within_reach(listed, reach), listed_left, scanned

        def listed_only():
            return within_reach(listed, reach), listed_left, scanned

        def every_leaf():
            found, after = _every_within_reach(tiles, reach, scanned, chunk)
            taken = jnp.where(every[:, None], found, within_reach(listed, reach))
            left = jnp.where(every, scanned < tiles.steps.tree.num_leaves, listed_left)
            return taken, left, jnp.where(every, after, scanned)

        # The scan's window of box tests is costly on a TPU (see
        # `benchmarks/accelerator.py`): skipped while no block takes every leaf.
        return lax.cond(jnp.any(every), every_leaf, listed_only)

    def chunk_at(c, states, scanned):
        """Chunk `c`'s leaves for each block, whether any block has one, and the
        scans' positions after it."""
        reach_now = jnp.minimum(reach, reach_of(states))
        taken, left, scanned = chunk_leaves(c, reach_now, scanned)
        return taken, jnp.any(left), scanned

    def body(carry):
        c, states, sink, taken, _, scanned = carry
        states, sink = _fold_active(
            tiles, vb, visitor_axis, states, taken, sink, emitting
        )
        return c + 1, states, sink, *chunk_at(c + 1, states, scanned)

    zero = jnp.zeros((), index_dtype)
    scanned = jnp.zeros(leaves.shape[0], index_dtype)
    _, states, sink, _, _, _ = lax.while_loop(
        lambda carry: carry[4],
        body,
        (zero, init, sink, *chunk_at(zero, init, scanned)),
    )
    return states, sink


def _fold_active(tiles, vb, visitor_axis, states, taken, sink, emitting):
    """`tiles.fold(vb, visitor_axis, states, taken, sink, emitting)`, measuring only
    the tiles of blocks with a leaf in `taken` (`_for_active_blocks`): a chunk none
    of whose leaves some query reaches (reaches narrow after the descent lists
    leaves) costs no tile at all, and the last chunks of a search, which few blocks
    need, a fraction of a full tile."""

    def fold(some, sink):
        some_taken = jnp.where((some < taken.shape[0])[:, None], _rows(taken, some), -1)
        return tiles.of_blocks(some).fold(
            vb if visitor_axis is None else _rows(vb, some),
            visitor_axis,
            _rows(states, some),
            some_taken,
            sink,
            None if emitting is None else _rows(emitting, some),
        )

    active = jnp.any(taken >= 0, axis=1)
    return _for_active_blocks(active, fold, states, sink)


def _for_active_blocks(active: Bool[Array, " blocks"], fn, default, carry):
    """`fn(rows, carry) -> (outputs, carry)`, the outputs one row per block of
    `rows`, run for the `active` blocks only: a group of `1 / ACTIVE_GROUPS` of all
    blocks at a time, but at least `ACTIVE_AT_LEAST` (`rows` past the last active
    one: the number of blocks).

    **Returns:** `(outputs, carry)`, the outputs of the active blocks and elsewhere
    `default`'s, put in place by one row gather (a TPU scatters element by element).
    """
    blocks = active.shape[0]
    index_dtype = jnp.int32
    group = min(blocks, max(ACTIVE_AT_LEAST, -(-blocks // ACTIVE_GROUPS)))
    length = -(-blocks // group) * group
    count = jnp.sum(active, dtype=index_dtype)
    # The active blocks in order, then `blocks` (none).
    slot = jnp.cumsum(active, dtype=index_dtype) - 1
    at = jnp.where(active, slot, length)
    positions = jnp.arange(blocks, dtype=index_dtype)
    rows = jnp.full(length, blocks, index_dtype)
    rows = rows.at[at].set(positions, mode="drop")

    def one_group(c):
        g, outputs, carry = c
        some = lax.dynamic_slice_in_dim(rows, g * group, group)
        found, carry = fn(some, carry)
        outputs = jax.tree.map(
            lambda o, f: lax.dynamic_update_slice_in_dim(
                o, f.astype(o.dtype), g * group, 0
            ),
            outputs,
            found,
        )
        return g + 1, outputs, carry

    empty = jax.tree.map(lambda s: jnp.zeros((length, *s.shape[1:]), s.dtype), default)
    start = (jnp.zeros((), index_dtype), empty, carry)
    _, outputs, carry = lax.while_loop(lambda c: c[0] * group < count, one_group, start)
    back = _rows(outputs, slot)
    outputs = jax.tree.map(
        lambda b, d: jnp.where(_along(active, d), b, d), back, default
    )
    return outputs, carry


# Work done for some blocks only is done a group of `1 / ACTIVE_GROUPS` of all
# blocks at a time (see `benchmarks/accelerator.py`, the blobs), but at least
# `ACTIVE_AT_LEAST` blocks: a small batch of queries is one group, not a loop of
# steps too small to fill an accelerator.
ACTIVE_GROUPS = 8
ACTIVE_AT_LEAST = 64


def _every_within_reach(tiles, reach, scanned, chunk: int):
    """The next `chunk` leaves within reach of each block from leaf `scanned` on
    (`-1` for none), in index order, and the leaf to go on from.

    A window of `EVERY_WINDOW` chunks' leaves is tested by box a step, and the
    leaves within reach are compacted: a block in a dense region (a ball of many
    thousands of points) takes as many steps as it has chunks of leaves within
    reach, not as the tree has chunks of leaves.
    """
    num_leaves = tiles.steps.tree.num_leaves
    index_dtype = scanned.dtype
    # Whole chunks of leaves from the one `scanned` lies in: rows of a table.
    rows = min(EVERY_WINDOW, -(-num_leaves // chunk))
    window = rows * chunk
    row = scanned // chunk
    start = row * chunk
    candidates = start[:, None] + jnp.arange(window, dtype=index_dtype)
    wanted = (candidates >= scanned[:, None]) & (candidates < num_leaves)
    candidates = jnp.where(wanted, candidates, -1)
    table_rows = row[:, None] + jnp.arange(rows, dtype=index_dtype)
    d2 = tiles.rows_box_d2(table_rows, candidates)
    near = jnp.any(d2 <= reach[:, :, None], axis=1)
    rank = jnp.cumsum(near, axis=1, dtype=index_dtype) - 1
    slot = jnp.where(near & (rank < chunk), rank, chunk)  # `chunk`: not taken
    found = jax.vmap(
        lambda s, c: jnp.full(chunk, -1, index_dtype).at[s].set(c, mode="drop")
    )(slot, candidates)
    # On from the first leaf within reach that did not fit, or past the window.
    missed = jnp.where(near & (rank >= chunk), candidates, num_leaves)
    after = jnp.minimum(jnp.min(missed, axis=1), start + window)
    return found, after


# A block that takes every leaf tests this many chunks' leaves by box a step.
EVERY_WINDOW = 32


def _reach(visitor: AbstractVisitor, state: _State) -> Float[Array, ""]:
    return visitor.reach(state)


def _whole_within(visitors, visitor_axis, shape) -> Float[Array, "blocks size"] | None:
    """Each query's `AbstractVisitor.whole_within`, or `None`."""
    if visitor_axis is None:
        whole = visitors.whole_within()
        return None if whole is None else jnp.broadcast_to(whole, shape)
    return jax.vmap(jax.vmap(lambda v: v.whole_within()))(visitors)


def _visit_whole(visitors, visitor_axis, states, counted):
    per_query = jax.vmap(lambda v, s, c: v.visit_whole(s, c), (visitor_axis, 0, 0))
    return jax.vmap(per_query, (visitor_axis, 0, 0))(visitors, states, counted)


def _rows(tree: PyTree, rows: Int[Array, "..."]) -> PyTree:
    return jax.tree.map(lambda a: gather_clamped(a, rows), tree)


def _states_at_init(visitors, visitor_axis, shape) -> _State:
    if visitor_axis is None:
        return jax.tree.map(
            lambda s: jnp.broadcast_to(s, (*shape, *s.shape)), visitors.init()
        )
    return jax.vmap(jax.vmap(lambda v: v.init()))(visitors)


class _Tiles(eqx.Module):
    """The blocks of queries, and the tiles of powered distances from them to
    leaves."""

    steps: _Steps
    queries: Float[Array, "blocks size d"]
    leaf_boxes: Float[Array, "leaves e"]

    def __init__(self, steps: _Steps, queries):
        self.steps = steps
        self.queries = queries
        # Each leaf's box as one row `(lo, hi)`.
        tree, first = steps.tree, steps.first_leaf
        boxes = jnp.concatenate([tree.node_lo, tree.node_hi])
        self.leaf_boxes = boxes[:, first : first + tree.num_leaves].T

    def of_blocks(self, rows: Int[Array, " m"]) -> "_Tiles":
        """The tiles of the blocks `rows` (clamped into range)."""
        return eqx.tree_at(
            lambda t: t.queries, self, gather_clamped(self.queries, rows)
        )

    def row_box_d2(self, rows, nodes: Int[Array, "blocks m"]):
        """`leaf_box_d2` of `nodes` whose boxes are given as rows `(lo, hi)` of
        `2 d`, shape `(blocks, m, 2 d)`."""
        d = self.queries.shape[-1]
        lo = [rows[..., j] for j in range(d)]
        hi = [rows[..., d + j] for j in range(d)]
        return self._axes_box_d2(lo, hi, nodes)

    def row_far_d2(self, rows) -> Float[Array, "blocks size m"]:
        """An upper bound on the powered distance from each query of each block to
        the points of nodes whose boxes are given as rows `(lo, hi)` of `2 d`."""
        d = self.queries.shape[-1]
        lo = [rows[:, None, :, j] for j in range(d)]
        hi = [rows[:, None, :, d + j] for j in range(d)]
        x = self._query_axes()
        return self.steps.metric.box_upper_bound(x, lo, hi, self.steps.period)

    def _query_axes(self) -> list[Float[Array, "blocks size 1"]]:
        return [self.queries[:, :, j, None] for j in range(self.queries.shape[-1])]

    def _axes_box_d2(self, lo: list, hi: list, nodes):
        """`leaf_box_d2` of `nodes` whose boxes are given axis by axis, `(blocks,
        m)`."""
        steps = self.steps
        x = self._query_axes()
        lo, hi = ([a[:, None, :] for a in bounds] for bounds in (lo, hi))
        d2 = steps.metric.box_lower_bound((x, x), lo, hi, steps.period)
        if steps.prune_factor is not None:
            d2 = d2 * steps.prune_factor
        return jnp.where(nodes[:, None, :] >= 0, d2, jnp.inf)

    def leaf_box_d2(
        self, leaves: Int[Array, "blocks m"]
    ) -> Float[Array, "blocks size m"]:
        """A lower bound on the powered distance from each query of each block to
        the points of `leaves` (`inf` for `-1`), inflated by scipy's `eps` where the
        search is approximate. Each leaf's box is gathered once for its block, as one
        row (a TPU gathers rows far faster than scalars)."""
        nodes = jnp.where(leaves >= 0, leaves + self.steps.first_leaf, -1)
        return self.row_box_d2(gather_clamped(self.leaf_boxes, leaves), nodes)

    def rows_box_d2(
        self, rows: Int[Array, "blocks r"], leaves: Int[Array, "blocks m"]
    ) -> Float[Array, "blocks size m"]:
        """`leaf_box_d2` of `leaves`, the leaves of rows `rows` of a table of
        `m // r` leaves a row (`-1` where not wanted): the boxes gathered a row of
        leaves at a time."""
        blocks, m = leaves.shape
        width = m // rows.shape[1]
        padding = -self.leaf_boxes.shape[0] % width
        table = jnp.pad(self.leaf_boxes, ((0, padding), (0, 0)))
        table = table.reshape(-1, width * table.shape[1])
        boxes = gather_clamped(table, rows).reshape(blocks, m, -1)
        nodes = jnp.where(leaves >= 0, leaves + self.steps.first_leaf, -1)
        return self.row_box_d2(boxes, nodes)

    def measure(self, leaves: Int[Array, "blocks m"]):
        """The powered distances from each block's queries to the points of its
        `leaves` (`-1`: none), `(blocks, size, m * leaf_size)`, and the points'
        indices, `(blocks, m * leaf_size)`; padding slots are `(inf, n)`."""
        tree = self.steps.tree
        blocks, m = leaves.shape
        size = tree.leaf_size
        indices = gather_clamped(tree.leaf_indices.reshape(-1, size), leaves)
        indices = jnp.where(leaves[..., None] >= 0, indices, tree.n)
        indices = indices.reshape(blocks, m * size)
        # Axis by axis, the points along the last (minor) axis of every array; each
        # leaf's points one row of a table (gathered as rows, not scalars).
        by_axis = tree.leaf_points.T.reshape(tree.d, -1, size)
        diffs = []
        for j in range(tree.d):
            axis = gather_clamped(by_axis[j], leaves).reshape(blocks, 1, m * size)
            diff = axis - self.queries[:, :, j, None]
            period = self.steps.period
            if period is not None:
                diff = minimum_image(diff[..., None], period[j, None])[..., 0]
            diffs.append(diff)
        d2 = self.steps.metric.powered_of_axes_exactly(diffs)
        d2 = jnp.where(indices[:, None, :] < tree.n, d2, jnp.inf)
        return d2, indices

    def fold(self, visitors, visitor_axis, states, leaves, sink=None, emitting=None):
        """The states with the points of each block's `leaves` folded in, and the
        `sink` (or `None`) with the records of the queries flagged in `emitting`."""
        d2, indices = self.measure(leaves)
        per_query = jax.vmap(
            lambda v, s, d, i: v.visit_tile(s, d, i), in_axes=(visitor_axis, 0, 0, None)
        )
        per_block = jax.vmap(per_query, in_axes=(visitor_axis, 0, 0, 0))
        states = per_block(visitors, states, d2, indices)
        if sink is None:
            return states, None

        def records(v, d, i):
            return v.leaf_records(d, i, jnp.asarray(-1, i.dtype))

        per_query = jax.vmap(records, in_axes=(visitor_axis, 0, None))
        emits, found, weights = jax.vmap(per_query, (visitor_axis, 0, 0))(
            visitors, d2, indices
        )
        assert emitting is not None
        emits = emits & emitting[..., None]
        return states, sink.appended_by_rows(emits, found, weights)


def _first_states(steps: _Steps, tiles: _Tiles, visitors, visitor_axis, init, m):
    """`(leaves, states)`: the `m` leaves nearest to some query of each block
    (found as `_descend` finds leaves, keeping the nearest; `-1`: none), and the
    states after the block's queries have seen their points: a first bound on each
    query's reach, from points near it."""
    nearest, _, _, _ = _descend(steps, tiles, m, None)
    return nearest, tiles.fold(visitors, visitor_axis, init, nearest)[0]


# The descent goes this many levels a step (the nodes `2**STRIDE` levels below a
# node lie side by side, one row of the box table), its first step from the root
# to a level at most `FIRST_LEVEL` deep.
STRIDE = 3
FIRST_LEVEL = 10
# The descent's first step and its last `UNROLLED` steps are written out, the last
# ones keeping twice as many nodes as the step above; the steps between, as many as
# the tree is deep, are one loop, each keeping as many as the first step,
# `width >> UNROLLED`: the program is the same whatever the tree's size.
UNROLLED = 2


def _schedule(depth: int, width: int) -> list[tuple[int, int]]:
    """The descent's steps as `(levels down, nodes kept)`: from the root to the
    leaves (level `depth`), `STRIDE` levels a step from the bottom up and the rest
    in the first step, keeping half as many nodes a step up as below it, down to
    `width >> UNROLLED` (the steps above the last `UNROLLED` and the first all keep
    that many)."""
    levels = []
    level = depth
    while level > FIRST_LEVEL:
        levels.append(level)
        level -= STRIDE
    levels.append(level)
    levels = levels[::-1]
    steps, above = [], 0
    for i, level in enumerate(levels):
        kept = max(1, width >> min(len(levels) - 1 - i, UNROLLED))
        steps.append((level - above, kept))
        above = level
    # A tree of one leaf keeps a step of no levels: the root's own, which tests its
    # box and leaves it out where the first pass measured it already.
    return [step for step in steps if step[0] > 0] or steps[-1:]


class _Frontier(eqx.Module):
    """A descent's state after a step: each block's kept nodes (`-1`: none), their
    least box distance to a query that needs them, whether the block outgrew what a
    step keeps, and, for nodes taken whole, the points counted for each query."""

    nodes: Int[Array, "blocks kept"]
    box_d2: Float[Array, "blocks kept"]
    overflowed: Bool[Array, " blocks"]
    counted: Int[Array, "blocks size"] | None


class _Descent(eqx.Module):
    """One descent's fixed parts: the queries' tiles, their reach, the box table,
    for nodes taken whole the points of every node (`_points_of_nodes`), and the
    leaves each block has seen already (node numbers, `-1`: none), left out."""

    tiles: "_Tiles"
    reach: Float[Array, "blocks size"] | None
    whole: Float[Array, "blocks size"] | None
    boxes: Float[Array, "rows columns"]
    node_points: Int[Array, " nodes"] | None
    seen: Int[Array, "blocks m"] | None

    def step(
        self, frontier: _Frontier, down: int, kept: int, leaves: bool = False
    ) -> _Frontier:
        """The nodes `down` levels below the frontier's, `kept` of them, nearest
        first; the `seen` ones left out where they are `leaves`."""
        blocks, _, d = self.tiles.queries.shape
        span = 2**down
        table = self.boxes[: self.boxes.shape[0] // span * span]
        rows = gather_clamped(table.reshape(-1, span * 2 * d), frontier.nodes + 1)
        rows = rows.reshape(blocks, -1, 2 * d)
        children = (frontier.nodes[..., None] + 1) * span - 1 + jnp.arange(span)
        children = jnp.where(frontier.nodes[..., None] >= 0, children, -1)
        children = children.reshape(blocks, -1)
        d2 = self.tiles.row_box_d2(rows, children)
        overflowed, counted = frontier.overflowed, frontier.counted
        if self.reach is None:
            d2 = jnp.min(d2, axis=1)
        else:
            needed = d2 <= self.reach[:, :, None]
            if self.whole is not None and counted is not None:
                inside = needed & (
                    self.tiles.row_far_d2(rows) <= self.whole[:, :, None]
                )
                needed = needed & ~inside
                dropped = inside & ~jnp.any(needed, axis=1, keepdims=True)
                points = _points_in_children(self.node_points, frontier.nodes, span)
                counted = counted + jnp.sum(
                    jnp.where(dropped, points[:, None, :], 0),
                    axis=2,
                    dtype=counted.dtype,
                )
            d2 = jnp.min(jnp.where(needed, d2, jnp.inf), axis=1)
            if leaves and self.seen is not None:
                known = children[:, :, None] == self.seen[:, None, :]
                d2 = jnp.where(jnp.any(known, axis=2), jnp.inf, d2)
            overflowed = overflowed | (jnp.sum(d2 < jnp.inf, axis=1) > kept)
        kept = min(kept, children.shape[1])
        box_d2, nodes = smallest_first_of(d2, children, kept)
        nodes = jnp.where(box_d2 < jnp.inf, nodes, -1)
        return _Frontier(nodes, box_d2, overflowed, counted)


def _descend(steps: _Steps, tiles: _Tiles, width: int, reach, whole=None, seen=None):
    """Each block's leaves within reach of some query of it (`reach`, one per
    query; `None`: keep the nearest whatever their distance), nearest first, by a
    descent from the root in a few steps of several levels (`_schedule`) that keeps
    at most `width` leaves (a block whose frontier outgrows what a step keeps is
    flagged).

    Nodes are tested against each query, not the block's bounding box: a block
    that a curve's jump spreads out keeps the leaves near each query, not every
    leaf near the box. A step gathers, for each node it keeps, the boxes of all its
    descendants some levels down as one row.

    With `whole` (one powered distance per query), a node within reach whose every
    point lies within `whole` of a query is taken whole for it: it is kept only if
    some other query of the block needs its leaves, and where it is not, its points
    are counted for the queries it lies within `whole` of (a ball's frontier is
    then its surface's nodes, not its volume's).

    With `seen` (`(blocks, m)` leaf numbers, `-1` for none), those leaves are left
    out of each block's, as if beyond reach: their points are known already.

    **Returns:** `(leaves, box_d2, overflowed, counted)`: `(blocks, width)` leaf
    numbers (`-1` for none) and their least box distance to a query that needs
    them (`inf` for none), the flags, and with `whole` the points of the nodes
    taken whole for each query (else `None`).
    """
    tree = steps.tree
    blocks = tiles.queries.shape[0]
    index_dtype = tree.leaf_indices.dtype
    # Each node's box as a row `(lo, hi)`, shifted by one so that the descendants
    # of node `i` some levels down are rows `(i + 1) 2**s ...` of a table of
    # `2**s` nodes a row.
    boxes = jnp.pad(jnp.concatenate([tree.node_lo, tree.node_hi]).T, ((1, 0), (0, 0)))
    node_points = None if whole is None else _points_of_nodes(tree, steps.depth)
    seen_nodes = (
        None if seen is None else jnp.where(seen >= 0, seen + steps.first_leaf, -1)
    )
    descent = _Descent(tiles, reach, whole, boxes, node_points, seen_nodes)
    frontier = _Frontier(
        jnp.zeros((blocks, 1), index_dtype),
        jnp.zeros((blocks, 1), tiles.queries.dtype),
        jnp.zeros(blocks, bool),
        None if whole is None else jnp.zeros(whole.shape, index_dtype),
    )
    schedule = _schedule(steps.depth, width)
    if len(schedule) <= 1 + UNROLLED:
        for i, (down, kept) in enumerate(schedule):
            frontier = descent.step(frontier, down, kept, i == len(schedule) - 1)
    else:
        last = len(schedule) - UNROLLED
        (first_down, first_kept), *looped = schedule[:last]
        frontier = descent.step(frontier, first_down, first_kept)
        down, kept = looped[0]
        frontier = lax.fori_loop(
            0,
            len(looped),
            lambda _, f: descent.step(f, down, kept),
            _padded(frontier, kept),
        )
        for i, (down, kept) in enumerate(schedule[last:]):
            frontier = descent.step(frontier, down, kept, i == UNROLLED - 1)
    frontier = _padded(frontier, width)
    leaves = jnp.where(frontier.nodes >= 0, frontier.nodes - steps.first_leaf, -1)
    return leaves, frontier.box_d2, frontier.overflowed, frontier.counted


def _descend_active(steps, tiles, width, reach, whole, seen, active):
    """`_descend(steps, tiles, width, reach, whole, seen)` for the `active` blocks
    (`_for_active_blocks`); the others have no leaves."""
    blocks, size = reach.shape
    index_dtype = steps.tree.leaf_indices.dtype

    def descend(some, carry):
        def rows(a):
            return None if a is None else _rows(a, some)

        found = _descend(
            steps, tiles.of_blocks(some), width, rows(reach), rows(whole), rows(seen)
        )
        return found, carry

    none = (
        jnp.full((blocks, width), -1, index_dtype),
        jnp.full((blocks, width), jnp.inf, tiles.queries.dtype),
        jnp.zeros(blocks, bool),
        None if whole is None else jnp.zeros((blocks, size), index_dtype),
    )
    found, _ = _for_active_blocks(active, descend, none, None)
    return found


def _padded(frontier: _Frontier, size: int) -> _Frontier:
    """`frontier` with `size` nodes a block, the missing ones none."""
    pad = ((0, 0), (0, size - frontier.nodes.shape[1]))
    return _Frontier(
        jnp.pad(frontier.nodes, pad, constant_values=-1),
        jnp.pad(frontier.box_d2, pad, constant_values=jnp.inf),
        frontier.overflowed,
        frontier.counted,
    )


def _points_of_nodes(tree, depth: int) -> Int[Array, " rows"]:
    """How many points each node holds, in the order of the nodes (level by level,
    as the box table), after one zero: the table whose rows of `2**s` entries from
    row `i + 1` on are the descendants of node `i` some `s` levels down. Node `j`
    at level `l` covers `2**(depth - l)` consecutive leaves, the first of them
    `(j + 1) 2**(depth - l) - 2**depth`: its points are a difference of the count
    of points before each leaf."""
    index_dtype = tree.leaf_indices.dtype
    real = tree.leaf_indices.reshape(-1, tree.leaf_size) < tree.n
    per_leaf = jnp.sum(real, axis=1, dtype=index_dtype)
    before = jnp.concatenate([jnp.zeros(1, index_dtype), jnp.cumsum(per_leaf)])
    node = jnp.arange(2 ** (depth + 1) - 1, dtype=jnp.int32)
    level = 31 - lax.clz(node + 1)
    height = depth - level
    first = ((node + 1) << height) - 2**depth
    last = first + (1 << height)
    points = gather_clamped(before, last) - gather_clamped(before, first)
    return jnp.concatenate([jnp.zeros(1, index_dtype), points.astype(index_dtype)])


def _points_in_children(
    node_points, frontier: Int[Array, "blocks f"], span: int
) -> Int[Array, "blocks m"]:
    """How many points the `span` descendants of each `frontier` node (`-1`: none)
    hold (`node_points`: `_points_of_nodes`). Gathered as rows, as the descent
    gathers boxes: a TPU gathers rows far faster than scalars, and short slices
    one at a time."""
    table = node_points[: node_points.shape[0] // span * span].reshape(-1, span)
    rows = gather_clamped(table, frontier + 1)
    points = jnp.where(frontier[..., None] >= 0, rows, 0)
    return points.reshape(frontier.shape[0], -1)
