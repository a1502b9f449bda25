"""Interpolation from the k nearest points: kernel weights and a trainable module."""

import functools as ft
from collections.abc import Callable
from typing import Literal, TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp

from ._custom_types import Array, ArrayLike, Bool, Float
from ._metric import check_norm
from ._validate import check_positive, check_static_int, check_values


if TYPE_CHECKING:
    from ._tree import AbstractKDTree


Kernel = Literal["idw", "gaussian"]


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


def kernel_weights(
    kernel: Kernel, power: float, length_scale, dtype
) -> Callable[[Float[Array, "*batch k"], Bool[Array, "*batch k"]], Array]:
    """The kernel's weights as a function of the neighbours' distances and which of
    them exist, after checking its parameters."""
    if kernel == "idw":
        if not power > 0:
            raise ValueError(f"`power` must be > 0 for kernel='idw', got {power}.")
        return ft.partial(_idw_weights, power=power)
    if kernel == "gaussian":
        if length_scale is None:
            raise ValueError("kernel='gaussian' needs a `length_scale`.")
        scale = check_positive("length_scale", length_scale, dtype)
        return ft.partial(_gaussian_weights, length_scale=scale)
    raise ValueError(f"`kernel` must be 'idw' or 'gaussian', got {kernel!r}.")


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
    any weight. Only `values` (and `length_scale`) should be trained: the tree's float
    arrays are search structures and moving them would not rebuild the tree. Select
    the trainable part explicitly, for example

    ```python
    trainable = eqx.tree_at(
        lambda m: m.values, jax.tree.map(lambda _: False, model), replace=True
    )
    params, static = eqx.partition(model, trainable)
    ```
    """

    tree: "AbstractKDTree"
    values: Float[Array, "n ..."]
    length_scale: Float[Array, ""] | None
    k: int = eqx.field(static=True)
    kernel: Kernel = eqx.field(static=True)
    power: float = eqx.field(static=True)
    p: float = eqx.field(static=True)

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
    ):
        """**Arguments:**

        - `tree`: a `kdeqx.KDTree` or `kdeqx.ShardedKDTree` over `n >= 1` points.
        - `values`: the field at the points, shape `(n, ...)`, rows in the order of
            the tree's points.
        - `k`: neighbours used per query (static).
        - `kernel`: `"idw"` (inverse distance, weights `1/d**power`) or
            `"gaussian"` (weights `exp(-d**2 / (2 length_scale**2))`, smooth).
        - `power`: the IDW exponent (static float > 0).
        - `length_scale`: the Gaussian kernel's width (a trainable leaf).
        - `p`: the Minkowski norm of the distances (static, `1 <= p <= inf`).
        """
        self.values = check_values(values, tree.n)
        kernel_weights(kernel, power, length_scale, self.values.dtype)
        self.tree = tree
        self.length_scale = (
            None
            if length_scale is None
            else jnp.asarray(length_scale, self.values.dtype)
        )
        self.k = check_static_int("k", k, 1)
        self.kernel = kernel
        self.power = float(power)
        self.p = check_norm(p, 0.0).p

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
        )
