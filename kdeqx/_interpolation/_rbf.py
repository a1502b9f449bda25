"""Local radial basis function interpolation: scipy's `RBFInterpolator(neighbors=k)`,
one small saddle-point system per query, solved in batches inside `jit`."""

import math
import warnings
from typing import Literal

import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Float
from .._engine._metric import EUCLIDEAN
from ._dense import full_product, solve_symmetric
from ._local import (
    AbstractLocalFit,
    count_monomials,
    monomial_powers,
    monomials,
    squared_norms,
)


Radial = Literal[
    "linear",
    "thin_plate_spline",
    "cubic",
    "quintic",
    "multiquadric",
    "inverse_multiquadric",
    "inverse_quadratic",
    "gaussian",
]


def _safe_sqrt(r2: Array) -> Array:
    """`sqrt(r2)` with a zero, not infinite, derivative at 0."""
    positive = r2 > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, r2, 1)), 0)


def _thin_plate_spline(r2: Array) -> Array:
    """`r^2 log r`, written in `r^2`: 0 at 0, with a finite gradient."""
    positive = r2 > 0
    return jnp.where(positive, r2 * jnp.log(jnp.where(positive, r2, 1)) / 2, 0)


# scipy's radial functions (with scipy's signs), of the squared scaled distance.
_RADIAL = {
    "linear": lambda r2: -_safe_sqrt(r2),
    "thin_plate_spline": _thin_plate_spline,
    "cubic": lambda r2: r2 * _safe_sqrt(r2),
    "quintic": lambda r2: -(r2**2) * _safe_sqrt(r2),
    "multiquadric": lambda r2: -jnp.sqrt(r2 + 1),
    "inverse_multiquadric": lambda r2: lax.rsqrt(r2 + 1),
    "inverse_quadratic": lambda r2: 1 / (r2 + 1),
    "gaussian": lambda r2: jnp.exp(-r2),
}
# The polynomial degree below which a kernel's system can be singular (scipy's).
_MIN_DEGREE = {
    "multiquadric": 0,
    "linear": 0,
    "thin_plate_spline": 1,
    "cubic": 1,
    "quintic": 2,
}
# The scale-invariant kernels, homogeneous of these degrees: `phi(c r) = c**m phi(r)`
# (the thin-plate spline up to `c**2 log(c) r**2`, which a polynomial of degree >= 1
# absorbs), so their shape parameter does not change the interpolant.
_HOMOGENEITY = {"linear": 1, "thin_plate_spline": 2, "cubic": 3, "quintic": 5}
_SCALE_INVARIANT = frozenset(_HOMOGENEITY)


def check_rbf(rbf: str, degree: int | None, d: int, k: int) -> int:
    """The polynomial degree of a local RBF (scipy's default per kernel), after
    checking the kernel and that `k` points can determine the polynomial."""
    if rbf not in _RADIAL:
        raise ValueError(f"`rbf` must be one of {sorted(_RADIAL)}, got {rbf!r}.")
    min_degree = _MIN_DEGREE.get(rbf, -1)
    if degree is None:
        degree = max(min_degree, 0)
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < -1:
        raise ValueError(f"`degree` must be an int >= -1, got {degree!r}.")
    if -1 < degree < min_degree:
        warnings.warn(
            f"`degree` should not be below {min_degree} for rbf={rbf!r} (except -1): "
            "the local systems may be singular (as scipy warns).",
            UserWarning,
            stacklevel=4,
        )
    terms = count_monomials(d, degree)
    if terms > k:
        raise ValueError(
            f"At least {terms} neighbours are needed for a degree-{degree} polynomial "
            f"in {d} dimensions, got k = {k} (as scipy's RBFInterpolator requires)."
        )
    return degree


def needs_epsilon(rbf: str) -> bool:
    """Whether a kernel's shape parameter changes the interpolant (scipy requires
    it then; the scale-invariant kernels default to 1)."""
    return rbf not in _SCALE_INVARIANT


def _pairwise_squared(offsets: Float[Array, "k d"]) -> Float[Array, "k k"]:
    """Squared distances between the neighbours, axis by axis (0 on the diagonal)."""
    return EUCLIDEAN.powered_of_axes([c[:, None] - c[None, :] for c in offsets.T])


def _balanced(kernel, poly, poly_at_query):
    """The polynomial columns scaled to the kernel's entries. The interpolant does not
    depend on their scale, but the test for a singular system does: it compares the
    pivots with the largest entry, and thin-plate entries of ~1e-3 beside polynomial
    ones of ~1 made some regular float32 systems look singular, whose ridge then
    spoiled their fit."""
    balance = jnp.max(jnp.abs(kernel)) / jnp.max(jnp.abs(poly))
    balance = lax.stop_gradient(jnp.where(balance > 0, balance, 1))
    return poly * balance, poly_at_query * balance


class LocalRbf(AbstractLocalFit):
    """scipy's `RBFInterpolator(y, d, neighbors=k, smoothing, kernel, epsilon,
    degree)`, evaluated at one query: the RBF interpolant of its `k` nearest points
    with polynomial terms, the polynomial in the neighbours' coordinates shifted and
    scaled to `[-1, 1]` as scipy does."""

    epsilon: Float[Array, ""]
    smoothing: Float[Array, ""] | Float[Array, " n"]
    rbf: Radial
    powers: tuple[tuple[int, ...], ...]

    def __init__(self, rbf: Radial, epsilon, smoothing, degree: int, d: int):
        self.rbf = rbf
        self.epsilon = epsilon
        self.smoothing = smoothing
        self.powers = monomial_powers(d, degree)

    def point_columns(self, n, dtype):
        return jnp.broadcast_to(jnp.asarray(self.smoothing, dtype), (n,))[:, None]

    def _radial(self, r2: Array, unit: Array) -> Array:
        """The kernel at squared distances `r2` given in units of `2**unit`: scipy's
        `phi(epsilon r)`, divided by `2**(m unit)` for a kernel homogeneous of degree
        `m`, whose smoothing [`LocalRbf._smoothing`][] divides by the same (the
        system and the interpolant are then scipy's, the coefficients scaled)."""
        radial = _RADIAL[self.rbf]
        if self.rbf not in _HOMOGENEITY:
            return radial(jnp.ldexp(self.epsilon, unit) ** 2 * r2)
        scaled = self.epsilon**2 * r2
        kernel = radial(scaled)
        # (c rho)^2 log(c rho) = c^2 (rho^2 log(rho) + rho^2 log(c)), c = 2**unit; a
        # polynomial of degree >= 1 (more than one term) absorbs the second part.
        if self.rbf == "thin_plate_spline" and len(self.powers) <= 1:
            kernel = kernel + scaled * (unit.astype(scaled.dtype) * math.log(2))
        return kernel

    def _smoothing(self, smoothing: Array, unit: Array) -> Array:
        """The smoothing in the units of [`LocalRbf._radial`][]."""
        if self.rbf not in _HOMOGENEITY:
            return smoothing
        scaled = jnp.ldexp(smoothing, -_HOMOGENEITY[self.rbf] * unit)
        return jnp.minimum(scaled, jnp.finfo(scaled.dtype).max)

    def fit(self, offsets, values, columns, unit):
        k, r = offsets.shape[0], len(self.powers)
        # The interpolant does not depend on how the polynomial's domain is shifted
        # or scaled, so neither carries a gradient.
        lo, hi = jnp.min(offsets, axis=0), jnp.max(offsets, axis=0)
        shift = lax.stop_gradient((hi + lo) / 2)
        half_width = lax.stop_gradient((hi - lo) / 2)
        scale = jnp.where(half_width > 0, half_width, 1)
        poly = monomials((offsets - shift) / scale, self.powers)
        poly_at_query = monomials(-shift / scale, self.powers)
        kernel = self._radial(_pairwise_squared(offsets), unit)
        smoothing = self._smoothing(columns[:, 0].astype(kernel.dtype), unit)
        # Onto the diagonal by a scatter, not `+ jnp.diag(smoothing)`, whose mask XLA
        # hoists out of the loop over chunks of queries: the same answers, faster (see
        # `benchmarks/interpolate.py`).
        diagonal = jnp.arange(k)
        kernel = kernel.at[diagonal, diagonal].add(smoothing)
        if r > 0:
            poly, poly_at_query = _balanced(kernel, poly, poly_at_query)
        lhs = jnp.block([[kernel, poly], [poly.T, jnp.zeros((r, r), kernel.dtype)]])
        rhs = jnp.concatenate([values, jnp.zeros((r, values.shape[1]), values.dtype)])
        signs = jnp.concatenate([jnp.ones(k), -jnp.ones(r)]).astype(lhs.dtype)
        coefficients = solve_symmetric(lhs, rhs, signs)
        at_query = self._radial(squared_norms(offsets), unit)
        return full_product(at_query, coefficients[:k]) + full_product(
            poly_at_query, coefficients[k:]
        )
