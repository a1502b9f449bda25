"""The one traversal engine: a stackless depth-first walk in `lax.while_loop`s.

Every query kind is a small visitor on this engine. The walk needs no stack: it
tests one node per step, descends into the node's first child (by its split plane,
or for a query far from the points by its children's centres: `_ChildOrder`), and
skips a finished or pruned subtree in one step, to the next node of the depth-first
order, with one bit per level of the path (`_Steps`).

Many queries are walked by a fixed set of lanes (`walk_many`). A vmapped loop costs its
slowest lane, so a lane whose query is finished takes its next one at once, instead of
idling until the whole batch is done. Queries are sorted along a Morton curve and dealt
out in turn (lane `l` walks queries `l`, `l + lanes`, ...), so the lanes at work at any
time walk nearby parts of the tree, and each lane's share averages over the curve.
How many lanes, and how many steps a lane may take between two leaf visits, is backend
tuning (`kdeqx._backend.lane_count` and `step_cap`).
"""

import abc
import math
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from ._backend import argsort_keys, gather_clamped, lane_count, step_cap
from ._bits import bitmasks, set_bit_count, WORD
from ._custom_types import Array, Bool, Float, Int, PyTree, UInt
from ._metric import Block, Minkowski, Query, wrap_into_box


if TYPE_CHECKING:
    from ._tree import KDTree


# A lane with no query left.
_IDLE = -2

# How many of its first leaf's diagonals away a query must lie to walk "far" (see
# `_ChildOrder`). Measured (n = 1e6, k = 8, 2 CPU devices, 2026-12-04): with 1, 4
# and 16, 0 % of uniform queries were far, 47, 23 and 0.2 % of queries between
# blobs, 97, 90 and 60 % of queries off a sheet, 100 % off a curve; 16 took the
# blobs 0.585 s against 0.598 s with 1 and 0.545 s with 64, the sheet (Q = 1e4)
# 0.583 s against 0.571 s with 1 and 0.647 s with 64.
_FAR = 16.0

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
        walk was given other `node_keys`.
        """

    @abc.abstractmethod
    def visit_leaf(
        self, state: _State, d2: Float[Array, " leaf"], indices: Int[Array, " leaf"]
    ) -> _State:
        """Folds one leaf's points into the state; padding slots have `d2 = inf`.

        A leaf that `should_visit` would prune may be visited too (a walk starts at
        its first leaf): its points must then leave the state as it is.
        """

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
        count = self.stored.dtype
        rank = _ranks(emits).astype(count).reshape(-1)
        emits = emits.reshape(-1)
        room = self.capacity - self.stored  # 0 once full
        slot = jnp.where(emits & (rank < room), self.stored + rank, self.capacity)

        def append(buffer, new):
            new = new.reshape(-1, *buffer.shape[1:])
            return buffer.at[slot].set(new, mode="drop")

        emitted = jnp.sum(emits, dtype=count)
        items = emitted if weights is None else jnp.sum(weights, dtype=count)
        most = jnp.iinfo(count).max
        return Sink(
            jax.tree.map(append, self.records, records),
            self.written + jnp.minimum(items, most - self.written),
            self.stored + jnp.minimum(emitted, room),
        )


def _ranks(emits: Bool[Array, "*groups size"]) -> Int[Array, "*groups size"]:
    """For each flag, how many flags are set before it (in row-major order).

    For groups of at most 32, from each group's bitmask (the set bits below a flag)
    and a prefix sum over the groups: a prefix sum over every flag cost XLA:CPU up
    to twice as much (9 ms against 5 ms for 60 appends of 32 x 1024 flags).
    """
    size = emits.shape[-1]
    if size > WORD:
        flat = emits.reshape(-1)
        return (jnp.cumsum(flat, dtype=jnp.int32) - flat).reshape(emits.shape)
    groups = bitmasks(emits.reshape(-1, size))[:, 0]
    counts = set_bit_count(groups)
    before = jnp.cumsum(counts) - counts
    below = (jnp.uint32(1) << jnp.arange(size, dtype=jnp.uint32)) - 1
    within = set_bit_count(groups[:, None] & below)
    return (before[:, None] + within).reshape(emits.shape)


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

    The walk is a depth-first one along "ropes": it tests one node per step and
    either descends into the node's first child (`_ChildOrder`) or skips the node's
    whole subtree at once. It needs no memory of the path beyond one bit per level,
    `seconds`: bit `i` is set when the node `i` levels above the current one (the
    current one is `i = 0`) is the second of its parent's children that the walk
    enters. Skipping a subtree climbs past every level whose bit is set, then steps
    over to the sibling, in a few integer operations (`skip`). The climbing moves of
    the walk this replaced (each testing both children of a node) cost a uniform
    k = 8 query about 5 % more and one far from the points 30 % more.
    """

    tree: "KDTree"
    period: Float[Array, " d"] | None
    metric: Minkowski
    prune_factor: Float[Array, ""] | None
    node_keys: Int[Array, " nodes"]
    order: "_ChildOrder"

    def __init__(self, tree, metric: Minkowski, node_keys=None):
        self.tree = lax.stop_gradient(tree)
        scale = self.tree.scale
        period = self.tree.period
        self.period = None if period is None else period * scale
        self.metric = metric
        self.prune_factor = metric.prunes_by(scale.dtype)
        self.node_keys = self.tree.node_min_index if node_keys is None else node_keys
        self.order = _ChildOrder(self.tree.node_lo, self.tree.node_hi)

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

    def box_d2(self, x: Query, node: Int[Array, ""]) -> Float[Array, ""]:
        """The powered distance from `x` to `node`'s box (a lower bound)."""
        tree = self.tree
        return self.metric.box_lower_bound(
            x,
            gather_clamped(tree.node_lo, node),
            gather_clamped(tree.node_hi, node),
            self.period,
        )

    def first_child(
        self, x: Query, node: Int[Array, ""], by_centres: Bool[Array, ""] | bool
    ) -> Int[Array, ""]:
        """The child of internal `node` that the walk enters first (`_ChildOrder`),
        by the boxes' centres where `by_centres`, else by the split."""
        point = x.anchor if isinstance(x, Block) else x
        right_first = self.order.beyond_split(point, node)
        if by_centres is not False:
            nearer = self.order.nearer_right_centre(point, node)
            right_first = jnp.where(by_centres, nearer, right_first)
        return 2 * node + 1 + right_first.astype(node.dtype)

    def start_leaf(self, x: Query, far: Bool[Array, ""] | bool) -> Int[Array, ""]:
        """The first leaf of a walk: first children all the way down from the root
        (`far`: as in `move`).

        Any leaf would do: every bit of its `seconds` is clear (no sibling on its
        path is done yet), so the walk then visits every subtree off its path once.
        """
        depth = self.tree.num_leaves.bit_length() - 1

        def down(_, node):
            by_centres = far if far is False else far & (self.box_d2(x, node) > 0)
            return self.first_child(x, node, by_centres)

        return lax.fori_loop(
            0, depth, down, jnp.zeros((), self.tree.leaf_indices.dtype)
        )

    def is_far(self, x: Query, leaf: Int[Array, ""]) -> Bool[Array, ""]:
        """Whether `x` lies far from the points of `leaf`, the first leaf of its walk
        by the split: further from its box than `_FAR` times the box's diagonal. Such
        a walk orders children by their centres outside their parent's box."""
        lo = gather_clamped(self.tree.node_lo, leaf)
        hi = gather_clamped(self.tree.node_hi, leaf)
        return self.box_d2(x, leaf) > self.metric.powered(_FAR * (hi - lo))

    def skip(
        self, node: Int[Array, ""], seconds: UInt[Array, ""]
    ) -> tuple[Int[Array, ""], UInt[Array, ""]]:
        """The walk's next node after `node`'s subtree, and its `seconds`: `-1` when
        the walk is over.

        In the heap numbered from 1 (`v = node + 1`) the parent of `v` is `v >> 1`
        and its sibling `v ^ 1`. The walk climbs as many levels as `seconds` has
        trailing ones (every subtree there is finished), then takes the sibling,
        which is a second child. At the root it is done.
        """
        lowest_clear = ~seconds & (seconds + 1)
        # log2 of a power of two, from its float32 exponent (exact, and vectorised
        # where `lax.clz` is not).
        as_float = lowest_clear.astype(jnp.float32)
        climb = (lax.bitcast_convert_type(as_float, jnp.uint32) >> 23) - 127
        up = (node + 1) >> climb.astype(node.dtype)
        following = jnp.where(up == 1, -1, (up ^ 1) - 1)
        return following.astype(node.dtype), (seconds >> climb) | 1

    def move(
        self,
        x,
        visitor,
        state,
        node,
        seconds,
        waiting,
        far: Bool[Array, ""] | bool = False,
    ):
        """One step: tests `node`, then descends to its first child, stops at it (a
        leaf to visit: `waiting`), or skips its subtree. A lane that waits at a leaf
        or is done stays put. `far`: whether the query lies far from the points (see
        `start`; `False` spares the step the gathers of the centres' order).
        Returns the new `(node, seconds, waiting)`."""
        box_d2 = self.box_d2(x, node)
        if self.prune_factor is not None:  # scipy's `eps`: skip nearly-far subtrees
            box_d2 = box_d2 * self.prune_factor
        key = gather_clamped(self.node_keys, node)
        visit = visitor.should_visit(state, box_d2, key)
        internal = self.is_internal(node)
        descend = visit & internal
        skipped, skipped_seconds = self.skip(node, seconds)
        by_centres = far if far is False else far & (box_d2 > 0)
        following = jnp.where(
            descend,
            self.first_child(x, node, by_centres),
            jnp.where(visit, node, skipped),
        )
        following_seconds = jnp.where(
            descend, seconds << 1, jnp.where(visit, seconds, skipped_seconds)
        )
        moving = (node >= 0) & ~waiting
        return (
            jnp.where(moving, following, node),
            jnp.where(moving, following_seconds, seconds),
            waiting | (moving & visit & ~internal),
        )

    def leave(self, node, seconds, waiting):
        """After a visit: lanes that waited at a leaf skip past it."""
        skipped, skipped_seconds = self.skip(node, seconds)
        return (
            jnp.where(waiting, skipped, node),
            jnp.where(waiting, skipped_seconds, seconds),
            jnp.zeros_like(waiting),
        )

    def leaf_entries(self, x, node):
        """The powered distances and indices of leaf `node`'s points (padding slots
        `(inf, n)`) and which leaf it is (clamped: any other node reads some leaf)."""
        tree = self.tree
        leaf = jnp.clip(node - self.first_leaf, 0, tree.num_leaves - 1)
        start = leaf * tree.leaf_size
        points = lax.dynamic_slice_in_dim(tree.leaf_points, start, tree.leaf_size)
        indices = lax.dynamic_slice_in_dim(tree.leaf_indices, start, tree.leaf_size)
        d2 = jnp.where(
            indices < tree.n,
            self.metric.leaf_distances(x, points, self.period),
            jnp.inf,
        )
        return d2, indices, leaf

    def visit(self, x, visitor, state, node, waiting):
        """Folds the points of leaf `node` into the state where the lane is
        `waiting` there; otherwise changes nothing. Returns the state and the
        records the leaf emits (`None` if the visitor emits none)."""
        d2, indices, leaf = self.leaf_entries(x, node)
        visited = visitor.visit_leaf(state, d2, indices)
        state = jax.tree.map(lambda v, s: jnp.where(waiting, v, s), visited, state)
        emitted = visitor.leaf_records(d2, indices, leaf)
        if emitted is not None:
            emits, records, weights = emitted
            if weights is not None:
                weights = jnp.where(waiting, weights, 0)
            emitted = (emits & waiting, records, weights)
        return state, emitted


class _ChildOrder(eqx.Module):
    """Which child of each internal node a walk enters first.

    Two orders, both planes per node, the right child first beyond them. By the
    split: the plane between the children (the build splits at a median, so along
    one dimension the children's boxes do not overlap; the plane lies midway across
    that gap), which costs a step two gathers. By the centres: the plane that
    bisects the two boxes' centres, so the child whose centre is nearer comes first
    (`d + 1` gathers). Far from the points, the split planes led queries into
    subtrees far from them (points on a curve: ten times the leaves); the centres
    alone cost queries among the points 10 % more steps (`benchmarks/walk_order.py`).
    So a walk far from the points orders by the centres where the query lies
    outside a node's box, and by the split otherwise. Any order gives the same
    answers: it only decides how soon the walk's bound tightens.

    A row per internal node and a spare one, so that a tree of one leaf has
    something to gather. An empty right child (padding) never comes first.
    """

    split_dims: Int[Array, " rows"]
    split_values: Float[Array, " rows"]
    normals: Float[Array, "d rows"]
    offsets: Float[Array, " rows"]

    def __init__(self, lo: Float[Array, "nodes d"], hi: Float[Array, "nodes d"]):
        left_lo, left_hi = _with_spare_row(lo[1::2]), _with_spare_row(hi[1::2])
        right_lo, right_hi = _with_spare_row(lo[2::2]), _with_spare_row(hi[2::2])
        dims = jnp.argmax(right_lo - left_hi, axis=1).astype(jnp.int32)
        middles = jnp.take_along_axis(right_lo + left_hi, dims[:, None], axis=1) / 2
        self.split_dims, self.split_values = dims, middles[:, 0]
        # Nearer the right centre `c_r` than the left `c_l` where
        # `x . (c_r - c_l) > (|c_r|^2 - |c_l|^2) / 2`.
        left, right = (left_lo + left_hi) / 2, (right_lo + right_hi) / 2
        normals = right - left
        offsets = (jnp.sum(right * right, axis=1) - jnp.sum(left * left, axis=1)) / 2
        usable = jnp.all(jnp.isfinite(normals), axis=1) & jnp.isfinite(offsets)
        self.normals = jnp.where(usable[:, None], normals, 0).T
        self.offsets = jnp.where(usable, offsets, jnp.inf)

    def beyond_split(self, x: Float[Array, " d"], node: Int[Array, ""]):
        dim = gather_clamped(self.split_dims, node)
        coordinate = x[0]
        for axis in range(1, x.shape[-1]):
            coordinate = jnp.where(dim == axis, x[axis], coordinate)
        return coordinate > gather_clamped(self.split_values, node)

    def nearer_right_centre(self, x: Float[Array, " d"], node: Int[Array, ""]):
        projection = x[0] * gather_clamped(self.normals[0], node)
        for axis in range(1, x.shape[-1]):
            projection = projection + x[axis] * gather_clamped(self.normals[axis], node)
        return projection > gather_clamped(self.offsets, node)


def _with_spare_row(rows: Array) -> Array:
    return jnp.concatenate([rows, jnp.zeros((1, *rows.shape[1:]), rows.dtype)])


def walk(tree, x: Query, visitor: AbstractVisitor, metric: Minkowski) -> _State:
    """Runs `visitor` over every leaf it does not prune, depth first from the first
    leaf of `x`'s walk (`_Steps.start_leaf`).

    The visitor sees `metric`'s powered distances in the tree's search coordinates,
    which are scaled by `tree.scale`: express its thresholds with
    `kdeqx._search.search_threshold`.
    """
    steps = _Steps(tree, metric)
    x = steps.search_point(x)
    near_leaf = steps.start_leaf(x, False)
    far = steps.is_far(x, near_leaf)
    first_leaf = jnp.where(far, steps.start_leaf(x, far), near_leaf)

    def to_next_leaf(carry):
        def move(c):
            node, seconds, waiting, state = c
            walker = steps.move(x, visitor, state, node, seconds, waiting, far)
            return (*walker, state)

        return lax.while_loop(lambda c: (c[0] >= 0) & ~c[2], move, carry)

    def visit_then_move_on(carry):
        node, seconds, waiting, state = carry
        state, _ = steps.visit(x, visitor, state, node, waiting)
        return to_next_leaf((*steps.leave(node, seconds, waiting), state))

    start = (
        first_leaf,
        jnp.zeros((), jnp.uint32),
        jnp.ones((), bool),
        visitor.init(),
    )
    walked = lax.while_loop(lambda c: c[0] >= 0, visit_then_move_on, start)
    return walked[3]


def morton_codes(
    x: Float[Array, "q d"], lo: Float[Array, " d"], hi: Float[Array, " d"]
) -> UInt[Array, " q"]:
    """Z-order codes of the queries, quantised within the box `[lo, hi]` (queries
    outside it share the cells on its faces)."""
    dims = min(x.shape[1], 30)
    bits = 30 // dims
    lo, hi = lo[:dims], hi[:dims]
    extent = hi - lo
    unit = jnp.clip((x[:, :dims] - lo) / jnp.where(extent > 0, extent, 1), 0, 1)
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
        # block walks get ~64 lanes on a CPU, not 1024 (measured: radius graphs
        # ~20% faster; every idle lane costs a full visit per step).
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
    move = jax.vmap(steps.move, in_axes=(0, visitor_axis, 0, 0, 0, 0, 0))
    move_near = jax.vmap(steps.move, in_axes=(0, visitor_axis, 0, 0, 0, 0))
    visit = jax.vmap(steps.visit, in_axes=(0, visitor_axis, 0, 0, 0))
    leave = jax.vmap(steps.leave)

    def advance(x, visitor, state, far, node, seconds, waiting):
        """Moves every lane `steps_per_visit` steps towards its next leaf (lanes that
        reach it wait there). Nearly always some lane needs them all, so the loop does
        not test for an early end. While no lane walks far from the points, the
        steps skip the gathers of the centres' order."""

        def far_steps(walker):
            def one_step(_, c):
                node, seconds, waiting = c
                return move(x, visitor, state, node, seconds, waiting, far)

            return lax.fori_loop(0, steps_per_visit, one_step, walker)

        def near_steps(walker):
            def one_step(_, c):
                return move_near(x, visitor, state, *c)

            return lax.fori_loop(0, steps_per_visit, one_step, walker)

        walker = (node, seconds, waiting)
        return lax.cond(jnp.any(far & (node >= 0)), far_steps, near_steps, walker)

    points = jax.vmap(steps.search_point)(x)
    # Position `i` along the curve is row `order[i]` of the input.
    # Quantised in the root's box (the data's): no reductions over the queries.
    anchors = points.anchor if isinstance(points, Block) else points
    codes = morton_codes(anchors, steps.tree.node_lo[0], steps.tree.node_hi[0])
    walked = q
    if active is not None:  # codes stay below 2**30: inactive queries go last
        codes = jnp.where(active, codes, jnp.uint32(2**32 - 1))
        walked = jnp.sum(active, dtype=index_dtype)
    order = argsort_keys(codes).astype(index_dtype)
    points = _rows(points, order)
    if visitor_axis is not None:
        visitors = _rows(visitors, order)
    # Every walk starts at its first leaf, found for all queries at once. The walk
    # from the root would stop on the way there only where the visitor prunes, and
    # visiting a leaf it would prune changes no state.
    first_node = jax.vmap(steps.start_leaf, in_axes=(0, None))(points, False)
    far = jax.vmap(steps.is_far)(points, first_node)
    first_node = lax.cond(
        jnp.any(far),
        lambda: jnp.where(far, jax.vmap(steps.start_leaf)(points, far), first_node),
        lambda: first_node,
    )

    def take_next(position, finished, walker, state):
        """Lanes that finished start their next query, at `position` along the curve,
        or go idle when they have none left."""
        node, seconds, waiting = walker
        fresh_node = jnp.where(
            position < walked, gather_clamped(first_node, position), _IDLE
        )
        node = jnp.where(finished, fresh_node, node)
        seconds = jnp.where(finished, 0, seconds)
        waiting = jnp.where(finished, node >= 0, waiting)
        fresh = init(position)
        state = jax.tree.map(
            lambda f, s: jnp.where(_along(finished, s), f, s), fresh, state
        )
        return (node, seconds, waiting), state

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

    def visit_several(x, visitor, state, far, walker):
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
            walker, d2s, indices = carry
            node, _, waiting = walker
            d2, index, _ = entries(x, node)
            # A lane not waiting at a leaf contributes padding: it changes no state.
            padding = ~waiting[:, None]
            d2s = lax.dynamic_update_slice_in_dim(
                d2s, jnp.where(padding, jnp.inf, d2), r * size, axis=1
            )
            indices = lax.dynamic_update_slice_in_dim(
                indices, jnp.where(padding, tree.n, index), r * size, axis=1
            )
            walker = advance(x, visitor, state, far, *leave(*walker))
            return walker, d2s, indices

        shape = (walker[0].shape[0], per_visit * size)
        empty = (
            jnp.full(shape, jnp.inf, steps.tree.leaf_points.dtype),
            jnp.full(shape, tree.n, index_dtype),
        )
        walker, d2, index = lax.fori_loop(0, per_visit, gather, (walker, *empty))
        return fold(visitor, state, d2, index), walker

    def step(carry):
        position, walker, state, out, sink = carry
        xl, visitor = _rows(points, position), visitors_at(position)
        far_lanes = gather_clamped(far, position)
        if per_visit > 1:
            state, walker = visit_several(xl, visitor, state, far_lanes, walker)
        else:
            node, _, waiting = walker
            state, emitted = visit(xl, visitor, state, node, waiting)
            if sink is not None:
                assert emitted is not None, "a walk with a sink needs emitting visitors"
                sink = sink.appended(*emitted)
            walker = advance(xl, visitor, state, far_lanes, *leave(*walker))
        finished = walker[0] == -1
        out = finish(out, finished, position, state)
        position = jnp.where(finished, position + lanes, position)
        walker, state = take_next(position, finished, walker, state)
        return position, walker, state, out, sink

    lane = jnp.arange(lanes, dtype=index_dtype)
    if summed:
        answers = _sum_over_queries(init(lane[:1]))
    else:  # by input row; every row is written once
        answers = init(jnp.arange(q, dtype=index_dtype))
    # Each lane's walker: `(node, seconds, waiting)`, as `_Steps.move` takes them.
    start = jnp.where(lane < walked, first_node[:lanes], _IDLE)
    walker = (start, jnp.zeros(lanes, jnp.uint32), start >= 0)
    carry = (lane, walker, init(lane), answers, sink)
    _, _, _, answers, sink = lax.while_loop(
        lambda c: jnp.min(c[0]) < walked, step, carry
    )
    return answers, sink


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
