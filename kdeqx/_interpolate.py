"""Interpolation from the k nearest points: kernel weights and a trainable module."""

from typing import Literal, TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp

from ._custom_types import Array, ArrayLike, Bool, Float
from ._mesh import split_like_queries
from ._query import knn
from ._validate import as_float_array, check_finite, check_static_int


if TYPE_CHECKING:
    from ._tree import KDTree


Kernel = Literal["idw", "gaussian"]


def idw_weights(
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


def gaussian_weights(
    distances: Float[Array, "*batch k"],
    found: Bool[Array, "*batch k"],
    length_scale: Float[Array, ""],
) -> Float[Array, "*batch k"]:
    """Gaussian weights `exp(-d**2 / (2 l**2))`, shifted by the nearest (stability)."""
    # In units of the length scale first: huge distances cannot overflow when squared.
    scaled = jnp.where(found, distances, 0) / length_scale
    exponent = (scaled**2 - scaled[..., :1] ** 2) / 2
    return jnp.where(found, jnp.exp(-exponent), 0)


def _check_values(tree: "KDTree", values: ArrayLike) -> Float[Array, "n ..."]:
    values = as_float_array("values", values)
    if values.ndim < 1 or values.shape[0] != tree.n:
        raise ValueError(
            f"`values` must have one row per point, shape ({tree.n}, ...), got shape "
            f"{tuple(values.shape)}."
        )
    return check_finite("values", values)


def check_kernel(kernel, power, length_scale):
    if kernel == "idw":
        if not power > 0:
            raise ValueError(f"`power` must be > 0 for kernel='idw', got {power}.")
    elif kernel == "gaussian":
        if length_scale is None:
            raise ValueError("kernel='gaussian' needs a `length_scale`.")
    else:
        raise ValueError(f"`kernel` must be 'idw' or 'gaussian', got {kernel!r}.")


def interpolate(
    tree: "KDTree",
    x: ArrayLike,
    values: ArrayLike,
    *,
    k: int,
    kernel: Kernel,
    power: float,
    length_scale,
) -> Float[Array, "..."]:
    if tree.n == 0:
        raise ValueError("Cannot interpolate from an empty tree (n = 0).")
    k = check_static_int("k", k, 1)
    check_kernel(kernel, power, length_scale)
    values = _check_values(tree, values)
    distances, indices = knn(tree, x, k, jnp.inf)
    found = indices < tree.n
    if kernel == "idw":
        weights = idw_weights(distances, found, power)
    else:
        scale = jnp.asarray(length_scale, distances.dtype)
        scale = eqx.error_if(scale, scale <= 0, "`length_scale` must be > 0.")
        weights = gaussian_weights(distances, found, scale)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return _weighted_sum(values, indices, weights)


@split_like_queries
def _weighted_sum(values, indices, weights):
    """`sum_j weights[..., j] values[indices[..., j]]`; missing neighbours (index `n`)
    must have weight 0."""
    found = indices < values.shape[0]
    neighbours = values[jnp.where(found, indices, 0)]  # (..., k, *feature)
    feature_axes = (None,) * (values.ndim - 1)
    return jnp.sum(weights[(..., *feature_axes)] * neighbours, axis=weights.ndim - 1)


class Interpolator(eqx.Module):
    """A field interpolated from values at the points of a `KDTree`: a trainable layer.

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

    tree: "KDTree"
    values: Float[Array, "n ..."]
    length_scale: Float[Array, ""] | None
    k: int = eqx.field(static=True)
    kernel: Kernel = eqx.field(static=True)
    power: float = eqx.field(static=True)

    def __init__(
        self,
        tree: "KDTree",
        values: ArrayLike,
        *,
        k: int = 8,
        kernel: Kernel = "idw",
        power: float = 2.0,
        length_scale: float | ArrayLike | None = None,
    ):
        """**Arguments:**

        - `tree`: a `kdeqx.KDTree` over `n` points.
        - `values`: the field at the points, shape `(n, ...)`, rows in the order of
            `tree.points`.
        - `k`: neighbours used per query (static).
        - `kernel`: `"idw"` (inverse distance, weights `1/d**power`) or
            `"gaussian"` (weights `exp(-d**2 / (2 length_scale**2))`, smooth).
        - `power`: the IDW exponent (static float > 0).
        - `length_scale`: the Gaussian kernel's width (a trainable leaf).
        """
        check_kernel(kernel, power, length_scale)
        self.tree = tree
        self.values = _check_values(tree, values)
        self.length_scale = (
            None
            if length_scale is None
            else jnp.asarray(length_scale, self.values.dtype)
        )
        self.k = check_static_int("k", k, 1)
        self.kernel = kernel
        self.power = float(power)

    def __call__(self, x: ArrayLike) -> Float[Array, "..."]:
        """Interpolates at `x` of shape `(..., d)`; returns `(..., *feature)`."""
        return interpolate(
            self.tree,
            x,
            self.values,
            k=self.k,
            kernel=self.kernel,
            power=self.power,
            length_scale=self.length_scale,
        )
