"""Sorting and selection.

- One sort of packed 64-bit integers: XLA:CPU sorts a single integer array several
  times faster than a (key, index) pair, which is what `jnp.argsort` sorts.
- Without a sort, where long sorts compile slowly (a TPU): a radix sort of short
  keys and a stable partition.
- The smallest entries of rows."""

import importlib

import jax
import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Bool, Float, Int, UInt


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


def smallest_first(
    x: Float[Array, "*rows m"], k: int
) -> tuple[Float[Array, "*rows k"], Int[Array, "*rows k"]]:
    """The `k` smallest entries of each row (the last axis), smallest first, and
    their positions: `lax.top_k` of `-x`.

    On a TPU, XLA compiles a narrow `lax.top_k` to a sort. Neither an exact
    `lax.approx_min_k` (also a sort there) nor a selection from counts and small
    matrix products (no sort at all) compiled the block engine's programs sooner
    (`benchmarks/accelerator.py --compile-report`): their compile time is not in
    their sorts.
    """
    negated, positions = lax.top_k(-x, k)
    return -negated, positions


def smallest_first_of(
    x: Float[Array, "*rows m"], payload: Array, k: int, backend: str | None = None
) -> tuple[Float[Array, "*rows k"], Array]:
    """`smallest_first`, with the entries of `payload` (shaped as `x`) at the
    positions of the `k` smallest, in place of the positions.

    On a TPU a narrow `lax.top_k` is a sort anyway: the payload sorted along spares
    the gather of its entries, which a TPU gathers one at a time (the block
    engine's descent, `benchmarks/accelerator.py --profile`). A stable sort keeps
    ties in order, as `lax.top_k` does. `backend` defaults to
    `jax.default_backend()`.
    """
    if not sorts_compile_slowly(backend):
        return smallest_first_of_reference(x, payload, k)
    values, taken = lax.sort((x, payload), num_keys=1, is_stable=True)
    return values[..., :k], taken[..., :k]


def smallest_first_of_reference(x, payload, k: int, backend: str | None = None):
    del backend
    values, positions = smallest_first(x, k)
    return values, jnp.take_along_axis(payload, positions, axis=-1)


def set_positions(
    running: Int[Array, " q"], places: Int[Array, "*m"]
) -> Int[Array, "*m"]:
    """The positions of the set flags numbered `places` (from 0, in order), `q`
    past the last, given their running count `running = cumsum(flags)`: a binary
    search each, with no sort and no scatter, for taking a few of many flags a
    batch at a time."""
    found = jnp.searchsorted(running, places + 1, side="left", method="scan")
    return found.astype(places.dtype)


def redone_in_groups(redo: Bool[Array, " q"], group: int, redo_rows, states, carry):
    """`states` (rows along the first axis) with the rows where `redo` is set
    replaced, `group` rows at a time and in order, by `redo_rows(rows, valid,
    carry) -> (found, carry)`, as many groups as they take (none where none is set).
    In a group past the last row to redo, `valid` is unset and `rows` is 0.

    **Returns:** `(states, carry)`.
    """
    q = redo.shape[0]
    index_dtype = jnp.int32
    running = jnp.cumsum(redo, dtype=index_dtype)
    count = running[-1]

    def one_group(c):
        g, states, carry = c
        rows = set_positions(running, g * group + jnp.arange(group, dtype=index_dtype))
        valid = rows < q
        rows = jnp.where(valid, rows, 0)
        found, carry = redo_rows(rows, valid, carry)
        keep = jnp.where(valid, rows, q)  # q: dropped
        states = jax.tree.map(
            lambda s, f: s.at[keep].set(f, mode="drop"), states, found
        )
        return g + 1, states, carry

    start = (jnp.zeros((), index_dtype), states, carry)
    _, states, carry = lax.while_loop(lambda c: c[0] * group < count, one_group, start)
    return states, carry


def sorts_compile_slowly(backend: str | None = None) -> bool:
    """Whether a long sort (or a narrow `top_k`) takes seconds to compile: on a TPU
    (see `benchmarks/accelerator.py`). `backend` defaults to
    `jax.default_backend()`."""
    return (jax.default_backend() if backend is None else backend) == "tpu"


def radix_order(keys: UInt[Array, " q"], bits: int, index_dtype) -> Int[Array, " q"]:
    """A stable sorting permutation of keys below `2**bits`, without a sort: a
    radix sort, `RADIX_BITS` a pass (in a loop: one pass compiled), each pass prefix
    counts of the digits and one scatter."""
    q = keys.shape[0]
    radix = 2**RADIX_BITS
    digits = jnp.arange(radix, dtype=index_dtype)

    def one_pass(p, carry):
        keys, order = carry
        shift = (p * RADIX_BITS).astype(keys.dtype)
        digit = ((keys >> shift) & (radix - 1)).astype(index_dtype)
        one_hot = digit[:, None] == digits
        # A key's place: the keys of smaller digits, then those of its own digit
        # that come before it. The prefix counts run down the long axis of a narrow
        # table (a TPU compiled a long one-dimensional prefix sum for many seconds).
        seen = jnp.cumsum(one_hot.astype(index_dtype), axis=0)
        counts = seen[-1]
        before = jnp.cumsum(counts) - counts
        place = jnp.sum(jnp.where(one_hot, seen - 1 + before, 0), axis=1)
        keys = jnp.zeros_like(keys).at[place].set(keys, unique_indices=True)
        order = jnp.zeros_like(order).at[place].set(order, unique_indices=True)
        return keys, order

    start = (keys, jnp.arange(q, dtype=index_dtype))
    return lax.fori_loop(0, -(-bits // RADIX_BITS), one_pass, start)[1]


# `radix_order` takes `RADIX_BITS` bits a pass.
RADIX_BITS = 4
