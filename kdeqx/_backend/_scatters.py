"""Scatters."""

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from .._custom_types import Array, Bool, Int, UInt


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


def axes_at(values: Array, indices: Int[Array, "..."], backend: str | None = None):
    """The columns of `values` (`(n, d)`) at rows `indices`, one array per axis
    shaped as `indices` (a finite row wherever `indices` is out of range; zeros
    when `n = 0`).

    On a TPU by one gather of whole rows, which it runs several times faster than
    one gather of scalars per axis; elsewhere column by column, which XLA:CPU runs
    faster than a gather of short rows (see `benchmarks/gathers.py`). `backend`
    defaults to `jax.default_backend()`."""
    n, d = values.shape
    if n == 0 or not gathers_rows_faster(backend):
        return axes_at_reference(values, indices)
    rows = gather_clamped(values, indices)
    return [rows[..., axis] for axis in range(d)]


def axes_at_reference(values, indices):
    n, d = values.shape
    if n == 0:
        return [jnp.zeros(indices.shape, values.dtype) for _ in range(d)]
    return [gather_clamped(values[:, axis], indices) for axis in range(d)]


def gathers_rows_faster(backend: str | None = None) -> bool:
    """Whether a gather of `(m, d)` rows runs several times faster than `d` gathers
    of `m` scalars: on a TPU (see `benchmarks/gathers.py`). `backend` defaults to
    `jax.default_backend()`."""
    return (jax.default_backend() if backend is None else backend) == "tpu"


def scatters_element_by_element(backend: str | None = None) -> bool:
    """Whether a scatter costs about as much for each of its updates, written or
    dropped, as a kernel's step: on a TPU (see `benchmarks/accelerator.py`).
    `backend` defaults to `jax.default_backend()`."""
    return (jax.default_backend() if backend is None else backend) == "tpu"


def append_in_order(
    kept: tuple[Array, ...],
    new: tuple[Array, ...],
    inside: Bool[Array, " tile"],
    count: Int[Array, ""],
    backend: str | None = None,
) -> tuple[Array, ...]:
    """The arrays `kept` (each of length `k`) with the entries of `new` where
    `inside` is set written, in order, from slot `count` on; those beyond slot `k`
    are dropped, and the other slots keep their entries.

    A TPU scatters element by element, so there each slot picks its one entry by a
    compare and a reduction over the tile: `k` times the work, at full width (see
    `benchmarks/accelerator.py`'s `query_ball_point`). Elsewhere, the scatter.
    `backend` defaults to `jax.default_backend()`.
    """
    if not scatters_element_by_element(backend):
        return append_in_order_reference(kept, new, inside, count)
    k = kept[0].shape[0]
    slots = jnp.arange(k, dtype=count.dtype)
    hits = _slots_of(inside, count, k)[:, None] == slots
    written = (slots >= count) & (slots < count + jnp.sum(inside, dtype=count.dtype))

    def picked(old, values):
        return jnp.where(written, picked_where(hits, values[:, None], axis=0), old)

    return tuple(picked(old, values) for old, values in zip(kept, new, strict=True))


def picked_where(hits: Bool[Array, "..."], values: Array, axis: int) -> Array:
    """Along `axis`, the entry of `values` where `hits` is set (at most one is; the
    two broadcast), or the dtype's least value where none is: by a compare and a
    reduction, not a scatter."""
    if values.dtype == jnp.bool_:
        return jnp.any(hits & values, axis=axis)
    least = (
        -jnp.inf
        if jnp.issubdtype(values.dtype, jnp.floating)
        else jnp.iinfo(values.dtype).min
    )
    return jnp.max(jnp.where(hits, values, least), axis=axis)


def append_in_order_reference(kept, new, inside, count, backend=None):
    del backend
    slot = _slots_of(inside, count, kept[0].shape[0])
    return tuple(
        old.at[slot].set(values, mode="drop")
        for old, values in zip(kept, new, strict=True)
    )


def _slots_of(inside, count, k: int):
    """Each entry's slot: `count` plus its rank among those inside; `k` (none) for
    those not inside."""
    slot = count + flags_before(inside).astype(count.dtype)
    return jnp.where(inside, slot, k)


def flags_before(flags: Bool[Array, "*groups size"]) -> Int[Array, "*groups size"]:
    """For each flag, how many flags are set before it (in row-major order).

    In 32-bit words: each flag's word's set bits below it, after the set bits of the
    words before. XLA:CPU runs a prefix sum over every flag as a reduction window
    per entry, markedly slower (see `benchmarks/accelerator.py`'s
    `query_ball_point` and `--part2` pairs and graphs, on the CPU). Rows longer than
    a word and not whole words take the prefix sum.
    """
    size = flags.shape[-1]
    if size > _WORD and size % _WORD:
        flat = flags.reshape(-1)
        return (jnp.cumsum(flat, dtype=jnp.int32) - flat).reshape(flags.shape)
    width = min(size, _WORD)
    # Constants (NumPy), not iotas: XLA:CPU would compile each iota into a kernel.
    bits = np.arange(width, dtype=np.uint32)
    # The bits are disjoint: their sum sets them.
    words = jnp.sum(flags.reshape(-1, width).astype(jnp.uint32) << bits, axis=1)
    below = (np.uint32(1) << bits) - np.uint32(1)
    within = lax.population_count(words[:, None] & below).astype(jnp.int32)
    counts = lax.population_count(words).astype(jnp.int32)
    return (_counts_before(counts)[:, None] + within).reshape(flags.shape)


def _counts_before(counts: Int[Array, " m"]) -> Int[Array, " m"]:
    """The exclusive prefix sum of `counts`. Of a few counts, as one masked sum: a
    prefix sum (a `reduce_window`) is several kernels on XLA:CPU, which the compile
    pays for."""
    m = counts.shape[0]
    if m > _MASKED_PREFIX_MAX:
        return jnp.cumsum(counts) - counts
    earlier = np.arange(m)[None, :] < np.arange(m)[:, None]  # a constant
    return jnp.sum(jnp.where(earlier, counts[None, :], 0), axis=1, dtype=counts.dtype)


_WORD = 32
_MASKED_PREFIX_MAX = 64
