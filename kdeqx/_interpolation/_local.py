"""Local fits: interpolants solved per query on its `k` nearest points (local RBF,
moving least squares), and what they share: the neighbourhood in coordinates relative
to the query, polynomial terms, and evaluation in chunks of queries."""

import abc
import functools as ft
import itertools
import math
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _backend
from .._backend._mesh import cpu_devices_for, split_rows_over
from .._custom_types import Array, Float, Int
from .._engine._metric import EUCLIDEAN, minimum_image, Minkowski, unit_exponent
from .._floats import power_of_two


if TYPE_CHECKING:
    from .._tree._tree import AbstractKDTree


class AbstractLocalFit(eqx.Module):
    """An interpolant fitted, for each query, to its `k` nearest points."""

    @abc.abstractmethod
    def point_columns(self, n: int, dtype) -> Float[Array, "n c"]:
        """Per-point parameters gathered with each neighbour (`c` may be 0)."""

    @abc.abstractmethod
    def fit(
        self,
        offsets: Float[Array, "k d"],
        values: Float[Array, "k s"],
        columns: Float[Array, "k c"],
        unit: Int[Array, ""],
    ) -> Float[Array, " s"]:
        """The interpolant at one query, from its neighbours' offsets (neighbour minus
        query, minimum image in a periodic box) in units of `2**unit`, values and
        `point_columns`, nearest first. Written for one query; queries are mapped
        over in chunks.

        The unit brings the largest offset near 1, so that squared distances
        neither overflow nor underflow (float32 data beyond ~1e19 or below ~1e-19);
        a fit whose parameters have a length (a shape parameter, smoothing of a
        scale-invariant kernel) converts them with it."""


def monomial_powers(d: int, degree: int) -> tuple[tuple[int, ...], ...]:
    """The exponents of every monomial in `d` variables of degree at most `degree`
    (none for `degree = -1`), lowest degree first."""
    powers = []
    for total in range(degree + 1):
        for axes in itertools.combinations_with_replacement(range(d), total):
            powers.append(tuple(axes.count(axis) for axis in range(d)))
    return tuple(powers)


def count_monomials(d: int, degree: int) -> int:
    return math.comb(degree + d, d) if degree >= 0 else 0


def monomials(
    coordinates: Float[Array, "*batch d"], powers: tuple[tuple[int, ...], ...]
) -> Float[Array, "*batch r"]:
    """The monomials at `coordinates`, as products of coordinates (no `pow`, whose
    gradient at 0 is NaN)."""
    terms = []
    for exponents in powers:
        term = jnp.ones(coordinates.shape[:-1], coordinates.dtype)
        for axis, exponent in enumerate(exponents):
            for _ in range(exponent):
                term = term * coordinates[..., axis]
        terms.append(term)
    if not terms:
        return jnp.zeros((*coordinates.shape[:-1], 0), coordinates.dtype)
    return jnp.stack(terms, axis=-1)


def squared_norms(offsets: Float[Array, "*batch d"]) -> Float[Array, "*batch"]:
    """`|offset|^2`, by the metric's axis-by-axis sum (no square root)."""
    return EUCLIDEAN.powered_of_axes(
        [offsets[..., a] for a in range(offsets.shape[-1])]
    )


# Jitted: called eagerly, the fit is traced and compiled once per shape, not on every
# call (its chunked map would otherwise be traced anew each time).
@eqx.filter_jit
def interpolate_locally(
    tree: "AbstractKDTree",
    x: Float[Array, "*batch d"],
    values: Float[Array, "n ..."],
    k: int,
    metric: Minkowski,
    fit: AbstractLocalFit,
) -> Float[Array, "..."]:
    """`fit` at each query, on its `k` nearest points of `tree`."""
    n, d = tree.n, tree.d
    flat_values = values.reshape(n, -1)
    extra = fit.point_columns(n, values.dtype)
    table = jnp.concatenate([tree._points(), flat_values, extra], axis=1)
    _, _, rows = tree._knn_rows(x, k, table, metric)
    batch = x.shape[:-1]
    rows = rows.reshape(-1, k, table.shape[1])
    offsets = minimum_image(rows[..., :d] - x.reshape(-1, 1, d), tree.period)
    s = flat_values.shape[1]
    value_rows, extra_rows = rows[..., d : d + s], rows[..., d + s :]

    arrays = (offsets, value_rows, extra_rows)
    fit_in_unit = ft.partial(_fit_in_unit, fit)
    devices = cpu_devices_for(tree, x)
    if len(devices) < 2:
        fitted = _map_in_chunks(fit_in_unit, arrays)
    else:
        # Each device fits its own queries: left to XLA, a sequential map over chunks
        # is not split, and every device fitted every query (see
        # `benchmarks/interpolate.py`, `--cpu-devices`).
        fitted = split_rows_over(
            devices, lambda *a: _map_in_chunks(fit_in_unit, a), arrays
        )
    return fitted.reshape(*batch, *values.shape[1:])


def _fit_in_unit(fit: AbstractLocalFit, offsets, values, columns):
    """`fit.fit` with the offsets in a unit (a power of two) near the largest."""
    unit = unit_exponent(jnp.max(jnp.abs(offsets)))
    in_unit = offsets * power_of_two(-unit, offsets.dtype)
    return fit.fit(in_unit, values, columns, unit)


def _map_in_chunks(fn, arrays):
    """`vmap(fn)` over the leading axis of `(offsets, values, columns)`, in sequential
    chunks of at most `_backend.fit_chunk` queries (sized by a `(k + r) x (k + r)`
    system: it bounds the temporaries of a local RBF).

    The queries are padded (with copies of the first) to whole chunks rather than
    leaving a remainder, so that the fit is compiled once, as the loop's body.
    """
    offsets, _, columns = arrays
    q, k = offsets.shape[:2]
    system = (k + columns.shape[-1]) ** 2 * offsets.dtype.itemsize
    chunk = max(1, min(_backend.fit_chunk(system), q))
    chunks = -(-q // chunk)
    padded = [
        jnp.concatenate(
            [a, jnp.broadcast_to(a[:1], (chunks * chunk - q, *a.shape[1:]))]
        )
        for a in arrays
    ]
    shaped = [a.reshape(chunks, chunk, *a.shape[1:]) for a in padded]
    fitted = jax.lax.map(lambda parts: jax.vmap(fn)(*parts), shaped)
    return fitted.reshape(chunks * chunk, *fitted.shape[2:])[:q]
