"""Periodic cells of any shape: a lattice whose rows are the cell vectors, periodic
along some of them, and the images of the cell that a cutoff reaches."""

import itertools
import math
from collections.abc import Sequence

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._custom_types import Array, ArrayLike, Bool, Float, Int, PyTree
from .._validate import as_float_array, check_finite, check_static_int, is_concrete


class Cell(eqx.Module):
    """A periodic cell. The rows of `lattice` are the cell vectors `a_1 .. a_d`; a
    point `x` has fractional coordinates `f` with `x = f @ lattice`, and is periodic
    along `a_i` where `periodic[i]`."""

    lattice: Float[Array, "d d"]
    periodic: tuple[bool, ...] = eqx.field(static=True)

    def fractional(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        """`x @ inv(lattice)`, axis by axis: a LAPACK solve per call, or a `(n, d)`
        by `(d, d)` dot, cost XLA:CPU far more on one core than these sums."""
        inverse = jnp.linalg.inv(self.lattice)
        d = x.shape[1]
        return jnp.stack(
            [sum(x[:, b] * inverse[b, a] for b in range(d)) for a in range(d)], -1
        )

    def heights(self) -> Float[Array, " d"]:
        """The distances between opposite faces: `1 / |b_i|` for the reciprocal
        vectors `b_i`, the columns of `inv(lattice)`."""
        unit, scale = _near_one(self.lattice, jnp)
        return scale / jnp.linalg.norm(jnp.linalg.inv(unit), axis=0)

    def wrapped(
        self, x: Float[Array, "n d"]
    ) -> tuple[Float[Array, "n d"], Int[Array, "n d"]]:
        """`(x - w @ lattice, w)`: the points moved into the cell along its periodic
        axes (fractional coordinates in `[0, 1)`) by whole cell vectors `w`."""
        periodic = jnp.asarray(self.periodic)
        whole = jnp.where(periodic, jnp.floor(self.fractional(x)), 0)
        return x - self.cartesian(whole), whole.astype(jnp.int32)

    def cartesian(self, f: Float[Array, "n d"]) -> Float[Array, "n d"]:
        """`f @ lattice`, axis by axis (see `fractional`)."""
        d = f.shape[1]
        return jnp.stack(
            [sum(f[:, b] * self.lattice[b, a] for b in range(d)) for a in range(d)], -1
        )

    def reach(self, images: tuple[int, ...]) -> Float[Array, ""]:
        """How far every image beyond `images` cells along each periodic axis lies at
        least (`inf` with no periodic axis): `min_i images[i] * height_i`."""
        reach = jnp.where(
            jnp.asarray(self.periodic),
            jnp.asarray(images, self.lattice.dtype) * self.heights(),
            jnp.inf,
        )
        return jnp.min(reach)


def as_cell(cell, pbc, d: int, dtype) -> Cell | None:
    """`cell` (`None`, `(d,)` lengths or a `(d, d)` lattice) and `pbc` (a bool, or
    one per axis) as a checked `Cell`, or `None` for free space."""
    if cell is None:
        return None
    periodic = _check_pbc(pbc, d)
    lattice = as_float_array("cell", cell, dtype=dtype)
    if lattice.shape == (d,):
        lattice = jnp.diag(lattice)
    elif lattice.shape != (d, d):
        raise ValueError(
            f"`cell` must be the box lengths, shape ({d},), or a lattice whose rows "
            f"are the cell vectors, shape ({d}, {d}); got shape {lattice.shape}."
        )
    lattice = _check_nondegenerate(check_finite("cell", lattice))
    if not any(periodic):
        return None
    return Cell(lattice, periodic)


def _check_pbc(pbc, d: int) -> tuple[bool, ...]:
    if isinstance(pbc, bool | np.bool_):
        return (bool(pbc),) * d
    if not isinstance(pbc, Sequence | np.ndarray) or len(pbc) != d:
        raise ValueError(
            f"`pbc` must be a bool or {d} bools (one per axis), got {pbc}."
        )
    if not all(isinstance(p, bool | np.bool_) for p in pbc):
        raise TypeError(f"`pbc` must hold Python bools (it is static), got {pbc}.")
    return tuple(bool(p) for p in pbc)


def _check_nondegenerate(lattice: Array) -> Array:
    """Rejects a cell whose volume is negligible beside its vectors' lengths (a
    singular or nearly flat cell, which has no fractional coordinates)."""
    message = "`cell` must span a volume: its vectors are linearly dependent."
    if is_concrete(lattice):  # in NumPy: nothing to compile for a first cell
        if _is_flat(np.asarray(lattice), np):
            raise ValueError(message)
        return lattice
    return eqx.error_if(lattice, _is_flat(lattice, jnp), message)


def _is_flat(lattice, xp):
    """Whether the cell is (nearly) flat, in NumPy or JAX (`xp`)."""
    unit, _ = _near_one(lattice, xp)
    lengths = xp.prod(xp.linalg.norm(unit, axis=1))
    volume = xp.abs(xp.linalg.det(unit))
    return ~(volume > xp.sqrt(xp.finfo(lattice.dtype).eps) * lengths)


def _near_one(lattice, xp):
    """`(lattice / scale, scale)`, `scale` its largest entry (1 for zeros): a cell of
    side 1e-30 or 1e30 is no less a cell, but its determinant and reciprocal norms
    would underflow or overflow."""
    largest = xp.max(xp.abs(lattice))
    scale = xp.where(largest > 0, largest, 1).astype(lattice.dtype)
    return lattice / scale, scale


def image_counts(cell: Cell | None, r: Array | None, images) -> tuple[int, ...]:
    """How many cells each periodic axis is searched on either side: `images` (an
    int, or one per axis) when given; else, for a concrete cutoff and cell, the
    fewest that hold every image within `r` (`ceil(r / height)`); else 1."""
    if cell is None:
        return ()
    d = len(cell.periodic)
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
        counts = tuple(max(1, math.ceil(float(r) / h)) for h in heights)
    else:
        counts = (1,) * d
    return tuple(m if p else 0 for m, p in zip(counts, cell.periodic))


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


def checked_reach(value: PyTree, cell: Cell | None, images, farthest, what: str):
    """`value`, carrying an error (eager, or `eqx.error_if` under `jit`) if some
    image beyond those searched could lie within `farthest`."""
    if cell is None:
        return value
    short: Bool[Array, ""] = jnp.any(farthest > cell.reach(images))
    message = (
        f"{what} reaches beyond the {images} cell images searched along the periodic "
        "axes: pass `images=` with more (each is at least one cell height away)."
    )
    if is_concrete(short) and is_concrete(value):
        if bool(short):
            raise ValueError(message)
        return value
    return eqx.error_if(value, short, message)


def as_lattice(cell: ArrayLike | None, d: int, dtype) -> Float[Array, "d d"] | None:
    """A cell given as lengths or a lattice, as a lattice (no checks)."""
    if cell is None:
        return None
    lattice = jnp.asarray(cell, dtype)
    return jnp.diag(lattice) if lattice.ndim == 1 else lattice
