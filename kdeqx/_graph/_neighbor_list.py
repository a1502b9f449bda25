"""A neighbour list for molecular dynamics: a radius graph with a skin, allocated once
outside `jit` and updated inside it, rebuilt only when some particle has moved more
than half the skin since the last build."""

import math

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from .._backend import axes_at
from .._custom_types import Array, ArrayLike, Bool, Float, Int
from .._tree._tree import check_engine, check_points
from .._validate import as_float_array, check_finite, check_positive, check_static_int
from ._cell import Cell, image_counts
from ._graph import (
    _radius_graph,
    cell_and_segments,
    NeighborGraph,
    radius_edge_count,
    system_of,
    with_points,
)


class NeighborList(eqx.Module):
    """Every pair within `cutoff + skin` at the last build, with shifts that follow
    the particles: `edges` (a `NeighborGraph`, see `radius_graph`) holds the pairs
    and their shifts for the positions last given to `update`, and their distances
    *at the last build*. This step's are `graph(positions)` (or
    `edges.edge_vectors(positions, cell)`, which an energy needs anyway); the pairs
    within `cutoff` now are `within_cutoff(positions)`. As in jax-md, an update
    that does not rebuild measures nothing: it costs a displacement check.

    Build one with `NeighborList.allocate` (outside `jit`: it sizes the capacity),
    then call `update(positions)` at every step (inside `jit`; under `jax.vmap` too,
    for systems of one shape sharing the capacity). A batch of systems of different
    sizes, each in a cell of its own, is one list (`batch=` and one cell per
    system, as in `radius_graph`). `update` rebuilds the graph only
    when some particle has moved more than half the skin since the last build, so
    that no pair can have come within `cutoff` unseen. Positions may be wrapped into
    the cell between steps: the shifts follow the particles.

    A rebuild that finds more pairs than the capacity sets `overflow` (and keeps the
    true `edges.count`): check it outside `jit` (after a step or a block of steps)
    and `reallocate`, then redo those steps. Under `jax.vmap` JAX evaluates both
    sides of the rebuild decision (a `cond` becomes a `select`), so each step costs
    a rebuild; the answers are the same.
    """

    edges: NeighborGraph
    reference: Float[Array, "n d"]
    jumps: Int[Array, "n d"]
    cell: Cell | None
    batch: Int[Array, " n"] | None
    cutoff: Float[Array, ""]
    skin: Float[Array, ""]
    builds: Int[Array, ""]
    half: bool = eqx.field(static=True)
    images: tuple[int, ...] = eqx.field(static=True)
    num_systems: int | None = eqx.field(static=True)
    engine: str = eqx.field(static=True)

    @classmethod
    def allocate(
        cls,
        positions: ArrayLike,
        cutoff: ArrayLike,
        *,
        skin: ArrayLike,
        cell: ArrayLike | None = None,
        pbc: bool | tuple[bool, ...] | ArrayLike = True,
        batch: ArrayLike | None = None,
        half: bool = False,
        margin: float = 1.25,
        max_edges: int | None = None,
        images: int | tuple[int, ...] | None = None,
        engine: str = "auto",
    ) -> "NeighborList":
        """Builds the list for `positions` (shape `(n, d)`) with room for `margin`
        times the pairs found (at least one more), or for `max_edges` (static int;
        give systems batched with `jax.vmap` one capacity).

        **Arguments:** `cutoff > 0` and `skin >= 0` (scalars; the graph holds the
        pairs within `cutoff + skin`); `cell`, `pbc`, `batch`, `half` and `images`
        as in `radius_graph` (the cell, or the cells one per system, are fixed for
        the list's life; `images` defaults to what `cutoff + skin` needs), and
        `engine` as in `radius_graph` (for every rebuild). Eager: `cutoff`, `skin`
        and `cell` must be concrete.
        """
        positions = check_points("positions", positions)
        n, d = positions.shape
        dtype = positions.dtype
        cutoff = check_positive("cutoff", _finite("cutoff", cutoff, dtype), dtype)
        skin = _finite("skin", skin, dtype)
        if not float(skin) >= 0:
            raise ValueError(f"`skin` must be >= 0, got {float(skin)}.")
        if not margin >= 1:
            raise ValueError(f"`margin` must be >= 1, got {margin}.")
        engine = check_engine(engine)
        cell_, segment, systems = cell_and_segments(cell, pbc, batch, n, d, dtype)
        counts = image_counts(cell_, cutoff + skin, images)
        return cls._allocated(
            positions,
            cutoff,
            skin,
            cell_,
            segment,
            systems,
            half,
            margin,
            max_edges,
            counts,
            engine,
        )

    @classmethod
    def _allocated(
        cls,
        positions,
        cutoff,
        skin,
        cell,
        segment,
        systems,
        half,
        margin,
        max_edges,
        counts,
        engine,
    ) -> "NeighborList":
        """`allocate` with checked arguments."""
        n, d = positions.shape
        reach = cutoff + skin

        def pairs(capacity):
            return _pairs_in_reach(
                positions, reach, cell, segment, systems, capacity, counts, half, engine
            )

        def count():
            return _count_in_reach(
                positions, reach, cell, segment, counts, half, engine
            )

        if max_edges is not None:
            graph = pairs(check_static_int("max_edges", max_edges, 1))
        else:
            guess = _guessed_capacity(positions, reach, cell, segment, half, margin)
            graph = _sized(pairs, count, guess, margin, n)
        return cls(
            graph,
            positions,
            jnp.zeros((n, d), jnp.int32),
            cell,
            segment,
            cutoff,
            skin,
            jnp.ones((), jnp.int32),
            half,
            counts,
            systems,
            engine,
        )

    @property
    def max_edges(self) -> int:
        return self.edges.max_edges

    @property
    def overflow(self) -> Bool[Array, ""]:
        """Whether the last build found more pairs than the capacity."""
        return self.edges.overflow

    def graph(self, positions: ArrayLike) -> NeighborGraph:
        """`edges` with their distances measured for `positions` (those last given
        to `update`), differentiable in them."""
        positions = as_float_array("positions", positions, self.reference.dtype)
        lattice = None if self.cell is None else self.cell.lattice
        system = system_of(self.cell, self.batch)
        return with_points(self.edges, positions, lattice, system)

    def within_cutoff(self, positions: ArrayLike) -> Bool[Array, " edges"]:
        """Which edges are within `cutoff` at `positions` (the others are in the
        skin, or padding)."""
        return self.graph(positions).distances <= self.cutoff

    def update(self, positions: ArrayLike) -> "NeighborList":
        """The list for new `positions` (same shape): rebuilt if some particle moved
        more than `skin / 2` since the last build, else the same pairs with their
        shifts brought up to date (nothing measured)."""
        positions = as_float_array("positions", positions, self.reference.dtype)
        if positions.shape != self.reference.shape:
            raise ValueError(
                f"`positions` must have shape {self.reference.shape} (the list's), "
                f"got {positions.shape}; allocate a new list for a new system."
            )
        moved, jumps = self._displacements(lax.stop_gradient(positions))
        rebuild = jnp.max(jnp.sum(moved**2, axis=1), initial=0) > (self.skin / 2) ** 2
        return lax.cond(
            rebuild,
            lambda: self._rebuilt(positions),
            lambda: self._followed(positions, jumps),
        )

    def reallocate(self, positions: ArrayLike, margin: float = 1.25) -> "NeighborList":
        """A new list for `positions` with its capacity sized again (outside `jit`),
        for after an `overflow`."""
        positions = check_points("positions", positions)
        n, d = self.reference.shape
        if positions.shape[1] != d or (
            self.batch is not None and positions.shape[0] != n
        ):
            raise ValueError(
                f"`positions` must have shape {self.reference.shape} (the list's), "
                f"got {positions.shape}; allocate a new list for a new system."
            )
        if not margin >= 1:
            raise ValueError(f"`margin` must be >= 1, got {margin}.")
        counts = image_counts(self.cell, self.cutoff + self.skin, None)
        return NeighborList._allocated(
            positions.astype(self.reference.dtype),
            self.cutoff,
            self.skin,
            self.cell,
            self.batch,
            self.num_systems,
            self.half,
            margin,
            None,
            counts,
            self.engine,
        )

    def _displacements(self, positions):
        """Each particle's move since the build (the nearest image of it, in a cell)
        and the whole cell vectors it jumped by being wrapped."""
        if self.cell is None:
            return positions - self.reference, self.jumps
        cell = lax.stop_gradient(self.cell)
        system = system_of(cell, self.batch)
        change = cell.fractional(positions, system) - cell.fractional(
            self.reference, system
        )
        jumps = jnp.where(cell.periodic_axes(system), jnp.round(change), 0)
        return cell.cartesian(change - jumps, system), jumps.astype(jnp.int32)

    def _rebuilt(self, positions) -> "NeighborList":
        graph = _pairs_in_reach(
            positions,
            self.cutoff + self.skin,
            self.cell,
            self.batch,
            self.num_systems,
            self.max_edges,
            self.images,
            self.half,
            self.engine,
        )
        return eqx.tree_at(
            lambda s: (s.edges, s.reference, s.jumps, s.builds),
            self,
            (graph, positions, jnp.zeros_like(self.jumps), self.builds + 1),
        )

    def _followed(self, positions, jumps) -> "NeighborList":
        # x_j + S @ L - x_i keeps its value when x_j moves by a whole k_j @ L:
        # S changes by k_i - k_j.
        edges = self.edges
        change = jumps - self.jumps
        valid = edges.senders < positions.shape[0]

        def followed_shifts():
            at_senders = axes_at(change, edges.senders)
            at_receivers = axes_at(change, edges.receivers)
            moved = [a - b for a, b in zip(at_senders, at_receivers, strict=True)]
            return edges.shifts + jnp.where(valid[:, None], jnp.stack(moved, -1), 0)

        # Wraps are rare between two steps: the shifts mostly stay as they are.
        shifts = lax.cond(jnp.any(change != 0), followed_shifts, lambda: edges.shifts)
        return eqx.tree_at(
            lambda s: (s.edges.shifts, s.jumps),
            self,
            (shifts, jumps.astype(self.jumps.dtype)),
        )


_LEAF_SIZE = 32  # the trees' default


def _sized(pairs, count, guess: int | None, margin: float, n: int) -> NeighborGraph:
    """`pairs(capacity)` with room for `margin` times the pairs found (at least one
    more). The pairs are first collected into the capacity `guess`, and the graph is
    cut or padded to size: one search, and one program to compile, where the guess
    holds them all (a uniform liquid in its cell). Where it does not, that search
    has counted them, and a second collects them. Without a guess (partly periodic
    cells), `count()` comes first, a program of its own."""
    if guess is None:
        found = int(count())
    else:
        graph = pairs(guess)
        found = int(graph.count)
        if found <= guess:
            return _with_capacity(graph, _capacity_for(found, margin), n)
    return pairs(_capacity_for(found, margin))


def _capacity_for(found: int, margin: float) -> int:
    return max(1, math.ceil(found * margin) + 1)


def _guessed_capacity(positions, reach, cell, segment, half, margin) -> int | None:
    """The capacity for `margin` times the pairs within `reach` of points spread
    evenly over their cell (periodic along every axis) or, without one, their
    bounding box, summed over the systems of a batch; `None` for partly periodic
    cells, and where some system's points span no volume."""
    n, d = positions.shape
    if n < 2 or (cell is not None and not bool(jnp.all(cell.periodic))):
        return None
    ids = np.zeros(n, np.int64) if segment is None else np.asarray(segment)
    systems, system_of_point, sizes = np.unique(
        ids, return_inverse=True, return_counts=True
    )
    if cell is None:
        x = np.asarray(positions, np.float64)
        lo = np.full((len(systems), d), np.inf)
        hi = np.full((len(systems), d), -np.inf)
        np.minimum.at(lo, system_of_point, x)
        np.maximum.at(hi, system_of_point, x)
        volumes = np.prod(hi - lo, axis=1)
    else:
        volumes = np.abs(np.linalg.det(np.asarray(cell.lattice, np.float64)))
        volumes = volumes[systems if cell.per_system else np.zeros_like(systems)]
    paired = sizes > 1  # a lone point has no pairs, whatever its volume
    if not np.all(volumes[paired] > 0):
        return None
    ball = math.pi ** (d / 2) / math.gamma(d / 2 + 1) * float(reach) ** d
    others = sizes[paired] * ball / volumes[paired]
    if cell is None:  # no images: at most every other point
        others = np.minimum(others, sizes[paired] - 1)
    pairs = np.sum(sizes[paired] * others) / (2 if half else 1)
    return _capacity_for(int(pairs), margin)


def _with_capacity(graph: NeighborGraph, capacity: int, n: int) -> NeighborGraph:
    """`graph`, which holds all its edges, cut or padded to `capacity` edges."""
    kept = min(capacity, graph.max_edges)
    extra = capacity - kept

    def sized(a, fill):
        a = a[:kept]
        return jnp.concatenate([a, jnp.full((extra, *a.shape[1:]), fill, a.dtype)])

    return eqx.tree_at(
        lambda g: (g.senders, g.receivers, g.shifts, g.distances),
        graph,
        (
            sized(graph.senders, n),
            sized(graph.receivers, n),
            sized(graph.shifts, 0),
            sized(graph.distances, jnp.inf),
        ),
    )


def _count_in_reach(positions, reach, cell, segment, images, half, engine):
    """How many pairs [`_pairs_in_reach`][] finds, without collecting them."""
    return radius_edge_count(
        positions, reach, cell, segment, images, False, half, _LEAF_SIZE, engine
    )


def _pairs_in_reach(
    positions, reach, cell, segment, systems, capacity, images, half, engine
):
    """The radius graph within `reach` that a list holds (no self loops)."""
    return _radius_graph(
        positions,
        reach,
        cell,
        segment,
        systems,
        capacity,
        images,
        False,
        half,
        _LEAF_SIZE,
        engine,
    )


def _finite(name: str, value, dtype) -> Array:
    value = as_float_array(name, value, dtype)
    if value.ndim != 0:
        raise ValueError(f"`{name}` must be a scalar, got shape {value.shape}.")
    return check_finite(name, value)
