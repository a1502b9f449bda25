"""What every query kind shares around its visitor: batches of queries, per-query or
shared thresholds, empty trees, far queries, and differentiable distances.

A query kind is a visitor (`kdeqx._traverse.AbstractVisitor`) and a few lines that
turn its final states into answers:

```python
states, far = search(tree, x, r, lambda r2: _BallCount(r2, count_dtype), metric)
return jnp.where(far.beyond(far.distance <= r), 0, states)
```
"""

import functools as ft
from collections.abc import Callable

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Bool, Float, Int, PyTree
from .._floats import binary_exponent, power_of_two
from ._base import AbstractSearchTree
from ._blocks import walk_blocks
from ._metric import (
    minimum_image,
    Minkowski,
    norm_without_overflow,
    query_axes,
    wrap_into_box,
)
from ._traverse import AbstractVisitor, far_limit, walk_many


class FarQueries(eqx.Module):
    """Which queries lie beyond the search's clamp (`far_limit`), and each far
    query's distance to the tree's bounding box (NaN for the others): the distance to
    every point of the tree, to float precision.

    The walk answers a far query from its clamped position, which is nearer the tree:
    it ranks every point equal (so by index) and may admit points that are beyond the
    bound or radius. The query kinds drop those (`beyond`) and report `distance`.
    """

    far: Bool[Array, "*batch"]
    distance: Float[Array, "*batch"]

    def beyond(self, admits: Bool[Array, "*batch"]) -> Bool[Array, "*batch"]:
        """The far queries whose threshold test `admits(distance)` fails."""
        return self.far & ~admits


def far_queries(
    tree: AbstractSearchTree, x: Float[Array, "*batch d"], metric: Minkowski
) -> FarQueries:
    x = wrap_into_box(lax.stop_gradient(x), tree.period)
    scale = lax.stop_gradient(tree.scale)
    # `/ scale` as a product by the power of two `1 / scale`, built from its bits (a
    # division is a kernel of its own on XLA:CPU). Exact, but for data so small
    # that every coordinate is subnormal (zeros on XLA:CPU, which flushes them).
    unscale = power_of_two(-binary_exponent(scale), scale.dtype)
    lo, hi = (
        lax.stop_gradient(box[:, 0]) * unscale for box in (tree.node_lo, tree.node_hi)
    )
    # Axis by axis: reductions over the short last axis made this check a sizeable
    # share of a kNN query's compile (see `benchmarks/compile_work.py`).
    x_axes, _ = query_axes(x)
    gaps = [
        jnp.maximum(jnp.maximum(lo[j] - x_j, x_j - hi[j]), 0)
        for j, x_j in enumerate(x_axes)
    ]
    largest = ft.reduce(jnp.maximum, gaps)
    # Every clamped query is this far (the tree lies within 1 of the origin), and from
    # this far every point is at its distance, to float precision, anyway.
    far = largest * scale >= far_limit(x.dtype, x.shape[-1], metric) / 2
    # The gaps in units of a power of two near the largest (exact scalings), whose
    # powers neither overflow nor underflow.
    per_unit = power_of_two(-binary_exponent(largest), largest.dtype)
    powered = metric.powered_of_axes([g * per_unit for g in gaps])
    powered = jnp.where(far, powered, jnp.nan)
    # One array, NaN where not far, whose last step is a division (exact, by a power
    # of two): XLA:CPU computes it once, where it computed every cheaper last step
    # again, with the whole check, in each kernel that reads it (the kernels that end
    # a kNN query were several times larger).
    distance = metric.from_power(powered) / per_unit
    return FarQueries(far=~jnp.isnan(distance), distance=distance)


def search_threshold(
    tree: AbstractSearchTree, r: Float[Array, "*batch"], metric: Minkowski
) -> Float[Array, "*batch"]:
    """A distance `r` as a powered distance in the tree's scaled search coordinates.

    A power that overflows becomes the largest finite float, not `inf`: every real
    point's powered distance is finite (see `far_limit`), and leaf padding, at `inf`,
    must stay outside every ball.
    """
    # Behind a barrier: for an `r` it knows, XLA would square `r * scale` as
    # `r**2 * scale**2`, which is `inf * 0` (NaN) once `r**2` overflows (float32
    # radii beyond ~1e19 given as constants, say a literal in a jitted function).
    scaled = lax.optimization_barrier(r * lax.stop_gradient(tree.scale))
    return jnp.minimum(metric.to_power(scaled), jnp.finfo(scaled.dtype).max)


def search(
    tree: AbstractSearchTree,
    x: Float[Array, "*batch d"],
    threshold: Float[Array, "*batch"] | Float[Array, ""],
    make_visitor: Callable[[Float[Array, ""]], AbstractVisitor],
    metric: Minkowski,
) -> tuple[PyTree, FarQueries]:
    """Walks every query with the visitor for its threshold.

    **Arguments:**

    - `x`: queries, shape `(*batch, d)`, validated.
    - `threshold`: a distance (a bound or a radius), a scalar shared by all queries
        (one visitor for all: a smaller program) or one per query, of shape `batch`.
    - `make_visitor`: the visitor for a threshold given as a powered distance in the
        tree's search coordinates (`search_threshold`).
    - `metric`: the distance, and how approximate the search may be.

    **Returns:**

    `(states, far)`: the visitors' final states with leading axes `batch` (an empty
    tree, or no queries, gives the initial states) and the queries' `FarQueries`.
    """
    batch = x.shape[:-1]
    threshold2 = search_threshold(tree, threshold, metric)

    def in_batch(states):
        return jax.tree.map(lambda s: s.reshape(*batch, *s.shape[1:]), states)

    if tree.n == 0 or x.size == 0:
        visitors = jax.vmap(make_visitor)(jnp.broadcast_to(threshold2, batch).ravel())
        nowhere = FarQueries(
            far=jnp.zeros(batch, bool), distance=jnp.full(batch, jnp.inf, x.dtype)
        )
        return in_batch(jax.vmap(lambda v: v.init())(visitors)), nowhere
    flat_x = x.reshape(-1, tree.d)
    if threshold2.ndim == 0:
        visitors, axis = make_visitor(threshold2), None
    else:
        visitors, axis = jax.vmap(make_visitor)(threshold2.ravel()), 0
    if tree.engine == "blocks":
        states, _ = walk_blocks(tree, flat_x, visitors, metric, axis)
    else:
        states, _ = walk_many(tree, flat_x, visitors, metric, axis)
    return in_batch(states), far_queries(tree, x, metric)


def rows_at(values: Array, indices: Int[Array, "*batch k"]) -> Array:
    """`values[indices]` along the first axis, with some finite row (row 0, or zeros
    when there is none) at the sentinel `len(values)`."""
    n = values.shape[0]
    if n == 0:
        return jnp.zeros((*indices.shape, *values.shape[1:]), values.dtype)
    return values[jnp.where(indices < n, indices, 0)]


def neighbour_distances(
    tree: AbstractSearchTree,
    x: Float[Array, "*batch d"],
    indices: Int[Array, "*batch k"],
    p: float = 2.0,
) -> Float[Array, "*batch k"]:
    """Differentiable distances to the chosen rows of `points`; `inf` at sentinels."""
    if tree.n == 0:
        return jnp.full(indices.shape, jnp.inf, x.dtype)
    diff = minimum_image(x[..., None, :] - rows_at(tree.points, indices), tree.period)
    distances = norm_without_overflow(diff, metric=Minkowski(p))
    return jnp.where(indices < tree.n, distances, jnp.inf)


def found_distances(
    tree: AbstractSearchTree,
    x: Float[Array, "*batch d"],
    indices: Int[Array, "*batch k"],
    d2: Float[Array, "*batch k"],
    far: FarQueries,
    metric: Minkowski,
) -> Float[Array, "*batch k"]:
    """The distances to the found neighbours, `inf` at sentinels, from the powered
    distances `d2` the walk measured (in search coordinates; for far queries, their
    distance to the tree), with the derivatives of `neighbour_distances`.

    The values are the walk's (the ones it ranked by; a recomputation from the rows
    may differ in the last bit, as the sums round in another order), so a query's
    program needs no second pass over the neighbours' rows, a sizeable share of its
    compile work (see `benchmarks/compile_work.py`); only derivatives gather them.
    """
    measured = metric.from_power(d2) / lax.stop_gradient(tree.scale)
    measured = jnp.where(far.far[..., None], far.distance[..., None], measured)
    measured = jnp.where(indices < tree.n, measured, jnp.inf)
    return measured_distances(tree, x, indices, measured, metric.p)


def measured_distances(
    tree: AbstractSearchTree,
    x: Float[Array, "*batch d"],
    indices: Int[Array, "*batch k"],
    measured: Float[Array, "*batch k"],
    p: float,
) -> Float[Array, "*batch k"]:
    """Distances measured some other way (`inf` at sentinels), with the derivatives
    of `neighbour_distances(tree, x, indices, p)`."""
    return _differentiable(p, measured, tree, x, indices)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _differentiable(p, measured, tree, x, indices):
    """`measured`, differentiated as `neighbour_distances(tree, x, indices, p)`."""
    return measured


@_differentiable.defjvp
def _differentiable_jvp(p, primals, tangents):
    measured, tree, x, indices = primals
    _, tree_dot, x_dot, _ = tangents
    value, value_dot = jax.jvp(
        lambda t, y: neighbour_distances(t, y, indices, p), (tree, x), (tree_dot, x_dot)
    )
    # The value of `measured` (equal up to rounding), the derivatives of `value`, to
    # every order.
    return measured + (value - lax.stop_gradient(value)), value_dot
