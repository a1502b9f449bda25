"""Interpolation from the k nearest points: the weighted mean, and the trainable
`Interpolator` (the kernels are in `_kernels.py`)."""

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp

from .._custom_types import Array, ArrayLike, Float
from .._validate import check_static_int, check_values
from ._frozen import Frozen
from ._kernels import AbstractKernel, as_kernel, Gaussian, IDW, KernelName, MLS, RBF
from ._rbf import Radial


if TYPE_CHECKING:
    from .._tree._tree import AbstractKDTree


Kernel = KernelName | AbstractKernel


# Jitted: called eagerly, one program to compile for a new shape, not one per operation.


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

    `model.tree` gives the tree back, `model.kernel_module` the kernel with its
    current parameters. For gradients with respect to the points, call
    `tree.interpolate` on a tree built from them.
    """

    frozen_tree: Frozen["AbstractKDTree"]
    values: Float[Array, "n ..."]
    log_length_scale: Float[Array, ""] | None
    log_epsilon: Float[Array, ""] | None
    smoothing: Float[Array, ""] | Float[Array, " n"]
    k: int = eqx.field(static=True)
    kernel: KernelName = eqx.field(static=True)
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
        - `kernel`: a kernel module ([`kdeqx.IDW`][], [`kdeqx.Gaussian`][],
            [`kdeqx.RBF`][], [`kdeqx.MLS`][]), or its name with the options below.
        - `power`, `length_scale`, `p`, `rbf`, `epsilon`, `degree`, `smoothing`,
            `exact`: as in `kdeqx.AbstractKDTree.interpolate`, checked here.
            `length_scale`, `epsilon` and `smoothing` become trainable leaves.
        """
        module = as_kernel(
            kernel,
            power=power,
            length_scale=length_scale,
            rbf=rbf,
            epsilon=epsilon,
            degree=degree,
            smoothing=smoothing,
            exact=exact,
        )
        self.values = check_values(values, tree.n)
        dtype = self.values.dtype
        self.k = check_static_int("k", k, 1)
        _, metric, _ = tree._interpolation_kernel(self.k, p, module)
        self.p = metric.p
        self.frozen_tree = Frozen(tree)
        self.kernel, self.power, self.rbf = _kernel_name(module), 2.0, rbf
        self.degree, self.exact = None, False
        self.log_length_scale = self.log_epsilon = None
        self.smoothing = jnp.zeros((), dtype)
        if isinstance(module, IDW):
            self.power = module.power
        elif isinstance(module, Gaussian):
            self.log_length_scale = _optional_log(module.length_scale, dtype)
        elif isinstance(module, RBF):
            self.rbf, self.degree = module.rbf, module.degree
            self.log_epsilon = _optional_log(module.epsilon, dtype)
            self.smoothing = jnp.asarray(module.smoothing, dtype)
        elif isinstance(module, MLS):
            self.degree, self.exact = module.degree, module.exact

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

    @property
    def kernel_module(self) -> AbstractKernel:
        """The kernel, with the parameters as trained."""
        if self.kernel == "idw":
            return IDW(self.power)
        if self.kernel == "gaussian":
            assert self.length_scale is not None
            return Gaussian(self.length_scale)
        if self.kernel == "rbf":
            return RBF(
                self.rbf,
                epsilon=self.epsilon,
                degree=self.degree,
                smoothing=jnp.maximum(self.smoothing, 0),
            )
        assert self.degree is not None
        return MLS(self.degree, exact=self.exact)

    def __call__(self, x: ArrayLike) -> Float[Array, "..."]:
        """Interpolates at `x` of shape `(..., d)`; returns `(..., *feature)`."""
        return self.tree.interpolate(
            x, self.values, k=self.k, p=self.p, kernel=self.kernel_module
        )


def _kernel_name(kernel: AbstractKernel) -> KernelName:
    names: dict[type, KernelName] = {
        IDW: "idw",
        Gaussian: "gaussian",
        RBF: "rbf",
        MLS: "mls",
    }
    return names[type(kernel)]


def _optional_log(value, dtype) -> Float[Array, ""] | None:
    # Positive already: `tree._interpolation_kernel` checked it.
    return None if value is None else jnp.log(jnp.asarray(value, dtype))


def _optional_exp(value) -> Float[Array, ""] | None:
    return None if value is None else jnp.exp(value)
