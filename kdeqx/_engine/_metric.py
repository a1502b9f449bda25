"""Minkowski distances, optionally with periodic axes (minimum image), and safe norms.

`period` is `None` (no periodic axis) or a `(d,)` array of box lengths, where a length
`<= 0` marks an axis as not periodic.
"""

import functools as ft
import math
from typing import Literal

import equinox as eqx
import jax
import jax.core
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from .._backend import sum_by_additions, sum_nonnegative
from .._custom_types import Array, Float
from .._floats import binary_exponent, power_of_two


def _on_periodic_axes(transform, x: Float[Array, "... d"], period):
    """`transform(x, length)` on the periodic axes of `period`, `x` on the others."""
    if period is None:
        return x
    periodic = period > 0
    return jnp.where(periodic, transform(x, jnp.where(periodic, period, 1)), x)


def _in_lengths(x, length):
    """`x / length`. XLA:CPU divides by multiplying by `1 / length`, which beyond
    `2**126` in float32 is subnormal and flushed to zero: such lengths divide in
    quarters, behind a barrier, since XLA would fold the quarters (and a length it
    knows, of a tree closed over by a `jit`) back into that reciprocal."""
    huge = length >= 2.0 ** -jnp.finfo(length.dtype).minexp
    quarters = jnp.where(huge, 0.25, 1).astype(length.dtype)
    x, length = lax.optimization_barrier((x * quarters, length * quarters))
    return x / length


def _nearest_image(diff, length):
    return diff - length * jnp.round(_in_lengths(diff, length))


def _into_box(x, length):
    wrapped = x - length * jnp.floor(_in_lengths(x, length))
    # x slightly below 0 can round to exactly L: that is the image 0.
    return jnp.where(wrapped >= length, wrapped - length, wrapped)


class Block(eqx.Module):
    """A block of points walked as one query (a leaf of a tree, in its search
    coordinates): the walk bounds their distances to a box by their bounding box's,
    and a leaf visit measures every point of the block to every point of the leaf.
    Padding rows may hold any value the visitor can tell from a point (`inf` puts
    them beyond every radius: their distances are `inf` or NaN).
    """

    points: Float[Array, "*batch size d"]
    lo: Float[Array, "*batch d"]
    hi: Float[Array, "*batch d"]

    @property
    def anchor(self) -> Float[Array, "*batch d"]:
        """The point that places the block on the walk's curve: its box's centre."""
        return (self.lo + self.hi) / 2


# A walk's query: one point, or a block of points.
Query = Float[Array, " d"] | Block


def minimum_image(diff: Float[Array, "... d"], period) -> Float[Array, "... d"]:
    """Wraps coordinate differences to the nearest periodic image."""
    return _on_periodic_axes(_nearest_image, diff, period)


def wrap_into_box(x: Float[Array, "... d"], period) -> Float[Array, "... d"]:
    """Maps coordinates into `[0, L)` on periodic axes (round-off included)."""
    return _on_periodic_axes(_into_box, x, period)


_SumBy = Literal["reduction", "nonnegative", "additions"]


class Minkowski(eqx.Module):
    """A search's distance: the Minkowski `p`-norm `(sum_j |x_j - y_j|**p)**(1/p)`
    (`max_j |x_j - y_j|` for `p = inf`), and scipy's approximation `eps`.

    The walk compares *powered* distances, `sum_j |x_j - y_j|**p` (the maximum for
    `p = inf`), which order as the distances do and need no root. `eps` (a scalar
    array, or `None` for an exact search) lets it skip a subtree whose nearest point is
    farther than `threshold / (1 + eps)`.
    """

    p: float = eqx.field(static=True)
    eps: Float[Array, ""] | None = None

    @property
    def is_max(self) -> bool:
        return self.p == math.inf

    def powered(self, diff: Float[Array, "... d"], summed_by: _SumBy = "reduction"):
        """The powered length of the coordinate differences `diff`, over the last axis.

        `summed_by` chooses how the terms are summed: by XLA's plain reduction, by
        `kdeqx._backend.sum_nonnegative` (fastest for a leaf's points) or by
        `kdeqx._backend.sum_by_additions`.
        """
        if self.is_max:
            return jnp.max(jnp.abs(diff), axis=-1)
        terms = self._terms(diff)
        if summed_by == "additions":
            return sum_by_additions(terms)
        if summed_by == "nonnegative":
            return sum_nonnegative(terms)
        return jnp.sum(terms, axis=-1)

    def powered_of_axes(self, diffs: list[Float[Array, "*shape"]]):
        """The powered length of coordinate differences given axis by axis: XLA:CPU
        vectorises this layout far better than a short last axis."""
        if self.is_max:
            return ft.reduce(jnp.maximum, [jnp.abs(diff) for diff in diffs])
        return ft.reduce(jnp.add, [self._terms(diff) for diff in diffs])

    def powered_of_axes_exactly(self, diffs: list[Float[Array, "*shape"]]):
        """`powered_of_axes`, rounded the same wherever it is computed: the terms
        stacked along a new leading axis and summed by one reduction, as
        `kdeqx._backend.sum_nonnegative` sums a last axis. Summed as plain
        additions, XLA may contract a product and an addition into one rounding in
        some places and not in others, and the same pair of points would get two
        distances (an exact tie would then be broken by a rounding, not by index)."""
        if self.is_max:
            return self.powered_of_axes(diffs)
        terms = jnp.stack([self._terms(diff) for diff in diffs])
        zero = jnp.zeros((), terms.dtype)
        total, largest = lax.reduce(
            (terms, terms),
            (zero, zero),
            lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
            (0,),
        )
        return jnp.maximum(total, largest)

    def _terms(self, diff):
        if self.p == 2:
            return diff * diff
        if self.p == 1:
            return jnp.abs(diff)
        return jnp.abs(diff) ** self.p

    def to_power(self, distance: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        """A distance as a powered distance: `distance**p` (itself for `p = inf`);
        one that overflows becomes the largest finite float."""
        if self.is_max or self.p == 1:
            return distance
        powered = distance * distance if self.p == 2 else distance**self.p
        return jnp.minimum(powered, jnp.finfo(powered.dtype).max)

    def from_power(self, powered: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        if self.is_max or self.p == 1:
            return powered
        if self.p == 2:
            return jnp.sqrt(powered)
        return powered ** (1 / self.p)

    def norm(self, diff: Float[Array, "... d"]) -> Float[Array, "..."]:
        """The norm over the last axis; its gradient at zero is zero, not NaN."""
        return self.root(self.powered(diff))

    def root(self, powered: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        """`from_power`, with a gradient of zero, not NaN, at zero."""
        if self.is_max or self.p == 1:
            return powered
        positive = powered > 0
        return jnp.where(positive, self.from_power(jnp.where(positive, powered, 1)), 0)

    @property
    def exponent_bound(self) -> int:
        """How many times a coordinate difference's exponent counts in a powered
        distance (for the overflow bound of `kdeqx._traverse.far_limit`)."""
        return 1 if self.is_max else math.ceil(self.p)

    def prunes_by(self, dtype) -> Float[Array, ""] | None:
        """The factor `(1 + eps)**p` by which the walk inflates its lower bounds on
        subtrees' powered distances, or `None` when it is exact."""
        if self.eps is None:
            return None
        one_plus = 1 + self.eps.astype(dtype)
        return one_plus if self.is_max else one_plus**self.p

    def accepts_within(self, r2: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        """The powered distance up to which a radius search with threshold `r2`
        accepts a point it meets: `r2` when exact; with `eps`, as scipy's,
        `(1 + eps)**p` times more. Subtrees beyond `r / (1 + eps)` are skipped, so
        every point within `r / (1 + eps)` is found and none beyond `r (1 + eps)`."""
        factor = self.prunes_by(r2.dtype)
        if factor is None:
            return r2
        accepted = jnp.where(r2 > 0, r2 * factor, r2)
        return jnp.minimum(accepted, jnp.finfo(r2.dtype).max)

    def box_lower_bound(self, x_axes: tuple[list, list], lo: list, hi: list, period):
        """A lower bound on the powered distance from a query (a point, or any point
        of a block; given axis by axis as `query_axes` gives it) to any point in the
        box given axis by axis (`lo[j]`, `hi[j]`).

        Axis by axis: with each box a row of `d` entries, every move of the walk
        summed over a short last axis, and on XLA:CPU kNN queries ran slower, the
        more so the more dimensions. The bound is shrunk by a few ulps per dimension:
        a point on the box's nearest corner has the same exact distance, but the two
        sums may round differently (fused or not), and a bound one ulp too high would
        prune a tie that must be visited.
        """
        x_lo, x_hi = x_axes
        gaps = []
        for j, (lo_j, hi_j) in enumerate(zip(lo, hi, strict=True)):
            gap = _gap_on_axis(x_lo[j], x_hi[j], lo_j, hi_j)
            if period is not None:
                # x and the box lie in [0, L): the other images are x - L and x + L.
                length = period[j]
                images = jnp.minimum(
                    _gap_on_axis(x_lo[j] + length, x_hi[j] + length, lo_j, hi_j),
                    _gap_on_axis(x_lo[j] - length, x_hi[j] - length, lo_j, hi_j),
                )
                gap = jnp.where(length > 0, jnp.minimum(gap, images), gap)
            gaps.append(gap)
        slack = 4 * (len(gaps) + 2) * self.exponent_bound * jnp.finfo(gaps[0].dtype).eps
        return self.powered_of_axes(gaps) * (1 - slack)

    def box_upper_bound(self, x: list, lo: list, hi: list, period):
        """An upper bound on the powered distance from a query point (given axis by
        axis) to any point in the box given axis by axis: on each axis, the farther
        side (at most half the period, in a periodic box). Grown by a few ulps per
        dimension, as `box_lower_bound` is shrunk: a point on the farthest corner
        may round to a larger distance in another sum."""
        gaps = []
        for j, (x_j, lo_j, hi_j) in enumerate(zip(x, lo, hi, strict=True)):
            gap = jnp.maximum(jnp.abs(x_j - lo_j), jnp.abs(hi_j - x_j))
            if period is not None:
                half = period[j] / 2
                gap = jnp.where(period[j] > 0, jnp.minimum(gap, half), gap)
            gaps.append(gap)
        slack = 4 * (len(gaps) + 2) * self.exponent_bound * jnp.finfo(gaps[0].dtype).eps
        return self.powered_of_axes(gaps) * (1 + slack)

    def leaf_distances(
        self, x: Query, points: Float[Array, "m d"], period
    ) -> Float[Array, "*size m"]:
        """The powered distances from `x` to each of `points`: shape `(m,)` from a
        point, `(size, m)` from a block of `size` points."""
        if isinstance(x, Block):
            # By additions: XLA:CPU vectorises a block's terms so far better than a
            # reduction over the short last axis.
            diff = minimum_image(points - x.points[:, None], period)
            return self.powered(diff, "additions")
        return self.powered(minimum_image(points - x, period), "nonnegative")


def query_axes(x: Float[Array, "*batch d"] | Block) -> tuple[list, list]:
    """A query's lowest and highest coordinates, axis by axis (a point's are the
    same; queries batched along leading axes give them batched). Split once for all
    the boxes a step measures: each split is a slice of its own in the program, which
    the compile pays for."""
    if isinstance(x, Block):
        return _axes(x.lo), _axes(x.hi)
    axes = _axes(x)
    return axes, axes


def _axes(v: Float[Array, "*batch d"]) -> list:
    return [v[..., j] for j in range(v.shape[-1])]


def _gap_on_axis(x_lo, x_hi, lo, hi):
    """On one axis, how far `[x_lo, x_hi]` (a point: `x_lo = x_hi`) lies outside
    `[lo, hi]`."""
    return jnp.maximum(jnp.maximum(lo - x_hi, x_lo - hi), 0)


EUCLIDEAN = Minkowski(2.0)


def check_norm(p, eps) -> Minkowski:
    """scipy's `p` (a Python number, `1 <= p <= inf`) and `eps` (`>= 0`, a number or a
    scalar array, checked like any value) as a `Minkowski`."""
    if isinstance(p, bool) or not isinstance(p, int | float | np.integer | np.floating):
        raise TypeError(
            f"`p` must be a Python number (it is static: it chooses the program), got "
            f"{type(p).__name__}."
        )
    if not p >= 1:  # NaN too
        raise ValueError(f"`p` must be >= 1 (a norm), got {p}.")
    if isinstance(eps, int | float | np.integer | np.floating) and not isinstance(
        eps, bool
    ):
        if not eps >= 0 or not math.isfinite(eps):
            raise ValueError(f"`eps` must be finite and >= 0, got {eps}.")
        return Minkowski(float(p), None if eps == 0 else jnp.asarray(float(eps)))
    eps = jnp.asarray(eps)
    real = jnp.issubdtype(eps.dtype, jnp.floating) or jnp.issubdtype(
        eps.dtype, jnp.integer
    )
    if eps.ndim != 0 or not real:
        raise ValueError(f"`eps` must be a real scalar, got {eps.dtype}{eps.shape}.")
    return Minkowski(float(p), _check_eps_value(eps))


def _check_eps_value(eps: Array) -> Array:
    eps = eps.astype(jnp.result_type(float))
    bad = ~(jnp.isfinite(eps) & (eps >= 0))
    if not isinstance(eps, jax.core.Tracer):
        if bool(bad):
            raise ValueError(f"`eps` must be finite and >= 0, got {eps}.")
        return eps
    return eqx.error_if(eps, bad, "`eps` must be finite and >= 0.")


def norm_without_overflow(
    diff: Float[Array, "... d"],
    largest: Float[Array, "... 1"] | None = None,
    metric: Minkowski = EUCLIDEAN,
) -> Float[Array, "..."]:
    """`metric.norm` of `diff` brought near 1 by a power of two first, so that the
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
    exponent = unit_exponent(largest)
    scaled = diff * power_of_two(-exponent, diff.dtype)
    return metric.norm(scaled) * power_of_two(exponent, diff.dtype)[..., 0]


def unit_exponent(largest: Float[Array, "*shape"]) -> Array:
    """`e` such that `largest / 2**e` lies in `[1, 2)`, clipped so that `2**e` and
    `2**-e` are normal numbers (held constant under differentiation): a unit in
    which lengths up to `largest` can be squared without overflow or underflow.
    Zero, subnormal (which XLA:CPU flushes to zero) or non-finite `largest` gives
    `e = 0`."""
    info = jnp.finfo(largest.dtype)
    exponent = binary_exponent(lax.stop_gradient(largest))
    # From the bits alone: XLA:CPU compares subnormals with zero inconsistently.
    usable = (exponent > 1 - info.maxexp) & (exponent < info.maxexp)
    return jnp.where(usable, jnp.clip(exponent, info.minexp + 1, info.maxexp - 2), 0)
