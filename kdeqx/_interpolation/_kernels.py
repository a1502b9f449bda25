"""The interpolation kernels as modules, Lineax style: each holds its own options and,
given a tree's sizes, checks them and says how the `k` nearest points' values are
combined. `interpolate`'s strings and keywords (`kernel="rbf", epsilon=...`) are
turned into these."""

import abc
import functools as ft
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, ArrayLike, Bool, Float
from .._validate import check_nonnegative_smoothing, check_positive
from ._local import AbstractLocalFit
from ._mls import MovingLeastSquares
from ._rbf import check_rbf, LocalRbf, needs_epsilon, Radial


KernelName = Literal["idw", "gaussian", "rbf", "mls"]
Weights = Callable[[Float[Array, "*batch k"], Bool[Array, "*batch k"]], Array]


# `_idw_weights` and `_gaussian_weights` are jitted: called eagerly, each is one
# program to compile for a new shape, not one per operation.


@ft.partial(jax.jit, static_argnames="power")
def _idw_weights(
    distances: Float[Array, "*batch k"], found: Bool[Array, "*batch k"], power: float
) -> Float[Array, "*batch k"]:
    """Inverse-distance weights `1/d**power`, scaled by the nearest distance.

    Scaling by `d_min**power` changes nothing after normalisation but keeps every
    weight in `[0, 1]`, so tiny distances cannot overflow. A query on a data point
    (`d = 0`) gets equal weights on the coincident points, and no NaN in any gradient.
    """
    nearest = distances[..., :1]
    hit = found & (distances == 0)
    on_data = jnp.any(hit, axis=-1, keepdims=True)
    usable = found & ~on_data
    # Both in units of the nearest distance, held constant: the quotient's
    # derivative then squares numbers near one, not distances that underflow.
    unit = lax.stop_gradient(jnp.where(on_data, 1, nearest))
    numerator = jnp.where(usable, nearest / unit, 1)
    ratio = numerator / jnp.where(usable, distances / unit, 1)
    smooth = jnp.where(usable, ratio**power, 0)
    return jnp.where(on_data, hit.astype(distances.dtype), smooth)


@jax.jit
def _gaussian_weights(
    distances: Float[Array, "*batch k"],
    found: Bool[Array, "*batch k"],
    length_scale: Float[Array, ""],
) -> Float[Array, "*batch k"]:
    """Gaussian weights `exp(-d**2 / (2 l**2))`, shifted by the nearest (stability).

    The exponent, `(d - d_min) (d + d_min) / (2 l**2)`, is a product of two factors
    in units of the length scale (held constant, so that no derivative squares it),
    each capped where the weight has long been zero: no square overflows, in the
    value or in its derivatives, however the distances compare with `l`."""
    nearest = distances[..., :1]
    distances = jnp.where(found, distances, nearest)
    unit = lax.stop_gradient(length_scale)
    relative = length_scale / unit  # one, carrying the derivative in `l`
    cap = jnp.sqrt(jnp.finfo(distances.dtype).max) / 2
    apart = jnp.minimum((distances - nearest) / unit, cap) / relative
    together = jnp.minimum((distances + nearest) / unit, cap) / relative
    return jnp.where(found, jnp.exp(-apart * together / 2), 0)


class AbstractKernel(eqx.Module):
    """How `interpolate` combines the values of a query's `k` nearest points: a
    weighted mean ([`kdeqx.IDW`][], [`kdeqx.Gaussian`][]) or a local fit
    ([`kdeqx.RBF`][], [`kdeqx.MLS`][])."""

    @abc.abstractmethod
    def method(
        self, *, p: float, k: int, n: int, d: int, dtype
    ) -> Weights | AbstractLocalFit:
        """The kernel for `k` neighbours per query of a tree of `n` points in `d`
        dimensions and dtype `dtype`, under the Minkowski `p`-norm, its options
        checked: a function of the neighbours' distances, and which of them exist,
        giving their weights; or a local fit."""


def _local_fits_need_euclidean(name: str, p: float) -> None:
    if p != 2:
        raise ValueError(f"kernel={name!r} is defined for the Euclidean norm, p=2.")


class IDW(AbstractKernel):
    """Inverse-distance weighting: the mean of the neighbours' values weighted by
    `1 / d**power`. A query on data points takes the mean of theirs."""

    power: float = eqx.field(static=True)

    def __init__(self, power: float = 2.0):
        """**Arguments:**

        - `power`: the exponent, `> 0` (static).
        """
        if not power > 0:
            raise ValueError(f"`power` must be > 0 for kernel='idw', got {power}.")
        self.power = float(power)

    def method(self, *, p, k, n, d, dtype):
        return ft.partial(_idw_weights, power=self.power)


class Gaussian(AbstractKernel):
    """The mean of the neighbours' values weighted by `exp(-d**2 / (2
    length_scale**2))`."""

    # As given (a scalar): checked, and cast to the tree's dtype, where used.
    length_scale: ArrayLike

    def __init__(self, length_scale: float | ArrayLike):
        """**Arguments:**

        - `length_scale`: the width, `> 0` (a leaf: differentiable and trainable).
        """
        self.length_scale = length_scale

    def method(self, *, p, k, n, d, dtype):
        scale = check_positive("length_scale", self.length_scale, dtype)
        return ft.partial(_gaussian_weights, length_scale=scale)


class RBF(AbstractKernel):
    """scipy's `RBFInterpolator(points, values, neighbors=k, kernel=rbf,
    epsilon=epsilon, degree=degree, smoothing=smoothing)` evaluated at each query:
    the RBF interpolant, with polynomial terms, of its `k` nearest points."""

    rbf: Radial = eqx.field(static=True)
    # As given (scalars, or one smoothing per point): checked where used.
    epsilon: ArrayLike | None
    degree: int | None = eqx.field(static=True)
    smoothing: ArrayLike

    def __init__(
        self,
        rbf: Radial = "thin_plate_spline",
        *,
        epsilon: float | ArrayLike | None = None,
        degree: int | None = None,
        smoothing: float | ArrayLike = 0.0,
    ):
        """**Arguments:**

        - `rbf`: the radial function: `"thin_plate_spline"` (default), `"cubic"`,
            `"quintic"`, `"linear"`, `"gaussian"`, `"multiquadric"`,
            `"inverse_multiquadric"` or `"inverse_quadratic"`, as in scipy.
        - `epsilon`: the shape parameter, `> 0`; scipy's default 1 for the
            scale-invariant kernels, required for the others.
        - `degree`: the polynomial degree, `>= -1` (`-1`: none); scipy's default
            per kernel.
        - `smoothing`: `>= 0`, a scalar or one value per point (0 interpolates).
        """
        self.rbf = rbf
        self.epsilon = epsilon
        self.degree = degree
        self.smoothing = smoothing

    def method(self, *, p, k, n, d, dtype):
        _local_fits_need_euclidean("rbf", p)
        degree = check_rbf(self.rbf, self.degree, d, k)
        epsilon = self.epsilon
        if epsilon is None:
            if needs_epsilon(self.rbf):
                raise ValueError(f"rbf={self.rbf!r} needs an `epsilon` (as in scipy).")
            epsilon = 1.0
        return LocalRbf(
            self.rbf,
            check_positive("epsilon", epsilon, dtype),
            check_nonnegative_smoothing(self.smoothing, n, dtype),
            degree,
            d,
        )


class MLS(AbstractKernel):
    """Moving least squares with weights that vanish smoothly at a support radius
    that moves smoothly with the query: the interpolant and its gradient are
    continuous (see the guide "Choosing an interpolation kernel")."""

    degree: int = eqx.field(static=True)
    exact: bool = eqx.field(static=True)

    def __init__(self, degree: int = 1, *, exact: bool = False):
        """**Arguments:**

        - `degree`: the polynomial degree, 0, 1 or 2.
        - `exact`: weights singular at the points, so that the interpolant
            reproduces the data there (to about `sqrt(eps)` relative to the
            neighbours' spread).
        """
        if degree not in (0, 1, 2):
            raise ValueError(f"kernel='mls' takes degree 0, 1 or 2, got {degree!r}.")
        self.degree = degree
        self.exact = bool(exact)

    def method(self, *, p, k, n, d, dtype):
        _local_fits_need_euclidean("mls", p)
        if k < 2:
            raise ValueError("kernel='mls' needs k >= 2 neighbours.")
        return MovingLeastSquares(self.degree, d, k, self.exact)


def as_kernel(
    kernel: KernelName | AbstractKernel,
    *,
    power: float = 2.0,
    length_scale: float | ArrayLike | None = None,
    rbf: Radial = "thin_plate_spline",
    epsilon: float | ArrayLike | None = None,
    degree: int | None = None,
    smoothing: float | ArrayLike = 0.0,
    exact: bool = False,
) -> AbstractKernel:
    """The kernel module for `interpolate`'s `kernel` and keywords (a module is
    returned as it is, with no keyword besides it)."""
    if isinstance(kernel, AbstractKernel):
        given = {
            "power": power != 2.0,
            "length_scale": length_scale is not None,
            "rbf": rbf != "thin_plate_spline",
            "epsilon": epsilon is not None,
            "degree": degree is not None,
            "smoothing": not (isinstance(smoothing, int | float) and smoothing == 0),
            "exact": bool(exact),
        }
        if any(given.values()):
            names = ", ".join(f"`{name}`" for name, set_ in given.items() if set_)
            raise ValueError(
                f"Options {names} go into the kernel module "
                f"({type(kernel).__name__}), not beside it."
            )
        return kernel
    if kernel == "idw":
        return IDW(power)
    if kernel == "gaussian":
        if length_scale is None:
            raise ValueError("kernel='gaussian' needs a `length_scale`.")
        return Gaussian(length_scale)
    if kernel == "rbf":
        return RBF(rbf, epsilon=epsilon, degree=degree, smoothing=smoothing)
    if kernel == "mls":
        return MLS(1 if degree is None else degree, exact=exact)
    raise ValueError(
        "`kernel` must be 'idw', 'gaussian', 'rbf' or 'mls' (or a kernel module), "
        f"got {kernel!r}."
    )
