"""Neighbour graphs: every pair of points within a cutoff, or each point's k nearest,
in free space or a periodic cell of any shape, for batches of separate systems (each
in a cell of its own, if need be), as fixed-capacity edge lists (matscipy's `i, j, S`
convention) for message passing and molecular dynamics.

Both graphs search a tree of the points moved into their cells. A radius graph walks
each leaf of it, and each image of the leaf that the cutoff reaches, as one `Block`
query (pairs travel as bitmasks, as in `query_pairs`), or on the block engine takes
each image of each point as a query (an edge a record); a kNN graph queries each
image of each point, the far ones bounded by what the point's own cell found. A batch
of systems becomes one tree: each system is moved along an extra axis, far enough
from the others that no edge joins two of them. With a cell per system, each point
moves by its own system's image offsets (a leaf's box by its system's, or, for a leaf
of several systems, by every system's), and an offset along an axis that a system is
not periodic along carries its points to infinity.
"""

import equinox as eqx
import jax
import jax.core
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from .._backend import (
    argsort_keys,
    axes_at,
    outside_any_trace,
    placed_in_rows,
    set_positions,
    sort_edges,
    sort_edges_in_rows,
)
from .._backend._buckets import bucket, first_rows, pad_rows, to_device
from .._custom_types import Array, ArrayLike, Bool, Float, Int, PyTree
from .._engine._bits import bitmasks, set_bit_count, WORD
from .._engine._blocks import emit_blocks
from .._engine._metric import Block, EUCLIDEAN, norm_without_overflow
from .._engine._search import far_queries, rows_at, search_threshold
from .._engine._traverse import AbstractEmitter, Sink, walk_many
from .._query import _knn
from .._query._pairs import unpacked
from .._tree._tree import check_engine, check_points, KDTree
from .._validate import (
    as_float_array,
    check_finite,
    check_positive,
    check_static_int,
    index_dtype_for,
    is_concrete,
)
from ._cell import (
    as_cell,
    as_lattice,
    Cell,
    checked_reach,
    checked_systems,
    first_nonzero_positive,
    image_counts,
    shift_table,
)


class NeighborGraph(eqx.Module):
    """Directed edges `senders[e] -> receivers[e]` between points within a cutoff
    (or to each point's nearest), in a fixed capacity.

    The edge vector is `points[receivers] - points[senders] + shifts @ cell`
    (matscipy's `i, j, S`), with the cell of the edge's system when there is one
    per system: `shifts` counts the whole cell vectors that carry the receiver to the
    image the sender sees (zero without a cell). Edges are ordered by sender, then
    receiver, then shift. Entries past the edges found are padding:
    `senders == receivers == n`, `shifts == 0`, distance `inf`.

    `count` is the true number of edges, which may exceed the capacity (`overflow`;
    saturating at the largest value of its dtype); the edges kept are then as many
    as fit, in order, of those the search met first. `distances` are
    differentiable with respect to the points and the cell (zero, not NaN,
    gradients at zero length); so is `edge_vectors`.

    A graph built with `batch=` keeps the ids (`batch`) and, when it was given one
    cell per system, their number (`num_systems`, static): `edge_vectors` finds
    each edge's cell by them and `to_jraph` splits the graph into one per system.
    """

    senders: Int[Array, " edges"]
    receivers: Int[Array, " edges"]
    shifts: Int[Array, "edges d"]
    distances: Float[Array, " edges"]
    count: Int[Array, ""]
    overflow: Bool[Array, ""]
    batch: Int[Array, " n"] | None = None
    num_systems: int | None = eqx.field(static=True, default=None)

    @property
    def max_edges(self) -> int:
        return self.senders.shape[-1]

    def edge_vectors(
        self, points: ArrayLike, cell: ArrayLike | None = None
    ) -> Float[Array, "edges d"]:
        """`points[receivers] - points[senders] + shifts @ cell` (zero at padding),
        for the points and cell of this step: the graph's integers stay valid while
        no pair crosses the cutoff (see `NeighborList`).

        **Arguments:**

        - `points`: shape `(n, d)`.
        - `cell`: `None`, one cell (`(d,)` lengths or a `(d, d)` lattice), or one
            per system (`(B, d)` or `(B, d, d)`; the graph must have been built
            with `batch=` ids `0 .. B - 1`, which pick each edge's cell).

        **Returns:**

        The edge vectors, shape `(max_edges, d)`.
        """
        points = as_float_array("points", points)
        if points.ndim != 2 or points.shape[1] != self.shifts.shape[-1]:
            raise ValueError(
                f"`points` must have shape (n, {self.shifts.shape[-1]}), got shape "
                f"{points.shape}."
            )
        lattice, per_system = as_lattice(cell, points.shape[1], points.dtype)
        system = None
        if per_system:
            assert lattice is not None
            system = self._systems(lattice.shape[0], "`cell` with one cell per system")
        return _edge_vectors(
            self.senders, self.receivers, self.shifts, points, lattice, system
        )

    def edge_mask(self) -> Bool[Array, " edges"]:
        """Which entries are edges (not padding)."""
        return self.distances < jnp.inf

    def to_jraph(
        self,
        nodes: PyTree,
        edges: PyTree = None,
        globals: PyTree = None,
        *,
        num_graphs: int | None = None,
    ):
        """A `jraph.GraphsTuple` (jraph is optional: `pip install jraph`) in jraph's
        padded form: the graph (one graph per system when it was built with
        `batch=`), then a padding graph of one node (row `n` of the nodes, zeros)
        that receives the padding edges. Works under `jit` (the counts are traced).

        **Arguments:**

        - `nodes`: per-point features, arrays of leading axis `n`.
        - `edges`: per-entry features, arrays of leading axis `max_edges`, or
            `None`.
        - `globals`: per-graph features, arrays of leading axis `B + 1` (one row
            per graph and one for the padding graph; `2` without `batch`), or
            `None`.
        - `num_graphs`: the number of systems `B` of a graph built with `batch=`
            (static). It defaults to the number of cells for a graph built with one
            cell per system, and is needed otherwise.

        The batch ids must be `0 .. B - 1` in sorted order: jraph's `n_node` counts
        each graph's nodes as a contiguous run (sort the points by id before
        building the graph: `order = jnp.argsort(batch)`). Other ids raise an
        error (eagerly, or `eqx.error_if` under `jit`).

        **Returns:**

        A `GraphsTuple` of `B + 1` graphs (`2` without `batch`): `n_node` counts each
        system's points, `n_edge` its edges (those kept, when the graph
        overflowed), and the padding graph has one node and the padding entries.
        """
        try:
            import jraph
        except ImportError as error:
            raise ImportError("`to_jraph` needs jraph: `pip install jraph`.") from error
        leaves = jax.tree.leaves(nodes)
        if not leaves:
            raise ValueError(
                "`nodes` must hold per-point features (one row per point)."
            )
        n = leaves[0].shape[0] if leaves[0].ndim else 0
        _check_leading("nodes", nodes, n, "one row per point")
        _check_leading("edges", edges, self.max_edges, "one row per entry")
        real = jnp.minimum(self.count, self.max_edges).astype(jnp.int32)
        if self.batch is None:
            if num_graphs not in (None, 1):
                raise ValueError(
                    f"`num_graphs={num_graphs}` needs a graph built with `batch=`."
                )
            n_node = jnp.array([n, 1], jnp.int32)
            n_edge = jnp.stack([real, self.max_edges - real])
        else:
            if self.batch.shape[0] != n:
                raise ValueError(
                    f"`nodes` must have one row per point of the graph "
                    f"({self.batch.shape[0]}), got {n}."
                )
            systems = self._num_graphs(num_graphs)
            ids = _sorted_ids(self._systems(systems, "`to_jraph`"))
            n_node = jnp.zeros(systems + 1, jnp.int32).at[ids].add(1).at[-1].set(1)
            graph_of = jnp.where(self.senders < n, rows_at(ids, self.senders), systems)
            n_edge = jnp.zeros(systems + 1, jnp.int32).at[graph_of].add(1)
        _check_leading(
            "globals",
            globals,
            n_node.shape[0],
            "one row per graph, and one for the padding graph",
        )
        return jraph.GraphsTuple(
            nodes=jax.tree.map(
                lambda a: jnp.pad(a, [(0, 1)] + [(0, 0)] * (a.ndim - 1)), nodes
            ),
            edges=edges,
            senders=self.senders,
            receivers=self.receivers,
            n_node=n_node,
            n_edge=n_edge,
            globals=globals,
        )

    def _num_graphs(self, num_graphs: int | None) -> int:
        """`B`: `num_graphs`, or the graph's number of cells."""
        if num_graphs is None:
            if self.num_systems is None:
                raise ValueError(
                    "`to_jraph` of a graph built with `batch=` needs `num_graphs=` "
                    "(the number of systems), unless it was built with one cell "
                    "per system."
                )
            return self.num_systems
        num_graphs = check_static_int("num_graphs", num_graphs, 1)
        if self.num_systems is not None and num_graphs != self.num_systems:
            raise ValueError(
                f"`num_graphs={num_graphs}`, but the graph was built with "
                f"{self.num_systems} cells, one per system."
            )
        return num_graphs

    def _systems(self, systems: int, what: str) -> Int[Array, " n"]:
        """The batch ids, checked to be system ids `0 .. systems - 1`."""
        if self.batch is None:
            raise ValueError(
                f"{what} needs a graph built with `batch=` (each point's system id)."
            )
        return checked_systems(self.batch, systems)


def _check_leading(name: str, tree: PyTree, rows: int, what: str) -> None:
    for leaf in jax.tree.leaves(tree):
        shape = jnp.shape(leaf)
        if not shape or shape[0] != rows:
            raise ValueError(
                f"`{name}` must have a leading axis of {rows} ({what}), got an array "
                f"of shape {shape}."
            )


def _sorted_ids(ids: Int[Array, " n"]) -> Int[Array, " n"]:
    """`ids`, checked to be in order (eagerly, or with `eqx.error_if` under `jit`)."""
    message = (
        "`to_jraph` needs the points sorted by `batch` id (each system's points "
        "contiguous): sort them before building the graph, e.g. by "
        "`jnp.argsort(batch)`."
    )
    if is_concrete(ids):
        if np.any(np.diff(np.asarray(ids)) < 0):
            raise ValueError(message)
        return ids
    return eqx.error_if(ids, jnp.any(ids[1:] < ids[:-1]), message)


# Jitted, as `with_points`: eagerly, one program to compile, not one per operation.
@jax.jit
def _edge_vectors(senders, receivers, shifts, points, lattice, system):
    return jnp.stack(
        _edge_components(senders, receivers, shifts, points, lattice, system), -1
    )


def _edge_components(
    senders, receivers, shifts, points, lattice, system=None
) -> list[Array]:
    """The edge vectors axis by axis (zero at padding), the points gathered as
    `axes_at` gathers them (on XLA:CPU, gathers and sums of single columns run
    several times faster than of `(edges, 3)` rows; on a TPU, the reverse).
    `lattice` holds `(B, d, d)` cells: each edge's is its sender's `system`'s (or
    the one cell, for `system=None`)."""
    n, d = points.shape
    valid = senders < n
    edge_system = None if system is None else rows_at(system, senders)
    at_receivers, at_senders = axes_at(points, receivers), axes_at(points, senders)
    components = []
    for axis in range(d):
        vector = at_receivers[axis] - at_senders[axis]
        if lattice is not None:
            for b in range(d):
                entry = lattice[:, b, axis]  # per system
                entry = entry[0] if edge_system is None else rows_at(entry, edge_system)
                vector = vector + shifts[:, b].astype(points.dtype) * entry
        components.append(jnp.where(valid, vector, 0))
    return components


@eqx.filter_jit
def with_points(graph: NeighborGraph, points, lattice, system=None) -> NeighborGraph:
    """The graph with its distances measured for `points` and `lattice` (`(B, d,
    d)` cells, picked per edge by `system`, see `_edge_components`)."""
    components = _edge_components(
        graph.senders, graph.receivers, graph.shifts, points, lattice, system
    )
    distances = _lengths(components, graph.senders < points.shape[0])
    return eqx.tree_at(lambda g: g.distances, graph, distances)


def _lengths(components: list[Array], valid: Bool[Array, " edges"]):
    """Euclidean lengths, `inf` at padding, with zero (not NaN) gradients at zero
    length, measured without overflow or underflow (`norm_without_overflow`)."""
    length = norm_without_overflow(jnp.stack(components, axis=-1))
    return jnp.where(valid, length, jnp.inf)


def radius_graph(
    points: ArrayLike,
    r: ArrayLike,
    max_edges: int,
    *,
    cell: ArrayLike | None = None,
    pbc: bool | tuple[bool, ...] | ArrayLike = True,
    batch: ArrayLike | None = None,
    self_loops: bool = False,
    half: bool = False,
    images: int | tuple[int, ...] | None = None,
    leaf_size: int = 32,
    engine: str = "auto",
) -> NeighborGraph:
    """Every pair of points within distance `r` (Euclidean), as a `NeighborGraph`.

    **Arguments:**

    - `points`: shape `(n, d)`, finite floats. In a cell they may lie anywhere: each
        is wrapped into the cell along its periodic axes, and the shifts account for
        it (edge vectors use the points as given).
    - `r`: the cutoff, a finite scalar `> 0`; edges have `distance <= r`.
    - `max_edges`: the capacity (static int `>= 1`). More edges than that are
        counted (`count`, `overflow`), never silently lost.
    - `cell`: `None` (free space), the lengths of an orthorhombic box `(d,)`, or a
        triclinic cell `(d, d)` whose rows are the cell vectors; or one cell per
        system of a batch, `(B, d)` lengths or `(B, d, d)` lattices, with `batch`
        ids `0 .. B - 1` picking each point's (a `(d, d)` array is always one
        lattice: give `d` orthorhombic systems as `(d, d, d)` diagonal lattices).
        Every cell must span a volume (also along non-periodic axes).
    - `pbc`: which cell vectors are periodic: a bool, or one per axis, for every
        system; or `(B, d)` bools, a row per system, with one cell per system.
        Concrete (Python or NumPy bools; ignored without a cell).
    - `batch`: segment ids of shape `(n,)` (ints, for example `0 .. B - 1` in any
        order): edges join only points of one segment, so a batch of systems is one
        call. With one cell per system the ids must be `0 .. B - 1` (others raise
        an error, eagerly or with `eqx.error_if` under `jit`). In float32 the ids
        must stay below `2**24`.
    - `self_loops`: include each `(i, i)` with zero shift. A point's other images
        within `r` are neighbours and always included.
    - `half`: each pair once: `sender < receiver`, or for a point and its own image,
        the shift whose first nonzero component is positive.
    - `images`: how many cells to search on either side along each periodic axis
        (static; an int or one per axis). By default the fewest that hold every
        image within `r` (`ceil(r / height)`, the height being the distance between
        the cell's faces) in every system, for a concrete `r` and `cell`, and 1
        when either is traced (under `jit` or `grad`). Too few raises an error
        (eagerly, or `eqx.error_if` under `jit`), never a missing edge.
    - `leaf_size`: the search tree's leaf size (tuning; answers do not depend on it).
    - `engine`: how the pairs are searched, as `KDTree`'s `engine`: `"auto"`
        (default: the walk on a CPU, blocks elsewhere), `"walk"` (each leaf, and
        each image of it, one query of the walk) or `"blocks"` (each point, and each
        image of it, one query of the block engine). The same graph either way.

    **Returns:** a `NeighborGraph` with `max_edges` entries, edges in both
    directions unless `half`.
    """
    points = check_points("points", points)
    n, d = points.shape
    max_edges = check_static_int("max_edges", max_edges, 1)
    r = check_positive(
        "r", check_finite("r", as_float_array("r", r, points.dtype)), points.dtype
    )
    engine = check_engine(engine)
    cell_, segment, systems = cell_and_segments(cell, pbc, batch, n, d, points.dtype)
    counts = image_counts(cell_, r, images)
    padded, rows, given = points, n, segment
    # One program per bucket of `n`, where no padding point is its own image's.
    if _pads_eagerly(n, self_loops, systems) and _no_self_images(cell_, r):
        padded, segment = pad_points_to_bucket(points, segment)
        rows = padded.shape[0]
    graph = _radius_graph(
        padded,
        r,
        cell_,
        segment,
        systems,
        max_edges,
        counts,
        self_loops,
        half,
        leaf_size,
        engine,
    )
    if rows == n:
        return graph
    return _unpadded(graph, n, rows, max_edges, given)


def knn_graph(
    points: ArrayLike,
    k: int,
    *,
    cell: ArrayLike | None = None,
    pbc: bool | tuple[bool, ...] | ArrayLike = True,
    batch: ArrayLike | None = None,
    self_loops: bool = False,
    images: int | tuple[int, ...] | None = None,
    leaf_size: int = 32,
    engine: str = "auto",
) -> NeighborGraph:
    """Each point's `k` nearest neighbours (Euclidean), as a `NeighborGraph` with
    `n * k` entries: point `i` sends to its neighbours.

    In a cell, each image of a point is a candidate of its own (a small cell may
    hold several images of one neighbour among the `k`). Ties in distance go to the
    lower receiver index, then the lower shift. Where a point has fewer than `k`
    candidates (a segment of at most `k` points in free space), it has fewer edges;
    the edges are still in order, padding last. Aggregating messages at each centre
    point is `jax.ops.segment_sum(messages, graph.senders, n)`.

    **Arguments:** as `radius_graph` (one cell per system included), with `k` the
    number of neighbours (static int `>= 1`) and `self_loops` counting the point
    itself (at distance 0) as one of them. `images` defaults to 1 (searched cells
    on either side along each periodic axis); a point whose `k`-th neighbour lies
    farther than the images searched can reach raises an error (eagerly, or
    `eqx.error_if` under `jit`). `engine` chooses how the neighbours are searched,
    as `KDTree`'s (`"auto"`: the walk on a CPU, blocks on an accelerator); the
    graph is the same.
    """
    points = check_points("points", points)
    n, d = points.shape
    k = check_static_int("k", k, 1)
    engine = check_engine(engine)
    cell_, segment, systems = cell_and_segments(cell, pbc, batch, n, d, points.dtype)
    counts = image_counts(cell_, None, images)
    padded, rows, given = points, n, segment
    # In a cell, the padding points' missing neighbours would fail the reach check.
    if cell_ is None and _pads_eagerly(n, self_loops, systems):
        padded, segment = pad_points_to_bucket(points, segment)
        rows = padded.shape[0]
    graph = _knn_graph(
        padded, k, cell_, segment, systems, counts, self_loops, leaf_size, engine
    )
    if rows == n:
        return graph
    return _unpadded(graph, n, rows, n * k, given)


def pad_points_to_bucket(
    points: ArrayLike, batch: ArrayLike | None = None
) -> tuple[Float[Array, "rows d"], Int[Array, " rows"]]:
    """Points (and segment ids) padded to their size bucket (see `kdeqx.bucket`), so
    that graphs of nearby numbers of points share one compiled program.

    Each padding point is a segment of its own (ids after the largest given), so
    no edge reaches it: `radius_graph` and `knn_graph` of the padded points (with
    `batch=` the returned ids) have the unpadded graph's edges, on the same rows,
    with the padding rows' `rows` standing for the sentinel where the unpadded
    graph has `n`. A `knn_graph`'s first `n * k` entries are the unpadded graph's.
    Pad outside your `jit`, and give the padding rows any node features; with
    `self_loops=True` each padding point has its own loop (mask `senders < n`).
    Not for one cell per system, whose ids must be `0 .. B - 1`, nor for a cutoff
    beyond the cell, where each padding point meets its own images.

    Called eagerly, `radius_graph` and `knn_graph` (free space) pad this way
    themselves and return the unpadded graph.

    **Arguments:**

    - `points`: shape `(n, d)`.
    - `batch`: segment ids of shape `(n,)`, or `None` (one segment, id 0).

    **Returns:** `(points, batch)` with `kdeqx.bucket(n)` rows: the padding points
    at the origin, their ids increasing after the largest given.
    """
    n = np.shape(points)[0]
    rows = bucket(n)
    ids = np.zeros(n, np.int32) if batch is None else batch
    if isinstance(ids, jax.core.Tracer) or isinstance(points, jax.core.Tracer):
        raise TypeError(
            "`pad_points_to_bucket` pads outside `jit`: padding changes the shapes "
            "that a transformation has fixed."
        )
    ids = np.asarray(ids)
    first = int(ids.max()) + 1 if n else 0
    padding = np.arange(first, first + rows - n, dtype=ids.dtype)
    padded = to_device(pad_rows(points, rows, fill="zeros"))
    return padded, jax.device_put(np.concatenate([ids, padding]))


def _pads_eagerly(n: int, self_loops: bool, systems: int | None) -> bool:
    """Whether an eager graph call pads its points to their bucket: outside any
    trace, where padding changes the shape, and the padding points would form no
    edge (no self loops, no cell per system)."""
    return (
        outside_any_trace()
        and n > 0
        and bucket(n) != n
        and not self_loops
        and systems is None
    )


def _no_self_images(cell: Cell | None, r) -> bool:
    """Whether no point has an image of itself within `r` (a concrete cutoff): every
    translation by whole cell vectors is at least the smallest height between the
    faces of a periodic axis."""
    if cell is None:
        return True
    heights = jnp.where(cell.periodic, cell.heights(), jnp.inf)
    return bool(jnp.min(heights) > r)


def _unpadded(graph: NeighborGraph, n: int, rows: int, entries: int, batch):
    """The graph of the padded points as that of the first `n`: its first `entries`
    entries, the sentinel `rows` back to `n`, and the ids as given."""
    sentinel = (rows, n)
    return eqx.tree_at(
        lambda g: (g.senders, g.receivers, g.shifts, g.distances, g.batch),
        graph,
        (
            first_rows(graph.senders, entries, (entries,), sentinel),
            first_rows(graph.receivers, entries, (entries,), sentinel),
            first_rows(graph.shifts, entries, (entries,)),
            first_rows(graph.distances, entries, (entries,)),
            batch,
        ),
        is_leaf=lambda x: x is None,
    )


def cell_and_segments(
    cell, pbc, batch, n: int, d: int, dtype
) -> tuple[Cell | None, Int[Array, " n"] | None, int | None]:
    """`(cell, segment, systems)`: the checked cell (`None` when nothing is
    periodic), the checked segment ids (`None` without `batch`), and the number of
    cells given one per system (else `None`)."""
    segment = _check_batch(batch, n)
    cell_, systems = as_cell(cell, pbc, d, dtype)
    if systems is not None:
        if segment is None:
            raise ValueError(
                f"`cell` holds {systems} cells, one per system: pass `batch=` with "
                f"each point's system id, 0 .. {systems - 1}."
            )
        segment = checked_systems(segment, systems)
    return cell_, segment, systems


def _check_batch(batch, n: int) -> Int[Array, " n"] | None:
    if batch is None:
        return None
    segment = jnp.asarray(batch)
    if not jnp.issubdtype(segment.dtype, jnp.integer):
        raise TypeError(f"`batch` must hold integer segment ids, got {segment.dtype}.")
    if segment.shape != (n,):
        raise ValueError(
            f"`batch` must have one id per point, shape ({n},), got {segment.shape}."
        )
    return segment


def system_of(cell: Cell | None, segment) -> Int[Array, " n"] | None:
    """Each point's cell: its segment id with one cell per system, else `None`."""
    return segment if cell is not None and cell.per_system else None


class _Placed(eqx.Module):
    """The points as the search sees them: moved into their cells (`wraps` whole
    cell vectors back) and each segment moved along an extra axis; and the cells'
    lattices (zero on the extra axis; one for one cell, zero in free space) and
    periodic axes, which make each system's image offsets (`_offsets`)."""

    points: Float[Array, "n e"]
    wraps: Int[Array, "n d"]
    lattice: Float[Array, "systems d e"]
    periodic: Bool[Array, "systems d"]


def _placed(points, cell: Cell | None, segment, table: np.ndarray, separation):
    points = lax.stop_gradient(points)
    n, d = points.shape
    if cell is None:
        wrapped, wraps = points, jnp.zeros((n, d), jnp.int32)
        lattice = jnp.zeros((1, d, d), points.dtype)
        periodic = jnp.zeros((1, d), bool)
    else:
        cell = lax.stop_gradient(cell)
        wrapped, wraps = cell.wrapped(points, system_of(cell, segment))
        lattice, periodic = cell.lattice, cell.periodic
    if segment is not None:
        lowest = jnp.min(segment) if n else 0
        offsets = _offsets(table, lattice)
        extra = (segment - lowest).astype(points.dtype) * separation(wrapped, offsets)
        wrapped = jnp.concatenate([wrapped, extra[:, None]], axis=1)
        lattice = jnp.pad(lattice, ((0, 0), (0, 0), (0, 1)))
    return _Placed(wrapped, wraps, lattice, periodic)


def _graph(points, cell, segment, systems, table, wraps, edges, count, capacity: int):
    """The `NeighborGraph` of `edges = (senders, receivers, images)`, sorted and
    padded with `n`: shifts from the image numbers and the points' `wraps`, lengths
    from the points and cell as given."""
    n = points.shape[0]
    senders, receivers, images = edges
    valid = senders < n

    # x_j + S @ L - x_i, with y = x - w @ L: the shift is S + w_i - w_j. Axis by
    # axis, as `_edge_components`; points already in the cell (MD's usual) have no
    # wraps to gather.
    def shifts_of(wrapped: bool):
        axes = range(table.shape[1])
        shifts = [jnp.asarray(table[:, axis])[images] for axis in axes]
        if wrapped:
            sent, received = axes_at(wraps, senders), axes_at(wraps, receivers)
            shifts = [s + sent[a] - received[a] for a, s in enumerate(shifts)]
        return jnp.stack([jnp.where(valid, s, 0) for s in shifts], -1)

    shifts = lax.cond(
        jnp.any(wraps != 0), lambda: shifts_of(True), lambda: shifts_of(False)
    )
    lattice = None if cell is None else cell.lattice
    components = _edge_components(
        senders, receivers, shifts, points, lattice, system_of(cell, segment)
    )
    return NeighborGraph(
        senders,
        receivers,
        shifts,
        _lengths(components, valid),
        count,
        count > capacity,
        segment,
        systems,
    )


class _LeafEdges(AbstractEmitter):
    """The edges from one image of one leaf (a `Block`): for each of its points and
    each leaf visited, one record: the point's slot, the leaf, the image, and the
    leaf's slots within `r` as a bitmask (as `_pairs._LeafPairs`)."""

    r2: Float[Array, ""]
    leaf: Int[Array, ""]
    image: Int[Array, ""]
    senders: Int[Array, " size"]
    zero_shift: Bool[Array, ""]
    positive_shift: Bool[Array, ""]
    self_loops: bool = eqx.field(static=True)
    half: bool = eqx.field(static=True)

    def leaf_records(self, d2, indices, leaf):
        size = d2.shape[0]
        sender, receiver = self.senders[:, None], indices[None, :]
        keep = _kept(sender, receiver, self.zero_shift, self.positive_shift, self)
        masks = bitmasks((d2 <= self.r2) & keep)
        found = jnp.sum(set_bit_count(masks), axis=1, dtype=jnp.int32)
        slot = jnp.arange(size)
        rows = (self.leaf * size + slot).astype(indices.dtype)
        leaves = jnp.broadcast_to(leaf.astype(indices.dtype), rows.shape)
        images = jnp.broadcast_to(self.image, rows.shape)
        return found > 0, (rows, leaves, images, masks), found


class _PointEdges(AbstractEmitter):
    """The edges from one image of one point (a query of the block engine): one
    record `(sender, receiver, image)` per point within `r2`."""

    r2: Float[Array, ""]
    sender: Int[Array, ""]
    image: Int[Array, ""]
    zero_shift: Bool[Array, ""]
    positive_shift: Bool[Array, ""]
    self_loops: bool = eqx.field(static=True)
    half: bool = eqx.field(static=True)

    def leaf_records(self, d2, indices, leaf):
        sender = self.sender.astype(indices.dtype)
        keep = _kept(sender, indices, self.zero_shift, self.positive_shift, self)
        senders = jnp.broadcast_to(sender, indices.shape)
        images = jnp.broadcast_to(self.image, indices.shape)
        return (d2 <= self.r2) & keep, (senders, indices, images), None


def _kept(sender, receiver, zero_shift, positive_shift, options) -> Bool[Array, "..."]:
    """Which pairs of an image make edges: with `half`, each pair once (and a point
    with its own image where the shift's first nonzero component is positive);
    without `self_loops`, not a point with itself unshifted."""
    itself = sender == receiver
    if options.half:
        own_image = positive_shift | (zero_shift & options.self_loops)
        return (sender < receiver) | (itself & own_image)
    if options.self_loops:
        return jnp.ones(itself.shape, bool)
    return ~(itself & zero_shift)


@eqx.filter_jit
def _radius_graph(
    points,
    r,
    cell,
    segment,
    systems: int | None,
    capacity: int,
    counts,
    self_loops,
    half,
    leaf_size,
    engine: str = "walk",
) -> NeighborGraph:
    n, d = points.shape
    index_dtype = index_dtype_for(n + 1)
    table = shift_table(counts, d)
    if n == 0:
        return _empty_graph(points, capacity, index_dtype, segment, systems)
    tree, placed, filled = _searched(
        points, r, cell, segment, table, capacity, self_loops, half, leaf_size, engine
    )
    if tree.engine == "blocks":
        senders, receivers, images = filled.records
        senders, receivers = senders.astype(index_dtype), receivers.astype(index_dtype)
    else:
        senders, receivers, images = _unsorted_edges(
            tree, filled, capacity, index_dtype
        )
    edges = sort_edges(senders, receivers, images, n + 1, len(table))
    graph = _graph(
        points,
        cell,
        segment,
        systems,
        table,
        placed.wraps,
        edges,
        filled.written,
        capacity,
    )
    return checked_reach(graph, cell, counts, r, "The cutoff `r`")


@eqx.filter_jit
def radius_edge_count(
    points, r, cell, segment, counts, self_loops, half, leaf_size, engine="walk"
) -> Int[Array, ""]:
    """The number of edges `_radius_graph` finds, without collecting them: a program
    that compiles a little faster (a neighbour list's first pass, which sizes its
    capacity, where it has no guess of the pairs)."""
    n, d = points.shape
    if n == 0:
        return jnp.zeros((), index_dtype_for(n + 1))
    table = shift_table(counts, d)
    *_, filled = _searched(
        points, r, cell, segment, table, 1, self_loops, half, leaf_size, engine
    )
    return filled.written


def _searched(
    points, r, cell, segment, table, capacity: int, self_loops, half, leaf_size, engine
):
    """The tree over the placed points and the sink of its search: the walk's
    records of leaves (`_walked_images`), or the block engine's of points
    (`_emitted_images`)."""
    placed = _placed(
        points, cell, segment, table, lambda wrapped, _: _apart(2 * r, wrapped)
    )
    tree = KDTree(placed.points, leaf_size=leaf_size, engine=engine)
    tree = lax.stop_gradient(tree)
    system = system_of(cell, segment)
    if tree.engine == "blocks":
        filled = _emitted_images(
            tree, placed, table, segment, system, r, capacity, self_loops, half
        )
        return tree, placed, filled
    blocks = _image_blocks(tree, placed, table, system)
    filled = _walked_images(tree, blocks, table, r, capacity, self_loops, half)
    return tree, placed, filled


def _emitted_images(
    tree: KDTree,
    placed: _Placed,
    table,
    segment,
    system,
    r,
    capacity: int,
    self_loops,
    half,
) -> Sink:
    """The sink of `_PointEdges` records from the block engine, each image of each
    point a query. A sender image sits at `y - offset`; an image beyond `r` of its
    segment's bounding box, or that moves along an axis its system is not periodic
    along, finds nothing, so only the others are searched, `n` queries a step of a
    loop, each step's found by `set_positions` (one search compiled; in a periodic
    cell most images of most points lie beyond `r` of every point, and a step or two
    take the rest)."""
    n = tree.n
    images = len(table)
    index_dtype = tree.leaf_indices.dtype
    r2 = search_threshold(tree, r, EUCLIDEAN)
    x, reach = _image_queries(tree, placed, table, segment, system, r, r2)
    row_dtype = index_dtype_for(images * n + 1)
    running = jnp.cumsum(reach >= 0, dtype=row_dtype)
    steps = -(-running[-1] // n)
    zero = jnp.asarray(~table.any(axis=1))
    positive = jnp.asarray(first_nonzero_positive(table))
    sink = Sink(
        (
            jnp.full(capacity, n, index_dtype),
            jnp.full(capacity, n, index_dtype),
            jnp.zeros(capacity, jnp.int32),
        ),
        jnp.zeros((), index_dtype_for(n + 1)),
    )

    def one_step(carry):
        step, sink = carry
        rows = set_positions(running, step * n + jnp.arange(n, dtype=row_dtype))
        image = (rows // n).astype(jnp.int32)
        sender = (rows % n).astype(index_dtype)
        # (rows past the last query: the first query's, finding nothing)
        reaches = jnp.where(rows < images * n, rows_at(reach, rows), -1)
        visitors = jax.vmap(
            lambda reach, sender, image: _PointEdges(
                reach,
                sender,
                image,
                zero[image],
                positive[image],
                self_loops=self_loops,
                half=half,
            )
        )(reaches, sender, jnp.minimum(image, images - 1))
        sink = emit_blocks(tree, rows_at(x, rows), visitors, EUCLIDEAN, sink)
        return step + 1, sink

    start = jnp.zeros((), row_dtype)
    _, sink = lax.while_loop(lambda c: c[0] < steps, one_step, (start, sink))
    return sink


def _image_queries(tree: KDTree, placed: _Placed, table, segment, system, r, r2):
    """Every image of every point, `(images * n, e)`, image by image, and its
    reach: `r2`, or `-1` where it finds nothing."""
    if system is None:  # one cell: `(images, 1, e)` offsets
        offsets = _offsets(table, placed.lattice[0])[:, None]
    else:  # each point's own system's: `(images, n, e)`
        offsets = _offsets(table, placed.lattice[system])
    x = placed.points[None] - offsets
    reach = jnp.broadcast_to(r2, x.shape[:2])
    if system is not None:
        reach = jnp.where(_reachable(table, placed.periodic[system]), reach, -1)
    # An image beyond `r` of the box of its segment's points pairs with none of
    # them: most images of most points in a periodic cell, and every image but the
    # first of a padding point (a segment of its own, see `pad_points_to_bucket`).
    lo, hi = _segment_boxes(placed.points, segment)
    reach = jnp.where(_surely_beyond(x, lo, hi, r), -1, reach)
    x = x.reshape(-1, x.shape[-1])
    # As in `query_pairs`: a query beyond `r` of the whole tree finds nothing.
    far = far_queries(tree, x, EUCLIDEAN)
    reach = jnp.where(far.beyond(far.distance <= r), -1, reach.reshape(-1))
    return x, reach


def _segment_boxes(
    points: Float[Array, "n e"], segment: Int[Array, " n"] | None
) -> tuple[Float[Array, "#n e"], Float[Array, "#n e"]]:
    """The bounding box of each point's segment: of all the points where there is
    one segment. Segment ids more than `n - 1` past the lowest share one box, which
    holds theirs (ids need not be dense)."""
    if segment is None:
        return jnp.min(points, 0, keepdims=True), jnp.max(points, 0, keepdims=True)
    n = points.shape[0]
    ids = jnp.minimum(segment - jnp.min(segment), n - 1)
    lo = jax.ops.segment_min(points, ids, num_segments=n)
    hi = jax.ops.segment_max(points, ids, num_segments=n)
    return lo[ids], hi[ids]


def _surely_beyond(
    x: Float[Array, "*m e"], lo: Float[Array, "*#m e"], hi: Float[Array, "*#m e"], r
) -> Bool[Array, "*m"]:
    """Whether each `x` lies beyond `r` of the box `[lo, hi]` by more than rounding:
    its gaps to the box, less a few units in the last place of the coordinates,
    still exceed `r` with a relative margin, so no point in the box is within `r` of
    it however the search rounds its distances."""
    eps = jnp.finfo(x.dtype).eps
    magnitude = jnp.maximum(jnp.abs(x), jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
    gaps = jnp.maximum(lo - x, x - hi) - 4 * eps * magnitude
    gaps = jnp.maximum(gaps, 0)
    return jnp.sum(gaps * gaps, axis=-1) > (r * r) * (1 + 64 * eps)


def _image_blocks(tree: KDTree, placed: _Placed, table, system) -> Block:
    """Each image of each leaf as a `Block`, image by image: its points moved by
    minus their image offset (a sender image sits at `y - offset`); padding slots,
    and points moved along an axis their system is not periodic along, at
    infinity (they pair with nothing)."""
    size, leaves = tree.leaf_size, tree.num_leaves
    images, e = len(table), tree.leaf_points.shape[1]
    padding = tree.leaf_indices == tree.n
    if system is None:
        # One cell: a leaf's box moves with its points.
        leaf_points = jnp.where(padding[:, None], jnp.inf, tree.leaf_points)
        moved = _offsets(table, placed.lattice[0]) * tree.scale
        points = leaf_points.reshape(leaves, size, e)[None] - moved[:, None, None]
        boxes = [
            (box[None] - moved[:, None]).reshape(-1, e) for box in tree._leaf_boxes()
        ]
        return Block(points.reshape(images * leaves, size, e), *boxes)
    # Image by image, slot by slot: sums of products that XLA fuses into their
    # readers (a gather of `(images, e)` offsets per slot would be materialised).
    slot_system = rows_at(system, tree.leaf_indices)
    moved = _offsets(table, placed.lattice[slot_system] * tree.scale)  # (M, slots, e)
    void = padding | ~_reachable(table, placed.periodic[slot_system])
    points = jnp.where(void[..., None], jnp.inf, tree.leaf_points - moved)
    # The boxes from the leaves' (a reduction over the moved points costs more
    # than the walk saves): a leaf of one system moves by its offset; one of
    # several (at the ends of small systems) is bounded by every system's.
    ids = slot_system.reshape(leaves, size)
    real = ~padding.reshape(leaves, size)
    lowest = jnp.min(jnp.where(real, ids, jnp.iinfo(ids.dtype).max), axis=1)
    highest = jnp.max(jnp.where(real, ids, jnp.iinfo(ids.dtype).min), axis=1)
    one = lowest == highest
    lattices = placed.lattice * tree.scale
    offsets = _offsets(table, lattices)  # (M, B, e)
    own = jnp.where(one[None, :, None], offsets[:, jnp.where(one, lowest, 0)], 0)
    farthest = jnp.where(one[None, :, None], own, jnp.max(offsets, axis=1)[:, None])
    nearest = jnp.where(one[None, :, None], own, jnp.min(offsets, axis=1)[:, None])
    leaf_lo, leaf_hi = tree._leaf_boxes()
    lo = (leaf_lo[None] - farthest).reshape(images * leaves, e)
    hi = (leaf_hi[None] - nearest).reshape(images * leaves, e)
    # A leaf of one system that is not periodic along the offset (or of padding
    # only): an empty box (lo above hi), which the walk skips.
    reachable = _reachable(table, placed.periodic[jnp.where(one, lowest, 0)])
    empty = (one & ~reachable) | ~jnp.any(real, axis=1)
    empty = empty.reshape(images * leaves, 1)
    return Block(
        points.reshape(images * leaves, size, e),
        jnp.where(empty, 1, lo),
        jnp.where(empty, -1, hi),
    )


def _offsets(table, lattice: Float[Array, "*batch d e"]) -> Array:
    """`table @ lattice` for one lattice, `(M, e)`, or one per row, `(M, *batch,
    e)`: `table[s] @ lattice[...]` as sums of products."""
    table = jnp.asarray(table, lattice.dtype)
    d = table.shape[1]
    extra = (slice(None),) + (None,) * (lattice.ndim - 2) + (None,)
    terms = [table[:, b][extra] * lattice[..., b, :][None] for b in range(d)]
    return sum(terms[1:], terms[0])


def _reachable(table, periodic: Bool[Array, "*batch d"]) -> Array:
    """Which offsets move only along periodic axes, `(M, *batch)`."""
    still = jnp.asarray(table) == 0
    extra = (slice(None),) + (None,) * (periodic.ndim - 1)
    return jnp.all(periodic[None] | still[extra + (slice(None),)], axis=-1)


def _walked_images(
    tree: KDTree, blocks: Block, table, r, capacity: int, self_loops, half
) -> Sink:
    """The sink of `_LeafEdges` records from a walk of every image of every leaf."""
    size, leaves = tree.leaf_size, tree.num_leaves
    image = jnp.repeat(jnp.arange(len(table), dtype=jnp.int32), leaves)
    leaf = jnp.tile(jnp.arange(leaves, dtype=tree.leaf_indices.dtype), len(table))
    senders = jnp.tile(tree.leaf_indices.reshape(leaves, size), (len(table), 1))
    zero = jnp.asarray(~table.any(axis=1))[image]
    positive = jnp.asarray(first_nonzero_positive(table))[image]
    r2 = search_threshold(tree, r, EUCLIDEAN)
    visitors = jax.vmap(
        lambda *fields: _LeafEdges(r2, *fields, self_loops=self_loops, half=half)
    )(leaf, image, senders, zero, positive)
    slot_dtype = tree.leaf_indices.dtype
    sink = Sink(
        (
            jnp.zeros(capacity, slot_dtype),
            jnp.zeros(capacity, slot_dtype),
            jnp.zeros(capacity, jnp.int32),
            jnp.zeros((capacity, -(-size // WORD)), jnp.uint32),
        ),
        jnp.zeros((), index_dtype_for(tree.n + 1)),
    )
    # Most images of most leaves lie beyond `r` of every point (all but those near
    # the faces): they are not walked.
    gap = jnp.maximum(
        jnp.maximum(blocks.lo - tree.node_hi[:, 0], tree.node_lo[:, 0] - blocks.hi), 0
    )
    near = jnp.all(blocks.lo <= blocks.hi, axis=1) & (jnp.sum(gap * gap, axis=1) <= r2)
    _, filled = walk_many(tree, blocks, visitors, EUCLIDEAN, sink=sink, active=near)
    assert filled is not None
    return filled


def _unsorted_edges(tree: KDTree, filled: Sink, capacity: int, index_dtype):
    """`(senders, receivers, images)` of the records' edges, padded with `(n, n,
    0)`."""
    n = tree.n
    # Records grouped by sender first (unused ones last): the edges then come out
    # nearly in order, which XLA:CPU's sort finishes much faster than shuffled ones,
    # for less than it spends here.
    slots = filled.records[0]
    used = jnp.arange(capacity) < filled.stored
    senders = jnp.where(used, rows_at(tree.leaf_indices, slots), n)
    order = argsort_keys(senders.astype(jnp.uint32))
    slots, leaves_of, images_of, masks = (a[order] for a in filled.records)
    record, a, b, found = unpacked(slots, leaves_of, masks, capacity, tree.leaf_size)
    sender = jnp.where(found, rows_at(tree.leaf_indices, a), n).astype(index_dtype)
    receiver = jnp.where(found, rows_at(tree.leaf_indices, b), n).astype(index_dtype)
    return sender, receiver, jnp.where(found, images_of[record], 0)


@eqx.filter_jit
def _knn_graph(
    points,
    k: int,
    cell,
    segment,
    systems: int | None,
    counts,
    self_loops,
    leaf_size,
    engine: str,
):
    n, d = points.shape
    index_dtype = index_dtype_for(n + 1)
    table = shift_table(counts, d)
    if n == 0:
        return _empty_graph(points, 0, index_dtype, segment, systems)
    placed = _placed(points, cell, segment, table, _beyond_every_candidate)
    system = system_of(cell, segment)
    tree = lax.stop_gradient(KDTree(placed.points, leaf_size=leaf_size, engine=engine))
    wanted = k if self_loops else k + 1
    centre = len(table) // 2  # the zero offset
    unbounded = jnp.asarray(jnp.inf, points.dtype)
    d_own, j_own = _nearest(tree, placed.points, unbounded, wanted)
    s_own = jnp.full(j_own.shape, centre, jnp.int32)
    own = jnp.arange(n, dtype=j_own.dtype)[:, None]

    # The own image's neighbours, in order, less the point itself and other
    # segments' points (and missing ones): those at `(inf, n)` after the rest.
    unwanted = _of_other_segments(j_own, own[:, 0], segment, n)
    if not self_loops:
        unwanted = unwanted | (j_own == own)
    slots = jnp.cumsum(~unwanted, axis=1, dtype=jnp.int32) - 1
    slots = jnp.where(unwanted, wanted, slots)
    fills = (jnp.inf, n, centre)
    best = placed_in_rows(slots, (d_own, j_own, s_own), fills, wanted)
    others = np.asarray([s for s in range(len(table)) if s != centre], np.int32)
    if len(others):
        best = _with_other_images(
            tree, placed, table, others, segment, system, best, k, wanted
        )
    distances, receivers, images = (a[:, :k] for a in best)
    farthest = distances[:, -1]
    receivers, images = sort_edges_in_rows(receivers, images)
    valid = receivers < n
    senders = jnp.where(valid, own, n).astype(index_dtype).reshape(-1)
    receivers = receivers.astype(index_dtype).reshape(-1)
    images = images.reshape(-1)
    count = jnp.sum(valid, dtype=index_dtype)
    edges = _padding_last(valid.reshape(-1), senders, receivers, images, n)
    graph = _graph(
        points, cell, segment, systems, table, placed.wraps, edges, count, n * k
    )
    # A point short of `k` candidates in a periodic cell may miss farther images.
    return checked_reach(
        graph, cell, counts, farthest, "A point's k-th neighbour", system
    )


def _with_other_images(
    tree: KDTree, placed: _Placed, table, others, segment, system, best, k, wanted
):
    """`best`, the `wanted` nearest `(distance, receiver, image)` of each point, with
    the images `others` searched too: only those images of points that may lie
    within the point's k-th distance of its segment's box (in a periodic cell, the
    points near the faces an image crosses), as one list, point by point, `chunk` at
    a time. A chunk's candidates and the best of its points are merged by one sort
    keyed by the point; a point whose images span two chunks merges twice."""
    n = tree.n
    index_dtype = best[1].dtype
    count_of = len(others)
    points, dtype = placed.points, placed.points.dtype
    shifts = jnp.asarray(table, dtype)[jnp.asarray(others)]  # (M, d)

    def offsets(image: Int[Array, " m"], rows: Int[Array, " m"]) -> Array:
        """The offset of image `image[i]` (of `others`) of point `rows[i]`."""
        lattice = placed.lattice[0] if system is None else placed.lattice[system][rows]
        shift = shifts[image]
        terms = [shift[:, b, None] * lattice[..., b, :] for b in range(table.shape[1])]
        return sum(terms[1:], terms[0])

    # The k-th best so far (the point itself, unshifted, is never one of them; ties
    # at the k-th enter).
    bound = jnp.nextafter(best[0][:, k - 1], jnp.inf)
    lo, hi = _segment_boxes(points, segment)

    def needed_of(image):
        """Which points' image `image` is searched: an offset along an axis a
        point's system is not periodic along finds nothing."""
        shift = shifts[image][None]
        if system is None:
            x = points - _offsets(shift, placed.lattice[0])[0]
            reachable = True
        else:
            x = points - _offsets(shift, placed.lattice[system])[0]
            reachable = _reachable(shift, placed.periodic[system])[0]
        return reachable & ~_surely_beyond(x, lo, hi, bound)

    needed = lax.map(needed_of, jnp.arange(count_of, dtype=jnp.int32))  # (M, n)
    per_point = jnp.sum(needed, axis=0, dtype=index_dtype)
    running = jnp.cumsum(per_point, dtype=index_dtype)
    total, first_place = running[-1], running - per_point
    chunk = _image_chunk(n)

    def one_chunk(carry):
        c, best = carry
        start = c * chunk
        places = start + jnp.arange(chunk, dtype=index_dtype)
        valid = places < total
        # The point of each place, and which of its needed images.
        rows = jnp.where(valid, set_positions(running, places), 0)
        nth = places - rows_at(first_place, rows)
        seen = jnp.cumsum(rows_at(needed.T, rows), axis=1, dtype=index_dtype)
        image = jnp.sum(seen <= nth[:, None], axis=1, dtype=jnp.int32)
        image = jnp.minimum(image, count_of - 1)
        x = rows_at(points, rows) - offsets(image, rows)
        bounds = jnp.where(valid, rows_at(bound, rows), 0)
        distances, receivers = _nearest(tree, x, bounds, wanted)
        images = jnp.broadcast_to(jnp.asarray(others)[image][:, None], receivers.shape)
        # Each point's best joins its first row of the chunk.
        index = jnp.arange(chunk)
        first = valid & ((index == 0) | (rows != jnp.roll(rows, 1)))
        own = tuple(rows_at(a, rows) for a in best)
        own = (
            jnp.where(first[:, None], own[0], jnp.inf),
            jnp.where(first[:, None], own[1], n),
            own[2],
        )
        distances = jnp.concatenate([own[0], distances], axis=1)
        receivers = jnp.concatenate([own[1], receivers.astype(index_dtype)], axis=1)
        images = jnp.concatenate([own[2], images], axis=1)
        unwanted = _of_other_segments(receivers, rows, segment, n)
        distances = jnp.where(unwanted, jnp.inf, distances)
        receivers = jnp.where(unwanted, n, receivers)
        owners = jnp.broadcast_to(jnp.where(valid, rows, n)[:, None], receivers.shape)
        keys = (owners, distances, receivers, images)
        owners, distances, receivers, images = lax.sort(
            tuple(a.reshape(-1) for a in keys), num_keys=4
        )
        # A point's first `wanted` entries: its own best is among them, so it has
        # at least that many.
        starts = jnp.searchsorted(owners, rows, side="left", method="scan")
        taken = starts[:, None] + jnp.arange(wanted)
        found = (distances[taken], receivers[taken], images[taken])
        # Put back by a gather of each point's first row of the chunk (no scatter).
        at_first = jnp.maximum(first_place, start)
        mine = (per_point > 0) & (at_first < jnp.minimum(running, start + chunk))
        at = jnp.clip(at_first - start, 0, chunk - 1)
        best = tuple(
            jnp.where(mine[:, None], rows_at(f, at), b) for f, b in zip(found, best)
        )
        return c + 1, best

    start = (jnp.zeros((), index_dtype), best)
    _, best = lax.while_loop(lambda c: c[0] * chunk < total, one_chunk, start)
    return best


def _of_other_segments(receivers, senders, segment, n: int) -> Bool[Array, "m c"]:
    """Which receivers (rows of candidates of `senders`) are missing (`n`) or lie
    in another segment than their sender."""
    missing = receivers >= n
    if segment is None:
        return missing
    return missing | (rows_at(segment, receivers) != rows_at(segment, senders)[:, None])


def _image_chunk(n: int) -> int:
    """How many images of points a `knn_graph` searches at once: a sixteenth of the
    points (in a periodic cell a few chunks hold the points near every face, edge
    and corner), but more than the walk's lanes, so that the search is the same
    program for every `n` (`tests/test_compile.py`)."""
    return min(n, max(IMAGE_CHUNK_AT_LEAST, -(-n // IMAGE_CHUNK_FRACTION)))


IMAGE_CHUNK_AT_LEAST = 2048
IMAGE_CHUNK_FRACTION = 16


def _nearest(tree: KDTree, x, bound, wanted: int):
    """The `wanted` nearest within `bound`, padded with `(inf, n)` beyond `n`."""
    found = _knn.knn(tree, x, bound, min(wanted, tree.n), EUCLIDEAN)
    missing = wanted - found[1].shape[1]
    pad = ((0, 0), (0, missing))
    return (
        jnp.pad(found[0], pad, constant_values=jnp.inf),
        jnp.pad(found[1], pad, constant_values=tree.n),
    )


def _beyond_every_candidate(wrapped, offsets):
    """A separation of segments beyond any candidate distance within one: the span
    of the wrapped points plus the farthest image offset."""
    span = norm_without_overflow(jnp.max(wrapped, axis=0) - jnp.min(wrapped, axis=0))
    return _apart(2 * (span + jnp.max(norm_without_overflow(offsets))), wrapped)


def _apart(distance, wrapped):
    """A separation of segments along their axis: `distance` plus the points'
    largest coordinate, so that it is not lost in the tree's scaled coordinates (a
    separation far below the coordinates, of identical points far from the origin
    say, squared to zero there and joined the segments), and nonzero."""
    apart = distance + jnp.max(jnp.abs(wrapped), initial=0)
    return jnp.where(apart > 0, apart, 1)


def _padding_last(valid, senders, receivers, images, n):
    """The entries where `valid`, in order, then padding `(n, n, 0)`."""
    position = jnp.where(valid, jnp.cumsum(valid) - 1, valid.shape[0])

    def out(a, fill):
        return jnp.full_like(a, fill).at[position].set(a, mode="drop")

    return out(senders, n), out(receivers, n), out(images, 0)


def _empty_graph(
    points, capacity: int, index_dtype, segment, systems: int | None
) -> NeighborGraph:
    n, d = points.shape
    return NeighborGraph(
        jnp.full(capacity, n, index_dtype),
        jnp.full(capacity, n, index_dtype),
        jnp.zeros((capacity, d), jnp.int32),
        jnp.full(capacity, jnp.inf, points.dtype),
        jnp.zeros((), index_dtype),
        jnp.zeros((), bool),
        segment,
        systems,
    )
