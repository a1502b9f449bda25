"""Numbers and matrices as a mantissa times an integer power of two.

`X_k / k!` spans hundreds of decades as `k` grows (1e-43 at `k = 100` for the
question's example), beyond float32, and `k!` itself overflows float64 at `k = 171`.
The recursion therefore carries every coefficient as a mantissa, whose largest real or
imaginary part lies in `[0.5, 1)`, and an integer exponent; sums of products are
rescaled by exact powers of two before adding, so nothing overflows and terms far
below the largest of a sum vanish harmlessly.
"""

from typing import Any

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Inexact, Int, Real, Shaped

from .._floats import binary_exponent, power_of_two


# The exponent of a zero coefficient: any product or sum carrying it rescales to zero.
ZERO_EXPONENT = -(2**20)


def exponent_of(size: Real[Array, "*shape"]) -> Int[Array, "*shape"]:
    """The `e` with `size = m * 2**e`, `0.5 <= m < 1`, read off the bits of `size >= 0`.

    Zero (and anything the CPU flushes to zero) gets `ZERO_EXPONENT`. This is
    `jnp.frexp` without its subnormal handling, at a fraction of the compile time.
    """
    exponent = binary_exponent(size)
    lowest = 1 - jnp.finfo(size.dtype).maxexp  # zero and subnormals
    return jnp.where(exponent == lowest, ZERO_EXPONENT, exponent + 1)


def ldexp(x: Inexact[Array, "*batch"], k: Int[Array, "*#batch"]) -> Array:
    """`x * 2**k` for any integer `k`, without overflow in the scale factor.

    Split into two halves so that each factor is a normal number whenever the result
    is: the product is exact, and underflows or overflows only if the result does.
    """
    real_dtype = jnp.finfo(x.dtype).dtype
    half = k >> 1
    return x * power_of_two(half, real_dtype) * power_of_two(k - half, real_dtype)


def powers_of_two(k: Int[Array, "*shape"], dtype: Any) -> Real[Array, "*shape"]:
    """`2**k` for `k <= 0`: the weights that rescale terms to the largest of their
    sum. Below the normal range it is the smallest normal number rather than zero
    (one bit pattern instead of two, a smaller program): a term scaled by it is still
    far below the precision of the sum it joins."""
    return power_of_two(k, dtype)


class Scaled(eqx.Module):
    """Arrays `mantissa[i] * 2**exponent[i]`, one exponent per array of the last
    `core` axes (matrices, or scalars with `core = 0`).

    The largest real or imaginary part of a nonzero mantissa lies in `[0.5, 1)`; a zero
    has exponent `ZERO_EXPONENT`.
    """

    mantissa: Inexact[Array, "..."]
    exponent: Int[Array, "*batch"]

    @staticmethod
    def of(x: Inexact[Array, "..."], core: int = 2) -> "Scaled":
        axes = tuple(range(x.ndim - core, x.ndim))
        # The exponent is piecewise constant in x: no gradient through its choice.
        size = lax.stop_gradient(
            jnp.max(jnp.maximum(jnp.abs(x.real), jnp.abs(x.imag)), axis=axes)
        )
        exponent = exponent_of(size)
        shape = exponent.shape + (1,) * core
        return Scaled(ldexp(x, -exponent.reshape(shape)), exponent)

    def values(self) -> Inexact[Array, "..."]:
        core = self.mantissa.ndim - self.exponent.ndim
        shape = self.exponent.shape + (1,) * core
        return ldexp(self.mantissa, self.exponent.reshape(shape))

    def __getitem__(self, index: Any) -> "Scaled":
        return Scaled(self.mantissa[index], self.exponent[index])

    def with_row(self, i: Int[Array, ""], row: "Scaled") -> "Scaled":
        """`self` with row `i` (along the first axis) replaced by `row`."""
        return Scaled(
            lax.dynamic_update_index_in_dim(self.mantissa, row.mantissa, i, 0),
            lax.dynamic_update_index_in_dim(self.exponent, row.exponent, i, 0),
        )


def normalised(
    total: Inexact[Array, "..."], top: Int[Array, "*batch"], core: int = 2
) -> Scaled:
    """`total * 2**top` in scaled form: a sum whose terms were scaled by `2**-top`
    relative to the largest of them."""
    scaled = Scaled.of(total, core)
    return Scaled(scaled.mantissa, jnp.maximum(top + scaled.exponent, ZERO_EXPONENT))


def zeros(shape: tuple[int, ...], dtype: Any, core: int = 2) -> Scaled:
    exponent_shape = shape[: len(shape) - core]
    return Scaled(
        jnp.zeros(shape, dtype), jnp.full(exponent_shape, ZERO_EXPONENT, jnp.int32)
    )


def factorials(
    order: int, dtype: Any
) -> tuple[Real[Array, " terms"], Shaped[Array, " terms"]]:
    """`k! = mantissa[k] * 2**exponent[k]` for `k = 0..order`, without overflow."""

    def step(carry, k):
        mantissa, exponent = carry
        product = mantissa * k
        # product >= 0.5, so the rescaling factor is a normal number.
        shift = exponent_of(product)
        mantissa = product * power_of_two(-shift, dtype)
        return (mantissa, exponent + shift), (mantissa, exponent + shift)

    one = (jnp.asarray(0.5, dtype), jnp.asarray(1, jnp.int32))
    ks = jnp.arange(1, order + 1, dtype=dtype)
    _, (mantissas, exponents) = lax.scan(step, one, ks)
    return (
        jnp.concatenate([one[0][None], mantissas]),
        jnp.concatenate([one[1][None], exponents]),
    )
