"""Complex products, and the precision of every product kdeqx computes."""

import jax
import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array


# At the default precision a TPU multiplies float32 matrices in one bfloat16 pass,
# to about three significant digits. kdeqx's own products (series coefficients,
# local fits) ask for full precision, which changes nothing on a CPU.
FULL_PRECISION = lax.Precision.HIGHEST


def complex_factors(x: Array, backend: str | None = None) -> Array:
    """A complex array prepared for [`kdeqx._backend.complex_product`][]: on the CPU
    the stack `[re, im, re + im]` along a new leading axis, elsewhere `x` itself.

    Prepare an operand once when it takes part in many products. Index the prepared
    array from the right (`x[..., i, :, :]`): its leading axis differs per backend.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu":
        return x
    return jnp.stack([x.real, x.imag, x.real + x.imag])


def complex_product(
    lhs: Array, rhs: Array, dimension_numbers, backend: str | None = None
) -> Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` for complex operands prepared by
    [`kdeqx._backend.complex_factors`][] (the dimension numbers are those of the
    unprepared arrays).

    On the CPU this is three real products (Gauss's trick, as BLAS's `zgemm3m`):
    `(a + ib)(c + id) = (ac - bd) + i((a + b)(c + d) - ac - bd)`, in one batched real
    product. XLA:CPU's complex product runs well below its real throughput, so these
    three are faster than the one (see `benchmarks/operator_series.py`). The rounding
    differs from the reference's (the imaginary part's error is bounded by the norms
    of `a + b` and `c + d`, as for any fast complex product).
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu":
        return lax.dot_general(lhs, rhs, dimension_numbers, FULL_PRECISION)
    (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers

    def shifted(dims):
        return tuple(d + 1 for d in dims)

    numbers = (
        (shifted(contract_l), shifted(contract_r)),
        ((0,) + shifted(batch_l), (0,) + shifted(batch_r)),
    )
    ac, bd, total = lax.dot_general(lhs, rhs, numbers, FULL_PRECISION)
    return lax.complex(ac - bd, total - ac - bd)


def complex_product_reference(lhs: Array, rhs: Array, dimension_numbers) -> Array:
    return lax.dot_general(lhs, rhs, dimension_numbers, FULL_PRECISION)
