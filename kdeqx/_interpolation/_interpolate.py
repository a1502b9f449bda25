"""Interpolation from the k nearest points: the kernels (weighted means and local
fits), their checked parameters, and the trainable `Interpolator`."""

import functools as ft
from collections.abc import Callable
from typing import Literal, TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp

from .._custom_types import Array, ArrayLike, Bool, Float
from .._validate import (
    check_nonnegative_smoothing,
    check_positive,
    check_static_int,
    check_values,
)
from ._frozen import Frozen
from ._local import AbstractLocalFit
from ._mls import MovingLeastSquares
from ._rbf import check_rbf, LocalRbf, needs_epsilon, Radial


if TYPE_CHECKING:
    from .._tree._tree import AbstractKDTree


Kernel = Literal["idw", "gaussian", "rbf", "mls"]


# `_idw_weights`, `_gaussian_weights` and `weighted_mean` are jitted: called eagerly,
# each is one program to compile for a new shape, not one per operation.


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
    ratio = jnp.where(usable, nearest, 1) / jnp.where(usable, distances, 1)
    smooth = jnp.where(usable, ratio**power, 0)
    return jnp.where(on_data, hit.astype(distances.dtype), smooth)


@jax.jit
def _gaussian_weights(
    distances: Float[Array, "*batch k"],
    found: Bool[Array, "*batch k"],
    length_scale: Float[Array, ""],
) -> Float[Array, "*batch k"]:
    """Gaussian weights `exp(-d**2 / (2 l**2))`, shifted by the nearest (stability)."""
    # In units of the length scale first: huge distances cannot overflow when squared.
    scaled = jnp.where(found, distances, 0) / length_scale
    exponent = (scaled**2 - scaled[..., :1] ** 2) / 2
    return jnp.where(found, jnp.exp(-exponent), 0)


Weights = Callable[[Float[Array, "*batch k"], Bool[Array, "*batch k"]], Array]


def kernel_method(
    kernel: Kernel,
    *,
    power: float,
    length_scale,
    rbf: Radial,
    epsilon,
    degree: int | None,
    smoothing,
    exact: bool,
    p: float,
    k: int,
    n: int,
    d: int,
    dtype,
) -> Weights | AbstractLocalFit:
    """The kernel, after checking its parameters: a function of the neighbours'
    distances and which of them exist giving their weights (`idw`, `gaussian`), or a
    local fit (`rbf`, `mls`). `k` is the number of neighbours a query gets."""
    if kernel == "idw":
        if not power > 0:
            raise ValueError(f"`power` must be > 0 for kernel='idw', got {power}.")
        return ft.partial(_idw_weights, power=float(power))  # static
    if kernel == "gaussian":
        if length_scale is None:
            raise ValueError("kernel='gaussian' needs a `length_scale`.")
        scale = check_positive("length_scale", length_scale, dtype)
        return ft.partial(_gaussian_weights, length_scale=scale)
    if kernel in ("rbf", "mls") and p != 2:
        raise ValueError(f"kernel={kernel!r} is defined for the Euclidean norm, p=2.")
    if kernel == "rbf":
        degree = check_rbf(rbf, degree, d, k)
        if epsilon is None:
            if needs_epsilon(rbf):
                raise ValueError(f"rbf={rbf!r} needs an `epsilon` (as in scipy).")
            epsilon = 1.0
        return LocalRbf(
            rbf,
            check_positive("epsilon", epsilon, dtype),
            check_nonnegative_smoothing(smoothing, n, dtype),
            degree,
            d,
        )
    if kernel == "mls":
        degree = 1 if degree is None else degree
        if degree not in (0, 1, 2):
            raise ValueError(f"kernel='mls' takes degree 0, 1 or 2, got {degree!r}.")
        if k < 2:
            raise ValueError("kernel='mls' needs k >= 2 neighbours.")
        return MovingLeastSquares(degree, d, k, bool(exact))
    raise ValueError(
        f"`kernel` must be 'idw', 'gaussian', 'rbf' or 'mls', got {kernel!r}."
    )


@jax.jit
def weighted_mean(
    weights: Float[Array, "*batch k"], rows: Float[Array, "..."]
) -> Float[Array, "..."]:
    """`sum_j w_j rows_j / sum_j w_j` over the `k` axis of `rows`, shape
    `(*batch, k, *feature)`: rows of missing neighbours must weigh 0."""
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    feature_axes = (None,) * (rows.ndim - weights.ndim)
    return jnp.sum(weights[(..., *feature_axes)] * rows, axis=weights.ndim - 1)


class Interpolator(eqx.Module):
    """A field interpolated from values at the points of a tree: a trainable layer.

    `values` is an ordinary array leaf, so `eqx.filter_grad` and optax train it like
    any weight, as are the kernel's continuous parameters when given: `length_scale`
    and `epsilon` in log space (as `log_length_scale`, `log_epsilon`), so that they
    stay positive, and `smoothing`, used as `max(smoothing, 0)`. The tree is a search
    structure that moving its points would not rebuild, so it is held
    [`kdeqx.Frozen`][]: its arrays are not inexact arrays, and the usual filter
    trains exactly the rest,

    ```python
    params, static = eqx.partition(model, eqx.is_inexact_array)
    ```

    `model.tree` gives the tree back. For gradients with respect to the points, call
    `tree.interpolate` on a tree built from them.
    """

    frozen_tree: Frozen["AbstractKDTree"]
    values: Float[Array, "n ..."]
    log_length_scale: Float[Array, ""] | None
    log_epsilon: Float[Array, ""] | None
    smoothing: Float[Array, ""] | Float[Array, " n"]
    k: int = eqx.field(static=True)
    kernel: Kernel = eqx.field(static=True)
    power: float = eqx.field(static=True)
    p: float = eqx.field(static=True)
    rbf: Radial = eqx.field(static=True)
    degree: int | None = eqx.field(static=True)
    exact: bool = eqx.field(static=True)

    def __init__(
        self,
        tree: "AbstractKDTree",
        values: ArrayLike,
        *,
        k: int = 8,
        kernel: Kernel = "idw",
        power: float = 2.0,
        length_scale: float | ArrayLike | None = None,
        p: int | float = 2.0,
        rbf: Radial = "thin_plate_spline",
        epsilon: float | ArrayLike | None = None,
        degree: int | None = None,
        smoothing: float | ArrayLike = 0.0,
        exact: bool = False,
    ):
        """**Arguments:**

        - `tree`: a `kdeqx.KDTree` or `kdeqx.ShardedKDTree` over `n >= 1` points.
        - `values`: the field at the points, shape `(n, ...)`, rows in the order of
            the tree's points.
        - `k`: neighbours used per query (static).
        - `kernel`, `power`, `length_scale`, `p`, `rbf`, `epsilon`, `degree`,
            `smoothing`, `exact`: as in `kdeqx.AbstractKDTree.interpolate`, checked
            here. `length_scale`, `epsilon` and `smoothing` become trainable leaves.
        """
        self.values = check_values(values, tree.n)
        dtype = self.values.dtype
        self.k = check_static_int("k", k, 1)
        _, metric, _ = tree._interpolation_kernel(
            self.k,
            p,
            kernel,
            power=power,
            length_scale=length_scale,
            rbf=rbf,
            epsilon=epsilon,
            degree=degree,
            smoothing=smoothing,
            exact=exact,
        )
        self.p = metric.p
        self.frozen_tree = Frozen(tree)
        self.log_length_scale = _optional_log(length_scale, dtype)
        self.log_epsilon = _optional_log(epsilon, dtype)
        self.smoothing = jnp.asarray(smoothing, dtype)
        self.kernel = kernel
        self.power = float(power)
        self.rbf = rbf
        self.degree = degree
        self.exact = bool(exact)

    @property
    def tree(self) -> "AbstractKDTree":
        """The tree the field is interpolated on."""
        return self.frozen_tree.thaw()

    @property
    def length_scale(self) -> Float[Array, ""] | None:
        return _optional_exp(self.log_length_scale)

    @property
    def epsilon(self) -> Float[Array, ""] | None:
        return _optional_exp(self.log_epsilon)

    def __call__(self, x: ArrayLike) -> Float[Array, "..."]:
        """Interpolates at `x` of shape `(..., d)`; returns `(..., *feature)`."""
        return self.tree.interpolate(
            x,
            self.values,
            k=self.k,
            p=self.p,
            kernel=self.kernel,
            power=self.power,
            length_scale=self.length_scale,
            rbf=self.rbf,
            epsilon=self.epsilon,
            degree=self.degree,
            smoothing=jnp.maximum(self.smoothing, 0),
            exact=self.exact,
        )


def _optional_log(value, dtype) -> Float[Array, ""] | None:
    # Positive already: `tree._interpolation_kernel` checked it.
    return None if value is None else jnp.log(jnp.asarray(value, dtype))


def _optional_exp(value) -> Float[Array, ""] | None:
    return None if value is None else jnp.exp(value)
