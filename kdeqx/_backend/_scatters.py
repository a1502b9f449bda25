"""Scatters."""

import jax
import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Int, UInt


# Slot numbers: the build counts them unsigned where 32 bits hold them.
_Slots = Int[Array, "d m"] | UInt[Array, "d m"]


def move_rows(orders: _Slots, destination: _Slots):
    """`orders[j]` with entry `i` moved to `destination[j, i]` (a permutation of each
    row): one flat scatter, faster on XLA:CPU than a vmapped one."""
    d, _ = orders.shape
    rows = jnp.arange(d, dtype=jnp.int32)[:, None]
    return move_rows_in_place(jnp.zeros_like(orders), orders, rows, destination)


def move_rows_in_place(
    orders: _Slots,
    moving: Int[Array, "r m"] | UInt[Array, "r m"],
    rows: Int[Array, "r *words 1"],
    destination: Int[Array, "r *words width"] | UInt[Array, "r *words width"],
):
    """`orders` with each entry of `moving[r]` written to row `rows[r]` at position
    `destination[r]` (`rows` per word of `width` entries, `destination` per entry, in
    `moving`'s order); the rest of `orders` as it was. One flat scatter into
    `orders`' own buffer, which XLA reuses where it can (a while loop's state)."""
    d, m = orders.shape
    if d * m > jnp.iinfo(orders.dtype).max:
        rows = jnp.broadcast_to(rows, destination.shape).reshape(moving.shape)
        destination = destination.reshape(moving.shape)
        return orders.at[rows, destination].set(moving, unique_indices=True)
    flat = (rows.astype(orders.dtype) * m + destination).ravel()
    moved = orders.ravel().at[flat].set(moving.ravel(), unique_indices=True)
    return moved.reshape(d, m)


def move_rows_reference(orders, destination):
    def move_row(order, to):
        return jnp.zeros_like(order).at[to].set(order, unique_indices=True)

    return jax.vmap(move_row)(orders, destination)


def gather_clamped(array: Array, index: Int[Array, "..."]) -> Array:
    """`array[index]` along the first axis, with the index clamped into range.

    Traces to one gather (and the index's reshape), where `array[index]` adds the
    wrapping of negative indices and `.at[index].get` a reshape of the result (a
    smaller program, so a faster compile); lanes compute moves they then discard, so
    an index may lie outside the array.
    """
    batch = index.ndim
    dimensions = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(batch, batch + array.ndim - 1)),
        collapsed_slice_dims=(0,),
        start_index_map=(0,),
    )
    return lax.gather(
        array,
        lax.expand_dims(index, (batch,)),
        dimensions,
        (1, *array.shape[1:]),
        mode=lax.GatherScatterMode.CLIP,
    )


def gather_clamped_reference(array: Array, index: Int[Array, "..."]) -> Array:
    return array[jnp.clip(index, 0, array.shape[0] - 1)]
