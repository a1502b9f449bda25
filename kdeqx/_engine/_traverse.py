"""The one traversal engine: a near-child-first walk in `lax.while_loop`s.

Every query kind is a small visitor on this engine. The walk goes down to near
children (whose box is the nearer; the left one on a tie) and notes each far child it
passes by, if the visitor finds it worth a visit, as one bit for its level: in the
heap layout (the children of node `i` are `2 i + 1` and `2 i + 2`) the far child at a
level is the sibling of the walk's node's ancestor there, so a lane's whole memory of
the walk is its node and one integer. Once a subtree is done, the walk goes straight
into the deepest pending one, without climbing back up through the parents (about
half the moves of a walk that climbs, for the same leaves; `benchmarks/walk_order.py`).

Many queries are walked by a fixed set of lanes (`walk_many`). A vmapped loop costs its
slowest lane, so a lane whose query is finished takes its next one at once, instead of
idling until the whole batch is done. Queries are sorted along a Morton curve and dealt
out in that order as lanes finish (the lanes done in a step take the next queries, in
lane order), so the lanes at work at any time walk nearby parts of the tree, and no
lane is idle while queries wait.
How many lanes, and how many steps a lane may take between two leaf visits, is backend
tuning (`kdeqx._backend.lane_count` and `step_cap`).
"""

import abc
import math

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from .._backend import (
    argsort_keys,
    flags_before,
    gather_clamped,
    lane_count,
    picked_where,
    scatters_element_by_element,
    step_cap,
)
from .._custom_types import Array, Bool, Float, Int, PyTree, UInt
from .._floats import binary_exponent, power_of_two
from ._base import AbstractSearchTree
from ._bits import WORD
from ._metric import Block, Minkowski, Query, query_axes, wrap_into_box


# A lane with no query left.
_IDLE = -2
# What a move did, in a cursor's low bits (see `_Steps.settle`): nothing, resumed
# at a pending subtree, or went down (`| 1`: with the far child left pending).
_RESUMED = 1
_DOWN = 2

# A visitor's state: any pytree of arrays of fixed shape.
_State = PyTree


class AbstractVisitor(eqx.Module):
    """What a query kind does at the nodes and leaves of the walk (one query).

    Visitors are batched with `jax.vmap`, so Python configuration (like `k`) must be a
    static field.
    """

    @abc.abstractmethod
    def init(self) -> _State:
        """The state before any point was seen."""

    @abc.abstractmethod
    def should_visit(
        self, state: _State, box_d2: Float[Array, ""], min_index: Int[Array, ""]
    ) -> Bool[Array, ""]:
        """Whether a subtree may still change the state.

        `box_d2` lower-bounds the squared distance of every point in the subtree and
        `min_index` is the subtree's key: the lowest point index in it, unless the
        walk was given other `node_keys`. Once `False` for a subtree it must stay
        `False` as the state changes: the walk decides on a far child as it passes
        it, and does not ask again.
        """

    @abc.abstractmethod
    def visit_leaf(
        self, state: _State, d2: Float[Array, " leaf"], indices: Int[Array, " leaf"]
    ) -> _State:
        """Folds one leaf's points into the state; padding slots have `d2 = inf`.

        A leaf that `should_visit` would prune may be visited too (a walk starts at
        its nearest leaf, and enters a pending subtree without asking again): its
        points must then leave the state as it is.
        """

    def reach(self, state: _State) -> Float[Array, ""]:
        """A powered distance beyond which no point changes the state (the block
        engine prunes by it; the walk asks `should_visit`)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say how far it reaches, so the block "
            "engine cannot run it."
        )

    def first_points(self) -> int:
        """How many points near each query the block engine should fold in before it
        prunes, for visitors whose `reach` narrows as they see points (the k
        nearest: `2 k`); `0` (default): none, the reach is fixed (a radius)."""
        return 0

    def whole_within(self) -> Float[Array, ""] | None:
        """A powered distance within which a subtree whose every point lies within
        it changes the state by its number of points alone (`visit_whole`): the
        block engine then takes such subtrees whole, without their leaves. `None`
        (default): never."""
        return None

    def visit_whole(self, state: _State, count: Int[Array, ""]) -> _State:
        """The state after `count` more points, each within `whole_within`."""
        raise NotImplementedError

    def visit_tile(
        self, state: _State, d2: Float[Array, " tile"], indices: Int[Array, " tile"]
    ) -> _State:
        """`visit_leaf` for the points of several leaves at once (the block
        engine's tiles: hundreds of points, padding slots `(inf, n)`); a visitor may
        fold them some other way, with the same result."""
        return self.visit_leaf(state, d2, indices)

    def leaves_per_visit(self, leaf_size: int) -> int:
        """How many leaves (of `leaf_size` slots) `walk_many` gathers before it
        folds them into the state in one `visit_leaf`, their points concatenated.
        Meanwhile the walk prunes with the state from before the first of them, so
        a visitor that asks for several must accept a stale state there (as the k
        nearest do: their pruning only tightens). Emitting visitors get one."""
        return 1

    def leaf_records(
        self, d2: Float[Array, "*size leaf"], indices: Int[Array, " leaf"], leaf
    ) -> tuple[Bool[Array, " emits"], PyTree, Int[Array, " emits"] | None] | None:
        """What leaf number `leaf` adds to the walk's shared output (`walk_many`'s
        `sink`): `(emits, records, weights)`, which records are emitted, the
        records (a pytree of arrays whose leading axis is that of `emits`) and how
        many items each stands for (`None`: one). By default a visitor emits nothing.
        """
        return None


class AbstractEmitter(AbstractVisitor):
    """A visitor whose only output is the records it emits (`leaf_records`, into a
    walk's `Sink`): it keeps no state and visits every subtree within the powered
    distance `r2`."""

    r2: eqx.AbstractVar[Float[Array, ""]]

    def init(self) -> Int[Array, ""]:
        return jnp.zeros((), jnp.int8)

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        return box_d2 <= self.r2

    def reach(self, state) -> Float[Array, ""]:
        return self.r2

    def visit_leaf(self, state, d2, indices) -> Int[Array, ""]:
        return state


class Sink(eqx.Module):
    """A shared output that visitors append records to, in no particular order.

    `records` are arrays of leading axis `capacity`, holding the first `stored`
    records emitted (the rest of each array keeps its initial value). `written`
    counts the items of all the records emitted, stored or not (a record stands for
    one item, or for its weight), saturating at the largest value of its dtype.
    """

    records: PyTree
    written: Int[Array, ""]
    stored: Int[Array, ""]

    def __init__(self, records: PyTree, written, stored=None):
        self.records = records
        self.written = written
        self.stored = jnp.zeros_like(written) if stored is None else stored

    @property
    def capacity(self) -> int:
        return jax.tree.leaves(self.records)[0].shape[0]

    def appended(
        self, emits: Bool[Array, "*groups size"], records: PyTree, weights=None
    ) -> "Sink":
        """The sink with the records where `emits` is set appended (the records'
        leading axes are those of `emits`), standing for `weights` items each (one
        by default)."""
        return self._stored(emits, records)._counted(emits, weights)

    def appended_by_rows(
        self,
        emits: Bool[Array, "*rows size"],
        records: PyTree,
        weights=None,
        backend: str | None = None,
    ) -> "Sink":
        """As [`Sink.appended`][], for rows of many flags and few records (a tile's
        distances from a query, most beyond its reach).

        A TPU scatters element by element, each flag's entry costing as much as a
        record, so there each row's records are first picked into `ROW_SLOTS`
        slots by compares and reductions, as many slots a round as it takes (see
        `benchmarks/accelerator.py`, `radius_graph` over a periodic liquid). Most
        rows fill one round, so every row takes the first round and only the rows
        with more records take the later ones, gathered `1 / LATER_FRACTION` of the
        rows at a time (`_picked_in_rounds`). Elsewhere [`Sink.appended`][].
        `backend` defaults to `jax.default_backend()`.
        """
        size = emits.shape[-1]
        if not scatters_element_by_element(backend) or size <= ROW_SLOTS:
            return self.appended(emits, records, weights)
        flags = emits.reshape(-1, size)
        values = jax.tree.map(
            lambda a: a.reshape(*flags.shape, *a.shape[emits.ndim :]), records
        )
        return _picked_in_rounds(self, flags, values)._counted(emits, weights)

    def _stored(self, emits, records) -> "Sink":
        """The records where `emits` is set stored, while there is room."""
        count = self.stored.dtype
        rank = flags_before(emits).astype(count).reshape(-1)
        emits = emits.reshape(-1)
        room = self.capacity - self.stored  # 0 once full
        slot = jnp.where(emits & (rank < room), self.stored + rank, self.capacity)

        def append(buffer, new):
            new = new.reshape(-1, *buffer.shape[1:])
            return buffer.at[slot].set(new, mode="drop")

        emitted = jnp.sum(emits, dtype=count)
        return Sink(
            jax.tree.map(append, self.records, records),
            self.written,
            self.stored + jnp.minimum(emitted, room),
        )

    def _counted(self, emits, weights) -> "Sink":
        """`written` with the items of the records where `emits` is set added."""
        count = self.stored.dtype
        emitted = jnp.sum(emits, dtype=count)
        items = emitted if weights is None else jnp.sum(weights, dtype=count)
        most = jnp.iinfo(count).max
        written = self.written + jnp.minimum(items, most - self.written)
        return Sink(self.records, written, self.stored)


# Rows of a tile pick their records into this many slots a round (on a TPU); the
# later rounds take the rows with more records, this fraction of all rows at a time
# (see `benchmarks/accelerator.py --part2 --profile`, `query_pairs`).
ROW_SLOTS = 16
LATER_FRACTION = 8


def _picked_in_rounds(sink: Sink, flags: Bool[Array, "rows size"], values) -> Sink:
    """`sink` with the records (`values`, `(rows, size, ...)`) where `flags` is set
    stored, each row's picked `ROW_SLOTS` at a time by compares.

    Every row takes the first round at once; then the rows with more records than
    it holds are gathered `rows // LATER_FRACTION` at a time, each batch in as many
    rounds as it needs. A round's scatter then writes about as many slots as there
    are records, where a round over every row wrote `ROW_SLOTS` for each row."""
    rows = flags.shape[0]
    if rows == 0:
        return sink
    index_dtype = jnp.int32
    rank = jnp.cumsum(flags, axis=1, dtype=index_dtype) - 1
    in_row = jnp.sum(flags, axis=1, dtype=index_dtype)
    sink = _one_round(sink, flags, rank, in_row, values, 0)
    more = in_row > ROW_SLOTS
    batch = max(1, -(-rows // LATER_FRACTION))
    # The rows with more records, in order, then `rows` (none).
    later = jnp.where(more, jnp.cumsum(more, dtype=index_dtype) - 1, rows)
    positions = jnp.arange(rows, dtype=index_dtype)
    order = jnp.full(rows + -rows % batch, rows, index_dtype)
    order = order.at[later].set(positions, mode="drop")
    batches = -(-jnp.sum(more, dtype=index_dtype) // batch)

    def one_batch(carry):
        b, sink = carry
        some = lax.dynamic_slice_in_dim(order, b * batch, batch)  # `rows`: none
        counts = jnp.where(some < rows, gather_clamped(in_row, some), 0)
        taken = gather_clamped(flags, some) & (some < rows)[:, None]
        rank_taken = gather_clamped(rank, some)
        taken_values = jax.tree.map(lambda a: gather_clamped(a, some), values)

        def next_round(carry):
            r, sink = carry
            sink = _one_round(sink, taken, rank_taken, counts, taken_values, r)
            return r + 1, sink

        last = -(-jnp.max(counts) // ROW_SLOTS)
        _, sink = lax.while_loop(
            lambda c: c[0] < last, next_round, (jnp.ones((), index_dtype), sink)
        )
        return b + 1, sink

    _, sink = lax.while_loop(
        lambda c: c[0] < batches, one_batch, (jnp.zeros((), index_dtype), sink)
    )
    return sink


def _one_round(sink: Sink, flags, rank, counts, values, r) -> Sink:
    """`sink` with round `r` of each row's records stored: those of ranks `r *
    ROW_SLOTS` on, up to `ROW_SLOTS` of them (`counts`: each row's records)."""
    wanted = r * ROW_SLOTS + np.arange(ROW_SLOTS, dtype=np.int32)
    hits = flags[:, :, None] & (rank[:, :, None] == wanted)
    picked = jax.tree.map(lambda a: _picked(hits, a), values)
    return sink._stored(wanted < counts[:, None], picked)


def _picked(hits: Bool[Array, "rows size slots"], values: Array) -> Array:
    """For each row and slot, the entry of `values` (`(rows, size, ...)`) where
    `hits` is set (at most one), as `(rows, slots, ...)`."""
    hits = hits[(..., *(None,) * (values.ndim - 2))]
    return picked_where(hits, values[:, :, None], axis=1)


def far_limit(dtype, d: int, metric: Minkowski) -> float:
    """The search clamps scaled query coordinates into `[-C, C]`, `C` a power of two.

    The tree's scaled coordinates lie in `[-1, 1]` (`[-4, 4]` for data within a
    factor of 4 of the largest number), so powered distances stay below
    `d (C + 4)**p`, which is finite. A query beyond `C` (2**62 in float32, 3-D and
    `p = 2`; 2**41 for `p = 3`) is
    so far that every point of the tree is at the same distance to float precision:
    the walk from the clamped query still ranks them all equal (by index), and the
    query's entry point replaces distances and thresholds by the true ones.
    """
    headroom = jnp.finfo(dtype).maxexp - 2 - math.ceil(math.log2(d))
    return 2.0 ** (headroom // metric.exponent_bound)


class _Steps(eqx.Module):
    """The steps of a walk for one query, on the tree's search arrays.

    A lane's place in the walk is its node and its pending subtrees: bit `l` of an
    integer of the index dtype for the far child passed at level `l`.
    """

    tree: AbstractSearchTree
    period: Float[Array, " d"] | None
    metric: Minkowski
    prune_factor: Float[Array, ""] | None
    node_keys: Int[Array, " nodes"]

    def __init__(self, tree, metric: Minkowski, node_keys=None):
        self.tree = lax.stop_gradient(tree)
        scale = self.tree.scale
        period = self.tree.period
        self.period = None if period is None else period * scale
        self.metric = metric
        self.prune_factor = metric.prunes_by(scale.dtype)
        self.node_keys = self.tree.node_min_index if node_keys is None else node_keys
        if 8 * self.tree.num_leaves > jnp.iinfo(self.tree.leaf_indices.dtype).max:
            raise ValueError(
                "A tree of 2**28 leaves or more needs 64-bit indices to be walked "
                "(`jax.config.update('jax_enable_x64', True)` before building "
                "it), or a larger `leaf_size`."
            )

    @property
    def first_leaf(self) -> int:
        return self.tree.num_leaves - 1

    def search_point(self, x: Query) -> Query:
        """`x` in the scaled (and, in a periodic box, wrapped) search coordinates; a
        block is given in them."""
        if isinstance(x, Block):
            return x
        tree = self.tree
        scaled = wrap_into_box(lax.stop_gradient(x), tree.period) * tree.scale
        limit = far_limit(scaled.dtype, scaled.shape[-1], self.metric)
        return jnp.clip(scaled, -limit, limit)

    def is_internal(self, node: Int[Array, "*lanes"]) -> Bool[Array, "*lanes"]:
        return (node >= 0) & (node < self.first_leaf)

    def children(self, x, node):
        """The children of `node` as `(near, far)` with their powered box distances;
        the left child is near when the two tie."""
        return self.nearer_first(x, 2 * node + 1, 2 * node + 2)

    def nearer_first(self, x, left, right):
        """`(near, far, near_d2, far_d2)` of two nodes by powered box distance;
        `left` is near when the two tie."""
        x_axes, boxes = query_axes(x), self.box_axes
        d2_left, d2_right = (self.box_distance(x_axes, boxes, n) for n in (left, right))
        left_is_near = d2_left <= d2_right
        near = jnp.where(left_is_near, left, right)
        far = jnp.where(left_is_near, right, left)
        return near, far, jnp.minimum(d2_left, d2_right), jnp.maximum(d2_left, d2_right)

    @property
    def box_axes(self) -> tuple[list, list]:
        """The nodes' boxes' lower and upper bounds, axis by axis."""
        return list(self.tree.node_lo), list(self.tree.node_hi)

    def box_distance(self, x_axes, box_axes, node):
        """A lower bound on the powered distance from a query (`query_axes`) to the
        points of `node` (boxes as `box_axes`)."""
        lo, hi = ([gather_clamped(a, node) for a in axes] for axes in box_axes)
        return self.metric.box_lower_bound(x_axes, lo, hi, self.period)

    @property
    def depth(self) -> int:
        """The leaves' level (the root's is 0)."""
        return self.tree.num_leaves.bit_length() - 1

    def level(self, node: Int[Array, "*lanes"]) -> Int[Array, "*lanes"]:
        """The level of each `node >= 0`."""
        return (jnp.iinfo(node.dtype).bits - 1) - lax.clz(node + 1)

    def verdict(self, x, visitor, state, left, right) -> Int[Array, ""]:
        """Which of two nodes (a node's children) is near and which the visitor
        would visit, as bits: 1 if `left` is near (as on a tie), 2 if the near one
        is worth a visit, 4 if the far one is."""
        near, far, near_d2, far_d2 = self.nearer_first(x, left, right)
        visit_near = self.worth_visiting(visitor, state, near, near_d2)
        visit_far = self.worth_visiting(visitor, state, far, far_d2)
        return (
            (near == left).astype(left.dtype)
            | (visit_near.astype(left.dtype) << 1)
            | (visit_far.astype(left.dtype) << 2)
        )

    def worth_visiting(self, visitor, state, node, box_d2) -> Bool[Array, ""]:
        """The visitor's `should_visit` for `node`, at powered box distance
        `box_d2`."""
        if self.prune_factor is not None:  # scipy's `eps`: skip nearly-far subtrees
            box_d2 = box_d2 * self.prune_factor
        return visitor.should_visit(state, box_d2, gather_clamped(self.node_keys, node))

    def descend(self, x) -> Int[Array, ""]:
        """A walk's first leaf, by near children from the root (its cursor is
        `leaf << 2`); every far child passed on the way is pending (`first_pending`:
        they are tested as the walk enters them). The walk from the root would stop
        on the way only where the visitor prunes, and visiting a leaf it would prune
        changes no state."""
        zero = jnp.zeros((), self.tree.leaf_indices.dtype)
        return lax.fori_loop(0, self.depth, lambda _, n: self.children(x, n)[0], zero)

    @property
    def first_pending(self) -> Int[Array, ""]:
        """The pending subtrees at a walk's first leaf: the far child at every level
        below the root's (the same for every query)."""
        one = jnp.ones((), self.tree.leaf_indices.dtype)
        return (one << (self.depth + 1)) - 2

    def resume(self, node, pending):
        """Where a walk goes once the subtree of `node` is done: into the deepest
        pending subtree, or to `-1` when none is left. (`settle` then takes it off
        `pending`.)"""
        level = self.level(node)
        pending = pending & ((jnp.ones_like(pending) << (level + 1)) - 1)
        deepest = (jnp.iinfo(pending.dtype).bits - 1) - lax.clz(pending)
        on_path = ((node + 1) >> (level - deepest)) - 1
        sibling = ((on_path + 1) ^ 1) - 1
        return jnp.where(pending != 0, sibling, -1)

    def move(self, x, visitor, state, cursor, pending):
        """One step from an internal node: down to the near child, its sibling left
        pending if worth a visit; or, if the near child is not, on as `resume`
        goes. A lane at a leaf tests it again (a leaf left pending was tested
        before the visit that tightened the state), and goes on as `resume` goes if
        it is no longer worth a visit; a lane that is done stays put.

        Takes and returns a lane's `(cursor, pending)` (see `settle`).
        """
        node, pending = self.settle(cursor, pending)
        at_leaf = node >= self.first_leaf
        # A lane at a leaf tests it in both slots: the same gathers as the children.
        left = jnp.where(at_leaf, node, 2 * node + 1)
        verdict = self.verdict(
            x, visitor, state, left, jnp.where(at_leaf, node, left + 1)
        )
        near = 2 * node + 2 - (verdict & 1)
        down = (near << 2) | _DOWN | (verdict >> 2)
        # A resume from the near child sees its far sibling pending, if worth it.
        _, passed = self.settle(down, pending)
        resumed = self.resume(
            jnp.where(at_leaf, node, near), jnp.where(at_leaf, pending, passed)
        )
        stay = jnp.where(at_leaf, node << 2, down)
        moved = jnp.where((verdict & 2) != 0, stay, (resumed << 2) | _RESUMED)
        return jnp.where(node >= 0, moved, node << 2), pending

    def settle(self, cursor, pending):
        """A lane's node and pending subtrees, from its cursor and pending subtrees
        as `move` leaves them.

        A cursor is the node shifted left by two bits, and in those bits what the
        move to it does to the pending subtrees, applied only here, in the next
        step. So the moves' outputs do not both depend on the children's boxes:
        XLA:CPU would then gather each coordinate in a kernel of its own, once for
        both outputs, and a move took far longer."""
        node = cursor >> 2
        update = cursor & 3
        bit = jnp.ones_like(pending) << self.level(node)
        went_down = jnp.where(update == _DOWN | 1, pending | bit, pending & ~bit)
        resumed = pending & (bit - 1)  # the subtree taken and those below it
        pending = jnp.where(
            update >= _DOWN, went_down, jnp.where(update == _RESUMED, resumed, pending)
        )
        return node, pending

    def leaf_entries(self, x, node):
        """The powered distances and indices of leaf `node`'s points (padding slots
        `(inf, n)`), whether `node` is a leaf and which leaf (clamped)."""
        tree = self.tree
        at_leaf = node >= self.first_leaf
        leaf = jnp.clip(node - self.first_leaf, 0, tree.num_leaves - 1)
        start = leaf * tree.leaf_size
        points = lax.dynamic_slice_in_dim(tree.leaf_points, start, tree.leaf_size)
        indices = lax.dynamic_slice_in_dim(tree.leaf_indices, start, tree.leaf_size)
        d2 = jnp.where(
            indices < tree.n,
            self.metric.leaf_distances(x, points, self.period),
            jnp.inf,
        )
        return d2, indices, at_leaf, leaf

    def leave(self, node, pending):
        """Lanes at a leaf go on as `resume` goes, others stay: their `(cursor,
        pending)` after it (the resume, like a move's, settled in the next step)."""
        resumed = self.resume(node, pending)
        at_leaf = node >= self.first_leaf
        return jnp.where(at_leaf, (resumed << 2) | _RESUMED, node << 2), pending

    def visit(self, x, visitor, state, cursor, pending):
        """Folds the points of the lane's leaf into the state, then goes on
        (`leave`); at any other node it changes nothing. Returns the state, the
        lane's `(cursor, pending)` after the leaf, and the records the leaf emits
        (`None` if the visitor emits none)."""
        node, pending = self.settle(cursor, pending)
        d2, indices, at_leaf, leaf = self.leaf_entries(x, node)
        visited = visitor.visit_leaf(state, d2, indices)
        state = jax.tree.map(lambda v, s: jnp.where(at_leaf, v, s), visited, state)
        emitted = visitor.leaf_records(d2, indices, leaf)
        if emitted is not None:
            emits, records, weights = emitted
            if weights is not None:
                weights = jnp.where(at_leaf, weights, 0)
            emitted = (emits & at_leaf, records, weights)
        return (state, *self.leave(node, pending), emitted)


def walk(tree, x: Query, visitor: AbstractVisitor, metric: Minkowski) -> _State:
    """Runs `visitor` over every leaf it does not prune, nearest subtrees first.

    The visitor sees `metric`'s powered distances in the tree's search coordinates,
    which are scaled by `tree.scale`: express its thresholds with
    `kdeqx._search.search_threshold`.
    """
    steps = _Steps(tree, metric)
    x = steps.search_point(x)

    def to_next_leaf(carry):
        def move(c):
            cursor, pending, state = c
            return (*steps.move(x, visitor, state, cursor, pending), state)

        return lax.while_loop(lambda c: steps.is_internal(c[0] >> 2), move, carry)

    def visit_then_move_on(carry):
        cursor, pending, state = carry
        state, cursor, pending, _ = steps.visit(x, visitor, state, cursor, pending)
        return to_next_leaf((cursor, pending, state))

    root = jnp.zeros((), tree.leaf_indices.dtype)
    first = to_next_leaf((root, root, visitor.init()))
    return lax.while_loop(lambda c: (c[0] >> 2) >= 0, visit_then_move_on, first)[2]


def morton_bits(d: int) -> int:
    """How many bits `morton_codes` sets in `d` dimensions."""
    dims = min(d, 30)
    return 30 // dims * dims


def morton_codes(
    x: Float[Array, "q d"], lo: Float[Array, " d"], hi: Float[Array, " d"]
) -> UInt[Array, " q"]:
    """Z-order codes of the queries, quantised within `[lo, lo + w)` on each axis,
    for `w` the least power of two above `hi - lo` (queries outside it share the
    cells on its faces)."""
    dims = min(x.shape[1], 30)
    bits = morton_bits(dims) // dims
    lo, hi = lo[:dims], hi[:dims]
    # Scaled by a power of two, read off the bits: a division would be a kernel of
    # its own on XLA:CPU (its reciprocal, hoisted).
    per_extent = power_of_two(-1 - binary_exponent(hi - lo), x.dtype)
    unit = jnp.clip((x[:, :dims] - lo) * per_extent, 0, 1)
    cells = (unit * (2**bits - 1)).astype(jnp.uint32)
    # Bit `b` of dimension `j` goes to bit `b * dims + j` of the code; the bits are
    # disjoint, so summing them sets them.
    bit = jnp.arange(bits, dtype=jnp.uint32)
    dim = jnp.arange(dims, dtype=jnp.uint32)[:, None]
    spread = ((cells[:, :, None] >> bit) & 1) << (bit * dims + dim)
    return jnp.sum(spread, axis=(1, 2), dtype=jnp.uint32)


def _rows(tree: PyTree, rows: Int[Array, "..."]) -> PyTree:
    return jax.tree.map(lambda a: gather_clamped(a, rows), tree)


def walk_many(
    tree,
    x: Float[Array, "q d"] | Block,
    visitors: AbstractVisitor,
    metric: Minkowski,
    visitor_axis: int | None = 0,
    *,
    sink: Sink | None = None,
    summed: bool = False,
    query_weights: Float[Array, " q"] | Int[Array, " q"] | None = None,
    node_keys: Int[Array, " nodes"] | None = None,
    active: Bool[Array, " q"] | None = None,
) -> tuple[_State, Sink | None]:
    """`jax.vmap(walk, (None, 0, visitor_axis, None))(tree, x, visitors, metric)`, by
    lanes that
    take the next query as soon as theirs is done.

    **Arguments:** `x` holds `q >= 1` queries (points, or a batch of `Block`s);
    `visitors` is a batch of `q` visitors
    (one per query, built with `jax.vmap`) or, with `visitor_axis=None`, one visitor
    for all queries (which spares the program the gathers of per-query fields).

    With a `sink`, the records the visitors emit (`AbstractVisitor.leaf_records`)
    are appended to it. With `summed=True`, the final states are summed over the
    queries instead of kept one per query (so the output does not grow with `q`;
    the visitor's initial state must be zero), each weighted by its entry of
    `query_weights` when given. `node_keys` replace the nodes' lowest point indices
    as the keys that `should_visit` sees. Queries where `active` is False are not
    walked at all (their states stay initial, they emit nothing): a caller that
    knows many queries are void spares the lanes their steps.

    **Returns:** `(states, sink)`: the visitors' final states, batched along the
    queries (or their sum), and the sink (`None` without one).
    """
    q = jax.tree.leaves(x)[0].shape[0]
    index_dtype = tree.leaf_indices.dtype

    def visitors_at(positions):
        """The visitors of the queries at `positions` along the curve."""
        return visitors if visitor_axis is None else _rows(visitors, positions)

    def init(positions):
        """The initial states of the queries at `positions` along the curve."""
        if visitor_axis is None:
            return jax.tree.map(
                lambda s: jnp.broadcast_to(s, (*positions.shape, *s.shape)),
                visitors.init(),
            )
        return jax.vmap(lambda v: v.init())(visitors_at(positions))

    one_state = jax.eval_shape(init, jnp.zeros((1,), index_dtype))
    lane_bytes = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(one_state))
    if isinstance(x, Block):
        # A block's leaf visit measures block x leaf distances: with those counted,
        # block walks get a few dozen lanes on a CPU, not 1024 (radius graphs ran
        # faster: every idle lane costs a full visit per step; `benchmarks/graphs.py`).
        block_size, itemsize = x.points.shape[-2], x.points.dtype.itemsize
        lane_bytes += block_size * tree.leaf_size * itemsize
    lanes = lane_count(lane_bytes)
    if q <= lanes and sink is None and node_keys is None and active is None:
        states = jax.vmap(walk, in_axes=(None, 0, visitor_axis, None))(
            tree, x, visitors, metric
        )
        if not summed:
            return states, None
        return _sum_over_queries(_weighted(states, query_weights)), None
    lanes = min(lanes, q)
    steps_per_visit = step_cap()
    steps = _Steps(tree, metric, node_keys)
    move = jax.vmap(steps.move, in_axes=(0, visitor_axis, 0, 0, 0))
    visit = jax.vmap(steps.visit, in_axes=(0, visitor_axis, 0, 0, 0))

    def advance(x, visitor, state, cursor, pending):
        """Moves every lane `steps_per_visit` steps towards its next leaf (lanes that
        reach it wait there). Nearly always some lane needs them all, so the loop does
        not test for an early end."""

        def one_step(_, c):
            return move(x, visitor, state, *c)

        return lax.fori_loop(0, steps_per_visit, one_step, (cursor, pending))

    points = jax.vmap(steps.search_point)(x)
    # Position `i` along the curve is row `order[i]` of the input.
    # Quantised in the root's box (the data's): no reductions over the queries.
    anchors = points.anchor if isinstance(points, Block) else points
    codes = morton_codes(anchors, steps.tree.node_lo[:, 0], steps.tree.node_hi[:, 0])
    walked = q
    if active is not None:  # codes stay below 2**30: inactive queries go last
        codes = jnp.where(active, codes, jnp.uint32(2**32 - 1))
        walked = jnp.sum(active, dtype=index_dtype)
    order = argsort_keys(codes).astype(index_dtype)
    points = _rows(points, order)
    if visitor_axis is not None:
        visitors = _rows(visitors, order)
    # Every walk starts at its nearest leaf, found for all queries at once.
    # (Shifted into cursors where read: a kernel less than shifting them all here.)
    first_leaf = jax.vmap(steps.descend)(points)

    def take_next(position, finished, cursor, pending, state):
        """Lanes that finished start their next query, at `position` along the curve,
        or go idle when they have none left."""
        fresh_cursor = jnp.where(
            position < walked, gather_clamped(first_leaf, position) << 2, _IDLE << 2
        )
        cursor = jnp.where(finished, fresh_cursor, cursor)
        pending = jnp.where(finished, steps.first_pending, pending)
        state = jax.tree.map(
            lambda f, s: jnp.where(_along(finished, s), f, s), init(position), state
        )
        return cursor, pending, state

    def finish(out, finished, position, state):
        """The answers with those of the lanes that `finished` written (or added)."""
        if summed:
            rows = gather_clamped(order, position)
            weights = None if query_weights is None else query_weights[rows]
            done = jax.tree.map(
                lambda s: jnp.where(_along(finished, s), s, jnp.zeros_like(s)),
                _weighted(state, weights),
            )
            return jax.tree.map(jnp.add, out, _sum_over_queries(done))
        row = jnp.where(finished, gather_clamped(order, position), q)  # q: dropped
        return jax.tree.map(lambda o, s: o.at[row].set(s, mode="drop"), out, state)

    per_visit = visitors.leaves_per_visit(tree.leaf_size)
    assert per_visit == 1 or sink is None, "emitting visitors visit leaf by leaf"

    def visit_several(x, visitor, state, cursor, pending):
        """Each lane's next `per_visit` leaves, gathered while the walk moves on with
        the state as it was, then folded in at once: for the k nearest, one merge
        of several leaves costs about what one leaf's did (k = 512: the 9 stages of
        a 512-key network, for one leaf of 32 or for eight)."""
        size = tree.leaf_size
        entries = jax.vmap(steps.leaf_entries)
        fold = jax.vmap(
            lambda v, s, d2, i: v.visit_leaf(s, d2, i), in_axes=(visitor_axis, 0, 0, 0)
        )

        def gather(r, carry):
            cursor, pending, d2s, indices = carry
            node, pending = steps.settle(cursor, pending)
            d2, index, at_leaf, _ = entries(x, node)
            # A lane not at a leaf contributes padding, which changes no state.
            padding = ~at_leaf[:, None]
            d2s = lax.dynamic_update_slice_in_dim(
                d2s, jnp.where(padding, jnp.inf, d2), r * size, axis=1
            )
            indices = lax.dynamic_update_slice_in_dim(
                indices, jnp.where(padding, tree.n, index), r * size, axis=1
            )
            cursor, pending = steps.leave(node, pending)
            cursor, pending = advance(x, visitor, state, cursor, pending)
            return cursor, pending, d2s, indices

        shape = (cursor.shape[0], per_visit * size)
        empty = (
            jnp.full(shape, jnp.inf, steps.tree.leaf_points.dtype),
            jnp.full(shape, tree.n, index_dtype),
        )
        cursor, pending, d2, index = lax.fori_loop(
            0, per_visit, gather, (cursor, pending, *empty)
        )
        return fold(visitor, state, d2, index), cursor, pending

    def step(carry):
        walks, next_free, state, out, sink = carry
        position, cursor, pending = walks
        xl, visitor = _rows(points, position), visitors_at(position)
        if per_visit > 1:
            state, cursor, pending = visit_several(xl, visitor, state, cursor, pending)
        else:
            state, cursor, pending, emitted = visit(xl, visitor, state, cursor, pending)
            if sink is not None:
                assert emitted is not None, "a walk with a sink needs emitting visitors"
                sink = sink.appended(*emitted)
            cursor, pending = advance(xl, visitor, state, cursor, pending)
        finished = (cursor >> 2) == -1
        out = finish(out, finished, position, state)
        # Lanes that finished take the next queries along the curve, in lane order: a
        # lane is never idle while queries wait, and the walk ends about one query's
        # walk after the last was dealt. (Lanes dealt every `lanes`-th query ahead of
        # time waited for the lane with the longest total, and were slower, most of
        # all on clustered data.)
        before, dealt = _lane_ranks(finished)
        position = jnp.where(finished, next_free + before.astype(index_dtype), position)
        next_free = next_free + dealt.astype(index_dtype)
        cursor, pending, state = take_next(position, finished, cursor, pending, state)
        return jnp.stack([position, cursor, pending]), next_free, state, out, sink

    lane = jnp.arange(lanes, dtype=index_dtype)
    if summed:
        answers = _sum_over_queries(init(lane[:1]))
    else:  # by input row; every row is written once
        answers = init(jnp.arange(q, dtype=index_dtype))
    # Each lane's position along the curve, cursor and pending subtrees, as one
    # array: set up, and updated after each step, by one kernel each where three
    # arrays took three (XLA:CPU: a kNN query compiles to fewer kernels).
    walks = jnp.stack(
        [
            lane,
            jnp.where(lane < walked, first_leaf[:lanes] << 2, _IDLE << 2),
            jnp.full(lanes, steps.first_pending),
        ]
    )
    carry = (walks, jnp.asarray(lanes, index_dtype), init(lane), answers, sink)
    _, _, _, answers, sink = lax.while_loop(
        lambda c: jnp.min(c[0][0]) < walked, step, carry
    )
    return answers, sink


def _lane_ranks(
    flags: Bool[Array, " lanes"],
) -> tuple[Int[Array, " lanes"], Int[Array, ""]]:
    """For each flag, how many flags are set before it; and how many are set."""
    lanes = flags.shape[0]
    padded = jnp.pad(flags, (0, -lanes % WORD))
    ranks = flags_before(padded.reshape(-1, WORD)).reshape(-1)
    return ranks[:lanes], ranks[-1] + padded[-1]


def _along(vector: Array, array: Array) -> Array:
    """A vector (one entry per lane or query) shaped to broadcast along the leading
    axis of `array`."""
    return vector.reshape(-1, *(1,) * (array.ndim - 1))


def _sum_over_queries(states: _State) -> _State:
    return jax.tree.map(lambda s: jnp.sum(s, axis=0, dtype=s.dtype), states)


def _weighted(states: _State, weights: Array | None) -> _State:
    """Each query's state times its weight (unchanged without weights)."""
    if weights is None:
        return states
    return jax.tree.map(lambda s: s * _along(weights, s), states)
