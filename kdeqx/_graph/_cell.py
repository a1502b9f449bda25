"""Periodic cells of any shape, one for every point or one per system of a batch: a
lattice whose rows are the cell vectors, periodic along some of them, and the images
of the cell that a cutoff reaches."""

import itertools
import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from .._custom_types import Array, ArrayLike, Bool, Float, Int, PyTree
from .._validate import as_float_array, check_finite, check_static_int, is_concrete


class Cell(eqx.Module):
    """Periodic cells, one per system. The rows of `lattice[b]` are the cell vectors
    `a_1 .. a_d` of system `b`; a point `x` of it has fractional coordinates `f` with
    `x = f @ lattice[b]`, and is periodic along `a_i` where `periodic[b, i]`.

    The methods take each point's system, `system` (ids `0 .. B - 1`), or `None`
    when one cell holds every point (`B == 1`)."""

    lattice: Float[Array, "systems d d"]
    periodic: Bool[Array, "systems d"]
    # Periodic in some system: the axes along which images are searched.
    axes: tuple[bool, ...] = eqx.field(static=True)
    # Given as one cell per system (the points pick theirs by `batch` id).
    per_system: bool = eqx.field(static=True)

    def fractional(
        self, x: Float[Array, "n d"], system: Int[Array, " n"] | None = None
    ) -> Float[Array, "n d"]:
        """`x @ inv(lattice)`, axis by axis: a LAPACK solve per call, or a `(n, d)`
        by `(d, d)` dot, cost XLA:CPU far more on one core than these sums."""
        return _columns_times(x, _per_point(jnp.linalg.inv(self.lattice), system))

    def cartesian(
        self, f: Float[Array, "n d"], system: Int[Array, " n"] | None = None
    ) -> Float[Array, "n d"]:
        """`f @ lattice`, axis by axis (see `fractional`)."""
        return _columns_times(f, _per_point(self.lattice, system))

    def wrapped(
        self, x: Float[Array, "n d"], system: Int[Array, " n"] | None = None
    ) -> tuple[Float[Array, "n d"], Int[Array, "n d"]]:
        """`(x - w @ lattice, w)`: the points moved into their cell along its periodic
        axes (fractional coordinates in `[0, 1)`) by whole cell vectors `w`."""
        periodic = self.periodic_axes(system)
        whole = jnp.where(periodic, jnp.floor(self.fractional(x, system)), 0)
        return x - self.cartesian(whole, system), whole.astype(jnp.int32)

    def periodic_axes(
        self, system: Int[Array, " n"] | None = None
    ) -> Bool[Array, "..."]:
        """Which axes are periodic: `(d,)` for one cell, `(n, d)` per point."""
        return _per_point(self.periodic, system)

    def heights(self) -> Float[Array, "systems d"]:
        """The distances between opposite faces: `1 / |b_i|` for the reciprocal
        vectors `b_i`, the columns of `inv(lattice)`."""
        unit, scale = _near_one(self.lattice, jnp)
        return scale[..., 0] / jnp.linalg.norm(jnp.linalg.inv(unit), axis=-2)

    def reach(self, images: tuple[int, ...]) -> Float[Array, " systems"]:
        """How far every image beyond `images` cells along each periodic axis lies at
        least, per system (`inf` with no periodic axis): `min_i images[i] *
        height_i`."""
        reach = jnp.where(
            self.periodic,
            jnp.asarray(images, self.lattice.dtype) * self.heights(),
            jnp.inf,
        )
        return jnp.min(reach, axis=1)


def _per_point(array: Array, system: Int[Array, " n"] | None) -> Array:
    """The systems' rows as each point sees them: the one row, or each point's."""
    return array[0] if system is None else array[system]


def _columns_times(x: Float[Array, "n d"], matrix) -> Float[Array, "n d"]:
    """`x @ matrix` for one `(d, d)` matrix or one per point, `(n, d, d)`."""
    d = x.shape[1]
    return jnp.stack(
        [sum(x[:, b] * matrix[..., b, a] for b in range(d)) for a in range(d)], -1
    )


def as_cell(cell, pbc, d: int, dtype) -> tuple[Cell | None, int | None]:
    """`(cell, systems)`: `cell` (`None`, `(d,)` lengths, a `(d, d)` lattice, or one
    per system: `(B, d)` lengths or `(B, d, d)` lattices) and `pbc` (a bool, one per
    axis, or `(B, d)`) as a checked `Cell`, or `None` when nothing is periodic; and
    `B` for cells given per system, else `None`."""
    if cell is None:
        return None, None
    lattice, per_system = _lattices(as_float_array("cell", cell, dtype), d)
    systems = lattice.shape[0]
    periodic = _check_pbc(pbc, d, systems if per_system else None)
    lattice = _check_nondegenerate(check_finite("cell", lattice))
    axes = tuple(bool(a) for a in np.any(periodic, axis=0))
    count = systems if per_system else None
    if not any(axes):
        return None, count
    return Cell(lattice, jnp.asarray(periodic), axes, per_system), count


def _check_pbc(pbc, d: int, systems: int | None) -> np.ndarray:
    """`pbc` as `(B, d)` NumPy bools (`B = 1` for one cell)."""
    rows = 1 if systems is None else systems
    if isinstance(pbc, bool | np.bool_):
        return np.full((rows, d), bool(pbc))
    if isinstance(pbc, jax.core.Tracer):
        raise TypeError(
            "`pbc` must be concrete (Python or NumPy bools): it decides which cell "
            "images are searched."
        )
    if not isinstance(pbc, Sequence | np.ndarray | jax.Array):
        raise ValueError(
            f"`pbc` must be a bool or {d} bools (one per axis), got {pbc}."
        )
    periodic = np.asarray(pbc)
    shapes = f"({d},)" if systems is None else f"({d},) or ({systems}, {d})"
    if periodic.shape == (d,):
        periodic = np.broadcast_to(periodic, (rows, d))
    elif systems is None or periodic.shape != (systems, d):
        raise ValueError(
            f"`pbc` must be a bool or {d} bools (one per axis), got {pbc}: shape "
            f"{shapes}, one row per system of `cell`, got shape {periodic.shape}."
        )
    if periodic.dtype != np.bool_:
        raise TypeError(f"`pbc` must hold bools, got {pbc}.")
    return periodic


def _check_nondegenerate(lattice: Array) -> Array:
    """Rejects a cell whose volume is negligible beside its vectors' lengths (a
    singular or nearly flat cell, which has no fractional coordinates)."""
    message = "`cell` must span a volume: its vectors are linearly dependent"
    if is_concrete(lattice):  # in NumPy: nothing to compile for a first cell
        flat = _is_flat(np.asarray(lattice), np)
        if flat.any():
            which = "" if len(flat) == 1 else f" (the cell of system {flat.argmax()})"
            raise ValueError(message + which + ".")
        return lattice
    return eqx.error_if(lattice, jnp.any(_is_flat(lattice, jnp)), message + ".")


def _is_flat(lattice, xp):
    """Whether each cell is (nearly) flat, in NumPy or JAX (`xp`)."""
    unit, _ = _near_one(lattice, xp)
    lengths = xp.prod(xp.linalg.norm(unit, axis=-1), axis=-1)
    volume = xp.abs(xp.linalg.det(unit))
    return ~(volume > xp.sqrt(xp.finfo(lattice.dtype).eps) * lengths)


def _near_one(lattice, xp):
    """`(lattice / scale, scale)`, `scale` each cell's largest entry (1 for zeros):
    a cell of side 1e-30 or 1e30 is no less a cell, but its determinant and
    reciprocal norms would underflow or overflow."""
    largest = xp.max(xp.abs(lattice), axis=(-2, -1), keepdims=True)
    scale = xp.where(largest > 0, largest, 1).astype(lattice.dtype)
    return lattice / scale, scale


def checked_systems(segment: Int[Array, " n"], systems: int) -> Int[Array, " n"]:
    """`segment`, checked to hold system ids `0 .. systems - 1` (eagerly, or with
    `eqx.error_if` under `jit`)."""
    message = (
        f"`batch` ids must be system ids 0 .. {systems - 1}, one per cell of "
        "`cell` (or of `num_graphs`)."
    )
    if is_concrete(segment):
        ids = np.asarray(segment)
        if ids.size and (ids.min() < 0 or ids.max() >= systems):
            raise ValueError(f"{message} Got ids from {ids.min()} to {ids.max()}.")
        return segment
    bad = jnp.any((segment < 0) | (segment >= systems))
    return eqx.error_if(segment, bad, message)


def image_counts(cell: Cell | None, r: Array | None, images) -> tuple[int, ...]:
    """How many cells each periodic axis is searched on either side: `images` (an
    int, or one per axis) when given; else, for a concrete cutoff and cell, the
    fewest that hold every image within `r` in every system (`ceil(r / height)`);
    else 1."""
    if cell is None:
        return ()
    d = len(cell.axes)
    if images is not None:
        if isinstance(images, Sequence):
            if len(images) != d:
                raise ValueError(f"`images` must be an int or {d} ints, got {images}.")
            counts = tuple(check_static_int("images", m, 1) for m in images)
        else:
            counts = (check_static_int("images", images, 1),) * d
        if r is not None:
            checked_reach(r, cell, counts, r, "The cutoff `r`")
    elif r is not None and is_concrete(r) and is_concrete(cell.lattice):
        heights = np.asarray(cell.heights())
        periodic = np.asarray(cell.periodic)
        counts = tuple(
            max([1] + [math.ceil(float(r) / h) for h in heights[periodic[:, i], i]])
            for i in range(d)
        )
    else:
        counts = (1,) * d
    return tuple(m if p else 0 for m, p in zip(counts, cell.axes))


def shift_table(counts: tuple[int, ...], d: int) -> np.ndarray:
    """Every image offset in whole cells, `(M, d)` integers, in lexicographic order
    (the zero offset in the middle; `[[0] * d]` in free space)."""
    if not counts:
        return np.zeros((1, d), np.int32)
    ranges = [range(-m, m + 1) for m in counts]
    return np.array(list(itertools.product(*ranges)), np.int32).reshape(-1, d)


def first_nonzero_positive(table: np.ndarray) -> np.ndarray:
    """Per offset, whether its first nonzero component is positive (one of each
    pair `S, -S`; neither for zero)."""
    nonzero = table != 0
    first = np.argmax(nonzero, axis=1)
    return nonzero.any(axis=1) & (table[np.arange(len(table)), first] > 0)


def checked_reach(
    value: PyTree,
    cell: Cell | None,
    images,
    farthest,
    what: str,
    system: Int[Array, " n"] | None = None,
):
    """`value`, carrying an error (eager, or `eqx.error_if` under `jit`) if some
    image beyond those searched could lie within `farthest`: a scalar for every
    system, or one per point (of the points' `system`)."""
    if cell is None:
        return value
    reach = cell.reach(images)
    if jnp.ndim(farthest) == 0:
        reach = jnp.min(reach)
    else:
        reach = _per_point(reach, system)
    short: Bool[Array, ""] = jnp.any(farthest > reach)
    message = (
        f"{what} reaches beyond the {images} cell images searched along the periodic "
        "axes: pass `images=` with more (each is at least one cell height away)."
    )
    if is_concrete(short) and is_concrete(value):
        if bool(short):
            raise ValueError(message)
        return value
    return eqx.error_if(value, short, message)


def as_lattice(
    cell: ArrayLike | None, d: int, dtype
) -> tuple[Float[Array, "systems d d"] | None, bool]:
    """`(lattices, per_system)`: a cell given as lengths or a lattice, or one per
    system, as `(B, d, d)` lattices (`B = 1` for one cell; no value checks)."""
    if cell is None:
        return None, False
    return _lattices(jnp.asarray(cell, dtype), d)


def _lattices(lattice: Array, d: int) -> tuple[Float[Array, "systems d d"], bool]:
    """`as_lattice` of an array. A `(d, d)` array is one lattice, never `d`
    systems' lengths."""
    shape = lattice.shape
    per_system = shape not in ((d,), (d, d))
    if per_system and shape[1:] not in ((d,), (d, d)):
        raise ValueError(
            f"`cell` must be the box lengths, shape ({d},), or a lattice whose rows "
            f"are the cell vectors, shape ({d}, {d}); or one per system, shape "
            f"(B, {d}) or (B, {d}, {d}); got shape {shape}."
        )
    if lattice.ndim == 1 or (per_system and lattice.ndim == 2):
        lattice = jax.vmap(jnp.diag)(lattice.reshape(-1, d))
    return lattice.reshape(-1, d, d), per_system
