"""Exact powers of two, written into and read from the bits of floats.

`jnp.frexp` and `jnp.ldexp` handle subnormal numbers, which XLA:CPU flushes to zero
anyway; built from the bits, the same powers cost a fraction of their compile time.
"""

from typing import Any

import jax.lax as lax
import jax.numpy as jnp

from ._custom_types import Array, Float, Int


def _int_dtype(dtype: Any) -> Any:
    return jnp.dtype(f"int{jnp.finfo(dtype).bits}")


def power_of_two(k: Int[Array, "*shape"], dtype: Any) -> Float[Array, "*shape"]:
    """`2**k` exactly, built from its bits; `k` is clipped to the normal range."""
    info = jnp.finfo(dtype)
    bias = info.maxexp - 1
    k = jnp.minimum(jnp.maximum(k, info.minexp), bias).astype(_int_dtype(dtype))
    return lax.bitcast_convert_type((k + bias) << info.nmant, dtype)


def binary_exponent(x: Float[Array, "*shape"]) -> Int[Array, "*shape"]:
    """`floor(log2(x))` of a positive normal `x`, read off its bits (int32). Zero and
    subnormals give `1 - maxexp` (below every normal exponent), `inf` and NaN
    `maxexp` (above them); negative `x` gives less than `1 - maxexp`."""
    info = jnp.finfo(x.dtype)
    biased = lax.bitcast_convert_type(x, _int_dtype(x.dtype)) >> info.nmant
    return (biased - (info.maxexp - 1)).astype(jnp.int32)
