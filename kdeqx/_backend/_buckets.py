"""Size buckets: eager calls of nearby sizes share one compiled program.

JAX compiles a program for every new shape. Called outside any trace, a query pads
its batch of queries to the next bucket (`bucket`: for small batches `2**j` or
`3 * 2**(j - 1)` rows, as jaxknn does) and returns the first rows of the answer, so
that a script whose batch sizes vary compiles once per bucket. The padding
and the slicing happen in NumPy where the arrays live on the host, and so compile
nothing themselves; elsewhere they are two small `jax.numpy` operations.
"""

import functools as ft
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from .._custom_types import Array, ArrayLike
from ._compile import outside_any_trace


# Up to this many rows a bucket is `2**j` or `3 * 2**(j - 1)`: small batches cost
# their compile, not their run, so few buckets are best. Beyond it, eight buckets per
# octave (at most an eighth of padding), and beyond `_EXACT_ABOVE` the exact size:
# there every call would pay for the padding, and large batches rarely vary. See
# `benchmarks/matched.py`, whose eager calls take 1e5 queries.
_COARSE_UP_TO = 4096
_EXACT_ABOVE = 65536


def bucket(size: int) -> int:
    """The size bucket of `size` rows, which kdeqx pads eager queries to (and sizes
    the capacities it counts itself to), so that nearby sizes share one compiled
    program: `2**j` or `3 * 2**(j - 1)` up to 4096 rows (at most a third of
    padding); then the next multiple of an eighth of the power of two below (at
    most an eighth of padding); above 65536 rows, `size` itself.

    **Arguments:**

    - `size`: a Python int `>= 0`.

    **Returns:** the bucket, a Python int `>= size`.
    """
    if size < 0:
        raise ValueError(f"`size` must be >= 0, got {size}.")
    if size > _EXACT_ABOVE:
        return size
    kept_bits = 2 if size <= _COARSE_UP_TO else 4
    step = 1 << max(0, (size - 1).bit_length() - kept_bits)
    return -(-size // step) * step


def _on_host(array) -> bool:
    """Whether `array` is NumPy data or a `jax.Array` on the CPU, which NumPy reads
    in place (or, spread over several CPU devices, gathers by a copy in memory: far
    cheaper than a `jax.numpy` operation on each device)."""
    if isinstance(array, jax.core.Tracer):
        return False
    if not isinstance(array, jax.Array):
        return True
    return all(device.platform == "cpu" for device in array.devices())


def _is_committed_to_several_devices(array) -> bool:
    return isinstance(array, jax.Array) and len(array.devices()) > 1


def to_device(value: ArrayLike) -> Array:
    """`value` as a JAX array. Data from the host is put on the device as it is:
    `jnp.asarray` would compile a copying program for each new shape."""
    if isinstance(value, jax.Array):
        return value
    return jax.device_put(np.asarray(value))


def pad_rows(array, rows: int, *, fill: str = "first"):
    """`array` with its leading axis padded to `rows`: by repeating its first row
    (`fill="first"`, queries that are valid and answered like the others) or with
    zeros (`fill="zeros"`)."""
    missing = rows - np.shape(array)[0]
    if missing == 0:
        return array
    xp = np if _on_host(array) else jnp
    array = xp.asarray(array)
    if fill == "first":
        padding = xp.broadcast_to(array[:1], (missing, *array.shape[1:]))
    else:
        padding = xp.zeros((missing, *array.shape[1:]), array.dtype)
    return to_device(xp.concatenate([array, padding]))


def pad_to_bucket(x: ArrayLike) -> Array:
    """`x` with its leading axis padded to its size bucket (see `kdeqx.bucket`) by
    repeating its first row: for a jitted function of your own, so that batches of
    nearby sizes share its compiled program. Keep the first `len(x)` rows of what
    it returns.

    ```python
    @jax.jit
    def nearest(tree, x):
        return tree.query(x, k=8)

    distances, indices = nearest(tree, kdeqx.pad_to_bucket(x))
    distances, indices = distances[: len(x)], indices[: len(x)]
    ```

    **Arguments:**

    - `x`: an array with at least one axis and at least one row (queries of shape
        `(q, d)`, for example).

    **Returns:** `x` padded to `(kdeqx.bucket(q), ...)`; `x` itself when `q` is a
    bucket.
    """
    if np.ndim(x) < 1 or np.shape(x)[0] < 1:
        raise ValueError(
            f"`x` must have a leading axis with at least one row, got shape "
            f"{np.shape(x)}."
        )
    return to_device(pad_rows(x, bucket(np.shape(x)[0])))


def first_rows(array, rows: int, batch: tuple[int, ...], sentinel=None):
    """The first `rows` rows of `array`, their leading axis reshaped to `batch`; in
    an integer array, `sentinel = (old, new)` replaces the value `old` by `new`."""
    moved = sentinel is not None and jnp.issubdtype(array.dtype, jnp.integer)
    if array.shape[0] == rows and len(batch) == 1 and not moved:
        return array
    xp = np if _on_host(array) else jnp
    array = xp.asarray(array)[:rows].reshape((*batch, *array.shape[1:]))
    if moved and sentinel is not None:
        old, new = sentinel
        array = xp.where(array == old, new, array).astype(array.dtype)
    return to_device(array)


def queries_in_buckets(*per_query: str, points_in_bucket: bool = False):
    """Decorates a query method `method(self, x, ...)` of a tree: called eagerly, its
    queries `x` of shape `(..., d)` (and the arguments named in `per_query` that have
    one value per query) are flattened and padded to a bucket, and every array of
    the answer is cut back to the batch shape `...`. With `points_in_bucket`, the
    tree answers as its build bucket (`self._in_build_bucket()`, whose sentinel
    index is its number of rows, put back to `n` in the answer), so that trees of
    nearby `n` share the query's program too. Under any transformation, or for
    queries spread over several devices, the method runs as it is."""

    def decorate(method: Callable) -> Callable:
        signature = inspect.signature(method)

        @ft.wraps(method)
        def bucketed(self, x, *args, **kwargs):
            shape = np.shape(x)
            if (
                not outside_any_trace()
                or len(shape) < 1
                or shape[-1] != self.d  # the method says what is wrong with `x`
                or _is_committed_to_several_devices(x)
            ):
                return method(self, x, *args, **kwargs)
            batch = shape[:-1]
            size = math.prod(batch)
            rows = bucket(size)
            tree = self._in_build_bucket() if points_in_bucket else self
            if size == 0 or (tree is self and rows == size and len(batch) == 1):
                return method(self, x, *args, **kwargs)
            bound = signature.bind(tree, x, *args, **kwargs)
            for name in per_query:
                value = bound.arguments.get(name)
                if value is None or np.ndim(value) == 0:
                    continue
                # Any other shape runs as it is: the method broadcasts it, or says
                # what is wrong with it.
                if np.shape(value) != batch or _is_committed_to_several_devices(value):
                    return method(self, x, *args, **kwargs)
                flat = np.asarray(value).reshape(size)
                bound.arguments[name] = pad_rows(flat, rows)
            bound.arguments["x"] = pad_rows(_flattened(x, size), rows)
            answer = method(*bound.args, **bound.kwargs)
            sentinel = None if tree is self else (tree.n, self.n)
            return jax.tree.map(lambda a: first_rows(a, size, batch, sentinel), answer)

        return bucketed

    return decorate


def _flattened(x, size: int) -> Any:
    shape = np.shape(x)
    if _on_host(x):
        return np.asarray(x).reshape(size, shape[-1])
    return jnp.reshape(x, (size, shape[-1]))
