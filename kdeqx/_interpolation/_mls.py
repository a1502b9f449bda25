"""Moving least squares with a support radius that moves smoothly: an interpolant
whose value and gradient are continuous although each query uses its own neighbours.

Weights that vanish at the distance of the `(k+1)`-th neighbour give a continuous
interpolant, but that distance has kinks (where the `(k+1)`-th and `(k+2)`-th
neighbours swap, and where the `k`-th and `(k+1)`-th do), and every weight inherits
them: the gradient would jump. Here the support radius `R` solves
`sum_j psi(|y_j - x|^2 / R^2) = c` over all points, a weighted count with a smooth,
compactly supported `psi` (1 up to `R / 2`, a C2 step down to 0 at `R`). `R` is then a
smooth function of the query (implicit function theorem: the count is strictly
increasing in `R` where it equals a non-integer `c`), and so are the weights
`psi(|y_j - x|^2 / R^2)` and the fit. Only points within `R` count, so the `k` nearest
suffice whenever fewer than `k` points lie within `R`; `c = (k - 1/2) / 4` makes that
hold with a wide margin on ordinary data (about `k / 2` points lie within `R` in 3-D,
uniformly spread). Where it does not (strongly clustered data), `R` is capped at the
`k`-th distance: still continuous, no longer differentiable there.
"""

import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Float
from ._dense import full_product, solve_symmetric
from ._local import AbstractLocalFit, monomial_powers, monomials, squared_norms


# psi is 1 on [0, _PLATEAU] (in units of R^2) and steps down to 0 at 1.
_PLATEAU = 0.25


def _psi(t: Array) -> Array:
    """The support profile in `t = |y - x|^2 / R^2`: 1, a C2 step, then 0."""
    u = jnp.clip((t - _PLATEAU) / (1 - _PLATEAU), 0, 1)
    return 1 - u**3 * (10 - 15 * u + 6 * u**2)


def target_count(k: int) -> float:
    """The weighted count `c` that sets the support radius (never an integer)."""
    return (k - 0.5) / 4


def _support_radius_squared(
    squared: Float[Array, " k"], target: float
) -> Float[Array, ""]:
    """`R^2` with `sum_j psi(squared_j / R^2) = target`, capped at the largest of
    `squared`; differentiable (implicitly) in `squared`."""
    needed = int(-(-target // 1))  # ceil: the count first reaches `target` there.
    ordered = jnp.sort(lax.stop_gradient(squared))
    cap = ordered[-1]

    def count(radius2):
        return jnp.sum(_psi(ordered / radius2))

    # The count is below the target at the `needed`-th squared distance and above it
    # at four times that (those points are then on the plateau).
    lo = ordered[needed - 1]
    hi = jnp.minimum(4 * lo, cap)
    capped = count(jnp.where(hi > 0, hi, 1)) < target
    iterations = jnp.finfo(squared.dtype).nmant // 2 + 3

    def bisect(_, bracket):
        lo, hi = bracket
        mid = (lo + hi) / 2
        below = count(jnp.where(mid > 0, mid, 1)) < target
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    lo, hi = lax.fori_loop(0, iterations, bisect, (lo, hi))
    root = (lo + hi) / 2
    # More than `target` neighbours on the query itself shrink the support onto
    # them (`R -> 0`). Held above `sqrt(tiny)`, `R^4` stays representable, so that
    # no derivative divides by zero; only those neighbours are still within `R`.
    smallest = jnp.sqrt(jnp.finfo(squared.dtype).tiny)
    root = jnp.maximum(root, smallest)

    # One Newton step with the slope held fixed: it polishes the root and carries
    # the implicit derivative -(d count / d squared) / (d count / d R^2).
    def residual(radius2):
        return jnp.sum(_psi(squared / radius2)) - target

    slope = lax.stop_gradient(
        jnp.sum(_psi_derivative(ordered / root) * -ordered / root**2)
    )
    usable = slope > 0
    newton = root - residual(root) / jnp.where(usable, slope, 1)
    radius2 = jnp.where(usable, newton, root)
    farthest = jnp.maximum(_largest(squared), smallest)
    return jnp.where(capped | (cap <= 0), farthest, radius2)


def _largest(x: Float[Array, " k"]) -> Float[Array, ""]:
    """The largest entry, differentiable as that one entry. `jnp.max`'s derivative
    divides by how many entries equal the maximum, and a recomputation of `x` fused
    into the gradient that rounds differently (as XLA:CPU's unoptimised code did)
    makes that none: NaN."""
    return x[jnp.argmax(x)]


def _psi_derivative(t: Array) -> Array:
    u = (t - _PLATEAU) / (1 - _PLATEAU)
    inside = (u > 0) & (u < 1)
    return jnp.where(inside, -30 * u**2 * (1 - u) ** 2 / (1 - _PLATEAU), 0)


class MovingLeastSquares(AbstractLocalFit):
    """Moving least squares of degree 0 (Shepard), 1 or 2 over the `k` nearest
    points, weighted by `psi(|y_j - x|^2 / R^2)` with the smooth support radius `R`
    of this module; with `exact`, by `psi / (|y_j - x|^2 / R^2 + delta)`, which
    reproduces the data at the points to about `delta = sqrt(eps)` (relative to the
    spread of the neighbours' values)."""

    powers: tuple[tuple[int, ...], ...]
    target: float
    exact: bool

    def __init__(self, degree: int, d: int, k: int, exact: bool):
        self.powers = monomial_powers(d, degree)
        self.target = target_count(k)
        self.exact = exact

    def point_columns(self, n, dtype):
        return jnp.zeros((n, 0), dtype)

    def fit(self, offsets, values, columns, unit):
        # The fit does not depend on the unit of length: its weights are ratios.
        del columns, unit
        squared = squared_norms(offsets)
        radius2 = _support_radius_squared(squared, self.target)
        scaled = squared / radius2
        weights = _psi(scaled)
        if self.exact:
            weights = weights / (scaled + jnp.sqrt(jnp.finfo(scaled.dtype).eps))
        # A lone point (all weights zero: every neighbour ties with the farthest) is
        # the degenerate case of the cap; equal weights keep the result finite.
        weights = jnp.where(jnp.any(weights > 0), weights, 1)
        weights = weights / _largest(weights)
        used = weights > 0
        basis = monomials(offsets / jnp.sqrt(radius2), self.powers)
        basis = jnp.where(used[:, None], basis, 0)
        weighted = weights[:, None] * basis
        gram = full_product(weighted.T, basis)
        moments = full_product(weighted.T, values)
        # A small ridge on the non-constant terms, always on (a switch would break
        # continuity): degenerate neighbourhoods (points on a line, in 2-D) get the
        # least-sloped fit instead of a singular system.
        ridge = jnp.sqrt(jnp.finfo(gram.dtype).eps) * gram[0, 0]
        ridge = ridge * (jnp.arange(len(self.powers)) > 0)
        coefficients = solve_symmetric(gram + jnp.diag(ridge), moments)
        # The basis at the query (offset 0) is (1, 0, ...): the value is the constant.
        return coefficients[0]
