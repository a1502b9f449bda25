"""Reductions that XLA:CPU would hand to YNNPACK. XLA:CPU hands float reductions over
at least 4096 elements to YNNPACK kernels, which cost far more per call, inside a
loop, than work fused into its neighbours."""

import functools as ft
import operator

import jax
import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Bool, Float


def pick_one_hot(
    sources: tuple[tuple[Bool[Array, "k _"], Array], ...],
) -> Array:
    """`sum_s sum_j where(mask_s[:, j], values_s[j], 0)` for one-hot rows, which
    pick one entry of one source per output slot.

    Floats are picked as their bits: a float sum went to a YNNPACK kernel, which made
    the whole kNN query slower.
    """
    dtype = sources[0][1].dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return pick_one_hot_reference(sources)
    bits = jnp.dtype(f"int{8 * dtype.itemsize}")
    as_bits = tuple(
        (mask, lax.bitcast_convert_type(values, bits)) for mask, values in sources
    )
    return lax.bitcast_convert_type(pick_one_hot_reference(as_bits), dtype)


def pick_one_hot_reference(sources) -> Array:
    picks = [
        jnp.sum(jnp.where(mask, values[None, :], 0), axis=1, dtype=values.dtype)
        for mask, values in sources
    ]
    return ft.reduce(operator.add, picks)


def sum_nonnegative(terms: Float[Array, "... d"]) -> Float[Array, "..."]:
    """The sum over the last axis of non-negative `terms`, by one reduction with two
    outputs, the sum and the largest term; their maximum is the sum, bit for bit (a
    rounded sum of non-negative terms is never below one of them).

    XLA:CPU keeps this reduction in its own loop emitter, where kNN queries ran
    faster. (Plain additions, the other way around YNNPACK, were miscompiled: see
    `sum_by_additions`.)
    """
    zero = jnp.zeros((), terms.dtype)
    total, largest = lax.reduce(
        (terms, terms),
        (zero, zero),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
        (terms.ndim - 1,),
    )
    return jnp.maximum(total, largest)


def sum_nonnegative_reference(terms: Float[Array, "... d"]) -> Float[Array, "..."]:
    return jnp.sum(terms, axis=-1)


def sum_by_additions(terms: Float[Array, "... d"]) -> Float[Array, "..."]:
    """The sum over the last axis by plain additions, in order (rounding may differ
    from a reduction's in the last bit).

    A block's leaf distances are summed so (`Minkowski.leaf_distances`). One point's
    leaf distances summed this way made XLA:CPU return wrong k-nearest neighbours
    (d = 8, float32, in a vmapped walk): right with
    `--xla_disable_hlo_passes=algsimp`, so a miscompile in XLA's algebraic
    simplifier, which the test suite caught; those use `sum_nonnegative`.
    """
    total = terms[..., 0]
    for i in range(1, terms.shape[-1]):
        total = total + terms[..., i]
    return total


@jax.jit
def all_finite(array: Array) -> Bool[Array, ""]:
    """Whether every entry is finite: `a - a` is 0 where `a` is finite and NaN at NaN
    and +-inf, so one sum tests all entries, in one kernel (`isfinite` then `all` is
    three on XLA:CPU). Jitted: an eager check of a new shape compiles one program,
    not three."""
    return jnp.isfinite(jnp.sum(array - array))


def all_finite_reference(array: Array) -> Bool[Array, ""]:
    return jnp.all(jnp.isfinite(array))
