"""Euclidean distances, optionally with periodic axes (minimum image), and safe norms.

`period` is `None` (no periodic axis) or a `(d,)` array of box lengths, where a length
`<= 0` marks an axis as not periodic.
"""

import jax.lax as lax
import jax.numpy as jnp

from ._backend import sum_by_additions, sum_nonnegative
from ._custom_types import Array, Float


def _on_periodic_axes(transform, x: Float[Array, "... d"], period):
    """`transform(x, length)` on the periodic axes of `period`, `x` on the others."""
    if period is None:
        return x
    periodic = period > 0
    return jnp.where(periodic, transform(x, jnp.where(periodic, period, 1)), x)


def _nearest_image(diff, length):
    return diff - length * jnp.round(diff / length)


def _into_box(x, length):
    wrapped = x - length * jnp.floor(x / length)
    # x slightly below 0 can round to exactly L: that is the image 0.
    return jnp.where(wrapped >= length, wrapped - length, wrapped)


def minimum_image(diff: Float[Array, "... d"], period) -> Float[Array, "... d"]:
    """Wraps coordinate differences to the nearest periodic image."""
    return _on_periodic_axes(_nearest_image, diff, period)


def wrap_into_box(x: Float[Array, "... d"], period) -> Float[Array, "... d"]:
    """Maps coordinates into `[0, L)` on periodic axes (round-off included)."""
    return _on_periodic_axes(_into_box, x, period)


def squared_distances(x: Float[Array, " d"], points: Float[Array, "m d"], period):
    """The squared distances from `x` to each of `points`."""
    diff = minimum_image(points - x, period)
    return sum_nonnegative(diff * diff)


def squared_distance_to_box(
    x: Float[Array, " d"], lo, hi, period, by_additions: bool = False
):
    """A lower bound on the squared distance from `x` to any point in the box.

    It is shrunk by a few ulps per dimension: a point on the box's nearest corner has
    the same exact distance, but the two sums may round differently (fused or not), and
    a bound one ulp too high would prune a tie that must be visited. `by_additions`
    sums by plain additions (see `kdeqx._backend.sum_by_additions`).
    """
    gap = jnp.maximum(jnp.maximum(lo - x, x - hi), 0)
    if period is not None:
        # Both x and the box lie in [0, L): the images x - L and x + L are the others.
        below = jnp.maximum(lo - (x + period), 0) + jnp.maximum((x + period) - hi, 0)
        above = jnp.maximum(lo - (x - period), 0) + jnp.maximum((x - period) - hi, 0)
        gap = jnp.where(period > 0, jnp.minimum(gap, jnp.minimum(below, above)), gap)
    slack = 4 * (x.shape[-1] + 2) * jnp.finfo(x.dtype).eps
    squares = gap * gap
    total = sum_by_additions(squares) if by_additions else jnp.sum(squares, axis=-1)
    return total * (1 - slack)


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
