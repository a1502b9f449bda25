"""Sorting: one sort of packed 64-bit integers. XLA:CPU sorts a single integer array
several times faster than a (key, index) pair, which is what `jnp.argsort` sorts."""

import importlib

import jax
import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Float, Int, UInt


def enable_x64_locally():
    """A context in which 64-bit types exist, whatever the user's x64 setting."""
    # `jax.enable_x64` in recent JAX, `jax.experimental.enable_x64` before.
    context = getattr(jax, "enable_x64", None)
    if context is None:
        context = getattr(importlib.import_module("jax.experimental"), "enable_x64")
    return context(True)


def float32_sort_keys(values: Float[Array, "*shape"]) -> UInt[Array, "*shape"]:
    """uint32 keys whose unsigned order is the order of `values` rounded to float32."""
    values = jnp.where(values == 0, 0, values).astype(jnp.float32)  # -0 sorts as +0
    bits = lax.bitcast_convert_type(values, jnp.uint32)
    negative = (bits >> 31).astype(bool)
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def argsort_keys(keys: UInt[Array, " m"]) -> Int[Array, " m"] | UInt[Array, " m"]:
    """A stable argsort of uint32 `keys` (ties by position): a 32-bit key and a 32-bit
    position packed into one uint64 and sorted together. The packed keys are unique,
    so XLA's unstable sort serves: on XLA:CPU it is much faster on keys that are
    mostly in order already, and no slower on random ones."""
    m = keys.shape[0]
    if m > 2**32:  # positions would not fit in 32 bits
        return argsort_keys_reference(keys)
    position = jnp.arange(m, dtype=jnp.uint32)
    with enable_x64_locally():
        packed = keys.astype(jnp.uint64) << 32 | position.astype(jnp.uint64)
        return lax.sort(packed, is_stable=False).astype(jnp.uint32)


def argsort_keys_reference(keys: UInt[Array, " m"]) -> Int[Array, " m"]:
    return jnp.argsort(keys, stable=True)
