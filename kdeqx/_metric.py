"""Euclidean distances, optionally with periodic axes (minimum image), and safe norms.

`period` is `None` (no periodic axis) or a `(d,)` array of box lengths, where a length
`<= 0` marks an axis as not periodic.
"""

import jax.lax as lax
import jax.numpy as jnp

from ._custom_types import Array, Float


def minimum_image(diff: Float[Array, "... d"], period) -> Float[Array, "... d"]:
    """Wraps coordinate differences to the nearest periodic image."""
    if period is None:
        return diff
    periodic = period > 0
    length = jnp.where(periodic, period, 1)
    wrapped = diff - length * jnp.round(diff / length)
    return jnp.where(periodic, wrapped, diff)


def wrap_into_box(x: Float[Array, "... d"], period) -> Float[Array, "... d"]:
    """Maps coordinates into `[0, L)` on periodic axes (round-off included)."""
    if period is None:
        return x
    periodic = period > 0
    length = jnp.where(periodic, period, 1)
    wrapped = x - length * jnp.floor(x / length)
    # x slightly below 0 can round to exactly L: that is the image 0.
    wrapped = jnp.where(wrapped >= length, wrapped - length, wrapped)
    return jnp.where(periodic, wrapped, x)


def sum_of_squares(values: Float[Array, "... d"], by_additions: bool = False):
    """The sum of squares over the last axis.

    With `by_additions`, summed by plain additions rather than a reduction. XLA:CPU
    hands float reductions over at least 4096 elements to YNNPACK kernels, which cost
    far more per call than the additions fused into their neighbours: the descent of
    all queries to their nearest leaves ran ~1.5x faster by additions. Inside the lane
    loop the reduction is faster.

    Use it only where any answer is safe, as in choosing the leaf a walk starts from.
    Leaf distances summed this way made XLA:CPU return wrong k-nearest neighbours
    (d = 8, float32, in a vmapped walk): right with `--xla_disable_hlo_passes=algsimp`,
    so a miscompile in XLA's algebraic simplifier, which the test suite caught.
    """
    squares = values * values
    if not by_additions:
        return jnp.sum(squares, axis=-1)
    total = squares[..., 0]
    for i in range(1, values.shape[-1]):
        total = total + squares[..., i]
    return total


def squared_distances(x: Float[Array, " d"], points: Float[Array, "m d"], period):
    """The squared distances from `x` to each of `points`.

    Summed by one reduction with two outputs, the sum and the largest square; their
    maximum is the sum, bit for bit (a rounded sum of non-negative terms is never
    below one of them). XLA:CPU hands a plain float sum to a YNNPACK kernel but keeps
    this one in its own loop emitter, where kNN queries ran ~1.2x faster. (Plain
    additions, the other way around YNNPACK, were miscompiled: see `sum_of_squares`.)
    """
    diff = minimum_image(points - x, period)
    squares = diff * diff
    zero = jnp.zeros((), squares.dtype)
    total, largest = lax.reduce(
        (squares, squares),
        (zero, zero),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
        (squares.ndim - 1,),
    )
    return jnp.maximum(total, largest)


def squared_distance_to_box(
    x: Float[Array, " d"], lo, hi, period, by_additions: bool = False
):
    """A lower bound on the squared distance from `x` to any point in the box.

    It is shrunk by a few ulps per dimension: a point on the box's nearest corner has
    the same exact distance, but the two sums may round differently (fused or not), and
    a bound one ulp too high would prune a tie that must be visited. `by_additions`
    is as in `sum_of_squares`.
    """
    gap = jnp.maximum(jnp.maximum(lo - x, x - hi), 0)
    if period is not None:
        # Both x and the box lie in [0, L): the images x - L and x + L are the others.
        below = jnp.maximum(lo - (x + period), 0) + jnp.maximum((x + period) - hi, 0)
        above = jnp.maximum(lo - (x - period), 0) + jnp.maximum((x - period) - hi, 0)
        gap = jnp.where(period > 0, jnp.minimum(gap, jnp.minimum(below, above)), gap)
    slack = 4 * (x.shape[-1] + 2) * jnp.finfo(x.dtype).eps
    return sum_of_squares(gap, by_additions) * (1 - slack)


def safe_norm(diff: Float[Array, "... d"]) -> Float[Array, "..."]:
    """Euclidean norm over the last axis whose gradient at zero is zero, not NaN."""
    d2 = jnp.sum(diff * diff, axis=-1)
    positive = d2 > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, d2, 1)), 0)


def norm_without_overflow(
    diff: Float[Array, "... d"], largest: Float[Array, "... 1"] | None = None
) -> Float[Array, "..."]:
    """`safe_norm` of `diff` brought near 1 by a power of two first, so that the
    squares neither overflow nor underflow (float32 differences beyond ~1e19 would
    square to `inf`).

    The power of two is exact and held constant under differentiation (the norm is
    homogeneous, so the derivatives are exact). It is kept within the normal range
    together with its reciprocal: XLA:CPU divides by multiplying by the reciprocal,
    and flushes a subnormal one to zero. `largest`, when given, is `max |diff|` along
    the last axis (kept).
    """
    if largest is None:
        largest = jnp.max(jnp.abs(diff), axis=-1, keepdims=True)
    largest = lax.stop_gradient(largest)
    info = jnp.finfo(diff.dtype)
    _, exponent = jnp.frexp(jnp.where(jnp.isfinite(largest), largest, 1))
    exponent = jnp.clip(exponent - 1, info.minexp + 1, info.maxexp - 2)
    one = jnp.ones((), diff.dtype)
    scaled = diff * jnp.ldexp(one, -exponent)
    return safe_norm(scaled) * jnp.ldexp(one, exponent)[..., 0]
