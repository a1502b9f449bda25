"""Input checks shared by every entry point: shapes and dtypes, then values."""

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from ._backend import all_finite
from ._backend._buckets import to_device
from ._custom_types import Array, ArrayLike, Float


def as_float_array(name: str, value: ArrayLike, dtype=None) -> Array:
    """Converts `value` to a real floating array, keeping float32/float64 as given.

    Integers are promoted to the default float dtype (or `dtype` when given); complex
    and boolean data have no meaning as coordinates and raise `TypeError`.
    """
    array = to_device(value)
    if jnp.issubdtype(array.dtype, jnp.bool_):
        raise TypeError(f"`{name}` must be real numbers, got a boolean array.")
    if jnp.issubdtype(array.dtype, jnp.complexfloating):
        raise TypeError(
            f"`{name}` must be real, got complex dtype {array.dtype}; pass the real "
            "coordinates (for example `jnp.stack([z.real, z.imag], -1)`)."
        )
    if dtype is not None:
        return array.astype(dtype)
    if not jnp.issubdtype(array.dtype, jnp.floating):
        return array.astype(jnp.result_type(float))
    return array


def is_concrete(array: Array) -> bool:
    """Whether `array` holds values now: not a tracer, and not traced by the
    operations on it either (as an array closed over by a jitted function is)."""
    if isinstance(array, jax.core.Tracer):
        return False
    return not isinstance(jnp.zeros((), jnp.int32) + 0, jax.core.Tracer)


def _finite_now(array: Array) -> bool:
    """Whether a concrete array is all finite: read in place by NumPy when it lives
    on one CPU device (no program to compile for each new shape), else reduced
    where it lives."""
    if isinstance(array, jax.Array):
        devices = array.devices()
        if len(devices) > 1 or next(iter(devices)).platform != "cpu":
            return bool(all_finite(array))
    return bool(np.isfinite(np.asarray(array)).all())


def check_finite(name: str, array: Array, *, traced: bool = True) -> Array:
    """Rejects NaN and inf: eagerly with `ValueError`, under `jit` via `eqx.error_if`.

    Returns `array` (under `jit`, the returned array carries the runtime check, so use
    it in place of the input). Either way the test is reduced where the array lives,
    so a sharded array is neither copied to the host nor gathered onto one device.
    With `traced=False` a traced array is returned unchecked, for callers that check
    it where it is used (a sharded tree: each device, on its own block, without the
    all-reduce that a check of the whole array would be).
    """
    if not is_concrete(array) and not traced:
        return array
    if is_concrete(array):
        if not _finite_now(array):
            bad = ~np.isfinite(np.asarray(array))
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"`{name}` must be finite, but holds {int(bad.sum())} NaN/inf "
                f"value(s) (first at index {first})."
            )
        return array
    # The check raises on a scalar tied back to the array, not on the array itself:
    # `error_if` on a sharded array would replicate it (its error branch is a host
    # callback shaped like the array) and so all-gather sharded queries.
    token = eqx.error_if(
        jnp.zeros((), array.dtype),
        ~all_finite(array),
        f"`{name}` must be finite (no NaN/inf).",
    )
    return array + token


def check_points_shape(name: str, array: Array) -> None:
    if array.ndim != 2:
        raise ValueError(
            f"`{name}` must have shape (n, d), got shape {tuple(array.shape)}."
        )
    if array.shape[1] < 1:
        raise ValueError(f"`{name}` must have d >= 1 columns, got shape {array.shape}.")


def check_queries_shape(name: str, array: Array, d: int) -> None:
    if array.ndim < 1 or array.shape[-1] != d:
        raise ValueError(
            f"`{name}` must have shape (..., {d}) to match the tree's points of "
            f"dimension d={d}, got shape {tuple(array.shape)}."
        )


def check_static_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"`{name}` must be a Python int (it is static: it fixes array shapes), "
            f"got {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return int(value)


def check_nonnegative(name: str, array: Array) -> Array:
    """Rejects negative values (and NaN/inf): eagerly, or via `eqx.error_if`."""
    array = check_finite(name, array)
    if is_concrete(array):
        if (np.asarray(array) < 0).any():
            raise ValueError(f"`{name}` must be >= 0, got {np.asarray(array).min()}.")
        return array
    token = eqx.error_if(
        jnp.zeros((), array.dtype), jnp.any(array < 0), f"`{name}` must be >= 0."
    )
    return array + token


def index_dtype_for(count: int):
    """int32 where it holds `count` indices, else int64 (which needs x64 enabled)."""
    if count < np.iinfo(np.int32).max:
        return jnp.int32
    if jax.config.read("jax_enable_x64"):
        return jnp.int64
    raise ValueError(
        f"{count} indices need 64-bit integers: enable them with "
        "`jax.config.update('jax_enable_x64', True)` before building the tree."
    )


def check_radius(r, batch: tuple[int, ...], dtype) -> Array:
    """A finite radius `>= 0`: a scalar, or one per query of shape `batch`."""
    r = as_float_array("r", r, dtype=dtype)
    if r.ndim > 0 and r.shape != batch:
        raise ValueError(
            f"`r` must be a scalar or have the queries' batch shape {batch}, got "
            f"shape {tuple(r.shape)}."
        )
    return check_nonnegative("r", r)


def check_positive(name: str, value, dtype) -> Float[Array, ""]:
    """A scalar `> 0`: eagerly `ValueError`, under `jit` via `eqx.error_if`."""
    value = jnp.asarray(value, dtype)
    if value.ndim != 0:
        raise ValueError(f"`{name}` must be a scalar, got shape {value.shape}.")
    if is_concrete(value):
        if not value > 0:
            raise ValueError(f"`{name}` must be > 0, got {value}.")
        return value
    return eqx.error_if(value, value <= 0, f"`{name}` must be > 0.")


def check_nonnegative_smoothing(
    smoothing, n: int, dtype
) -> Float[Array, ""] | Float[Array, " n"]:
    """scipy's RBF `smoothing`: a scalar or one value per point, finite and `>= 0`
    (eagerly `ValueError`, under `jit` via `eqx.error_if`)."""
    smoothing = as_float_array("smoothing", smoothing, dtype)
    if smoothing.shape not in ((), (n,)):
        raise ValueError(
            f"`smoothing` must be a scalar or have shape ({n},), one per point, got "
            f"shape {tuple(smoothing.shape)}."
        )
    bad = ~jnp.all(jnp.isfinite(smoothing) & (smoothing >= 0))
    if is_concrete(smoothing):
        if bad:
            raise ValueError("`smoothing` must be finite and >= 0.")
        return smoothing
    return eqx.error_if(smoothing, bad, "`smoothing` must be finite and >= 0.")


def check_values(values: ArrayLike, n: int) -> Float[Array, "n ..."]:
    """Values given at the `n` points: shape `(n, ...)`, real and finite."""
    values = as_float_array("values", values)
    if values.ndim < 1 or values.shape[0] != n:
        raise ValueError(
            f"`values` must have one row per point, shape ({n}, ...), got shape "
            f"{tuple(values.shape)}."
        )
    return check_finite("values", values)


def as_period(box, d: int, dtype) -> Float[Array, " d"] | None:
    """scipy's `boxsize` as `(d,)` lengths (`<= 0`: not periodic), or `None`."""
    if box is None:
        return None
    period = as_float_array("box", box, dtype=dtype)
    if period.ndim > 1 or period.shape not in ((), (d,)):
        raise ValueError(
            f"`box` must be a scalar or have shape ({d},) to match the points, "
            f"got shape {tuple(period.shape)}."
        )
    return check_finite("box", jnp.broadcast_to(period, (d,)))


def check_scalar_radius(name: str, r, dtype) -> Float[Array, ""]:
    """A finite scalar distance `>= 0`."""
    r = as_float_array(name, r, dtype=dtype)
    if r.ndim != 0:
        raise ValueError(f"`{name}` must be a scalar, got shape {tuple(r.shape)}.")
    return check_nonnegative(name, r)


def check_radii(r, dtype, *, sorted_: bool) -> Float[Array, "*radii"]:
    """Radii: a scalar or a 1-D array, finite and `>= 0`; with `sorted_`, also
    non-decreasing (checked eagerly, or via `eqx.error_if` under `jit`)."""
    if isinstance(r, list | tuple):  # scipy users pass lists of radii
        r = np.asarray(r)
    r = as_float_array("r", r, dtype=dtype)
    if r.ndim > 1:
        raise ValueError(f"`r` must be a scalar or 1-D, got shape {tuple(r.shape)}.")
    r = check_nonnegative("r", r)
    if not sorted_ or r.ndim == 0:
        return r
    decreasing = jnp.any(r[1:] < r[:-1])
    message = "`r` must be non-decreasing when `cumulative=False` (bin edges)."
    if is_concrete(r):
        if bool(decreasing):
            raise ValueError(message)
        return r
    return eqx.error_if(r, decreasing, message)


def check_weights(weights, n: int, dtype) -> Float[Array, " n"]:
    """Per-point weights: shape `(n,)`, real and finite."""
    weights = as_float_array("weights", weights, dtype=dtype)
    if weights.shape != (n,):
        raise ValueError(
            f"`weights` must have one entry per point, shape ({n},), got shape "
            f"{tuple(weights.shape)}."
        )
    return check_finite("weights", weights)
