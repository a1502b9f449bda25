"""Comparing (squared distance, index) pairs."""

import contextlib

import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Bool, Float, Int, UInt
from ._scatters import picked_where
from ._sorting import enable_x64_locally


def lexicographic_less(d2_a, index_a, d2_b, index_b):
    """`(d2_a, index_a) < (d2_b, index_b)`: distance first, then the lower index."""
    return (d2_a < d2_b) | ((d2_a == d2_b) & (index_a < index_b))


def pairs_before(
    d2_a: Float[Array, " a"],
    index_a: Int[Array, " a"],
    d2_b: Float[Array, " b"],
    index_b: Int[Array, " b"],
) -> Bool[Array, "b a"]:
    """`[i, j]`: whether pair `j` of `a` comes before pair `i` of `b`.

    For squared distances `>= 0` and indices `>= -1`. With 32-bit distances and
    indices, each pair is ordered by one comparison of uint64 keys rather than the five
    of the lexicographic order (kNN queries ran faster). Written in `lax` alone:
    inside the local x64 context each `jax.numpy` function would be traced afresh,
    which lengthened a query's first call.
    """
    if d2_a.dtype.itemsize != 4 or index_a.dtype.itemsize != 4:
        return pairs_before_reference(d2_a, index_a, d2_b, index_b)
    shape = (d2_b.shape[0], d2_a.shape[0])
    with enable_x64_locally():
        keys_a = lax.broadcast_in_dim(_packed_keys(d2_a, index_a), shape, (1,))
        keys_b = lax.broadcast_in_dim(_packed_keys(d2_b, index_b), shape, (0,))
        return lax.lt(keys_a, keys_b)


def pairs_before_reference(d2_a, index_a, d2_b, index_b) -> Bool[Array, "b a"]:
    return lexicographic_less(
        d2_a[None, :], index_a[None, :], d2_b[:, None], index_b[:, None]
    )


def packs_pairs(d2_dtype, index_dtype) -> bool:
    """Whether `(d2, index)` pairs of these dtypes fit one uint64 key."""
    return jnp.dtype(d2_dtype).itemsize == 4 and jnp.dtype(index_dtype).itemsize == 4


def pair_keys_context(d2_dtype, index_dtype):
    """The context in which `pack_pairs`' keys exist (x64, for packed keys)."""
    if packs_pairs(d2_dtype, index_dtype):
        return enable_x64_locally()
    return contextlib.nullcontext()


def pack_pairs(d2: Array, indices: Array) -> tuple[Array, ...]:
    """`(d2, index)` pairs as keys in their lexicographic order: one uint64 array
    where the pair fits (compared and moved in one operation each, rather than five
    and two), else the two arrays. Use inside `pair_keys_context`, in `lax` alone."""
    if packs_pairs(d2.dtype, indices.dtype):
        return (_packed_keys(d2, indices),)
    return d2, indices


def unpack_pairs(keys: tuple[Array, ...], d2_dtype, index_dtype) -> tuple[Array, Array]:
    if len(keys) == 2:
        return keys[0], keys[1]
    (packed,) = keys
    high = lax.shift_right_logical(packed, jnp.uint64(32))
    high = lax.convert_element_type(high, jnp.uint32)
    low = lax.convert_element_type(packed, jnp.uint32)
    low = lax.sub(low, jnp.uint32(1))
    return (
        lax.bitcast_convert_type(high, d2_dtype),
        lax.bitcast_convert_type(low, index_dtype),
    )


def pair_halves(d2: Array, indices: Array) -> UInt[Array, "*shape 2"]:
    """Pairs that pack (`packs_pairs`) as the two uint32 halves of their packed keys,
    along a new last axis: the distance's bits, then `index + 1`. They need no x64."""
    high = lax.bitcast_convert_type(d2, jnp.uint32)
    low = lax.add(lax.bitcast_convert_type(indices, jnp.uint32), jnp.uint32(1))
    return jnp.stack([high, low], axis=-1)


def pairs_of_halves(
    halves: UInt[Array, "*shape 2"], d2_dtype, index_dtype
) -> tuple[Array, Array]:
    """`pair_halves`, undone."""
    high, low = halves[..., 0], halves[..., 1]
    return (
        lax.bitcast_convert_type(high, d2_dtype),
        lax.bitcast_convert_type(lax.sub(low, jnp.uint32(1)), index_dtype),
    )


def precedes_halves(d2: Array, index: Array, halves: UInt[Array, "*shape 2"]):
    """Whether the pair `(d2, index)` (`d2 >= 0`, or -0) comes before the pair whose
    `pair_halves` are `halves`, compared in the halves themselves: a loop that reads
    the halves then only slices them, which XLA:CPU keeps in the loop's kernel (it
    hoists a conversion of loop-invariant halves into kernels of their own)."""
    # The sign bit cleared: -0 as +0.
    high = lax.bitwise_and(
        lax.bitcast_convert_type(d2, jnp.uint32), jnp.uint32(0x7FFFFFFF)
    )
    low = lax.add(lax.bitcast_convert_type(index, jnp.uint32), jnp.uint32(1))
    other_high, other_low = halves[..., 0], halves[..., 1]
    return (high < other_high) | ((high == other_high) & (low < other_low))


def keys_of_halves(halves: UInt[Array, "m 2"]) -> UInt[Array, " m"]:
    """`pair_halves` of `m` pairs as their packed keys, inside `pair_keys_context`."""
    high, low = (
        lax.convert_element_type(lax.index_in_dim(halves, i, 1, False), jnp.uint64)
        for i in (0, 1)
    )
    return lax.bitwise_or(lax.shift_left(high, jnp.uint64(32)), low)


def halves_of_keys(keys: UInt[Array, " m"]) -> UInt[Array, "m 2"]:
    """`keys_of_halves`, undone (inside `pair_keys_context`)."""
    high = lax.convert_element_type(
        lax.shift_right_logical(keys, jnp.uint64(32)), jnp.uint32
    )
    low = lax.convert_element_type(keys, jnp.uint32)
    return lax.concatenate([lax.expand_dims(high, (1,)), lax.expand_dims(low, (1,))], 1)


def largest_pairs(keys: tuple[Array, ...], size: int) -> tuple[Array, ...]:
    """`size` keys that sort after every pair."""
    if len(keys) == 1:
        return (lax.full((size,), jnp.iinfo(jnp.uint64).max, jnp.uint64),)
    d2, indices = keys
    return (
        lax.full((size,), jnp.inf, d2.dtype),
        lax.full((size,), jnp.iinfo(indices.dtype).max, indices.dtype),
    )


def pairs_minmax(a: tuple[Array, ...], b: tuple[Array, ...]):
    """The elementwise lesser and greater of two arrays of keys."""
    if len(a) == 1:
        return (lax.min(a[0], b[0]),), (lax.max(a[0], b[0]),)
    a_first = lexicographic_less(*a, *b)
    low = tuple(lax.select(a_first, x, y) for x, y in zip(a, b, strict=True))
    high = tuple(lax.select(a_first, y, x) for x, y in zip(a, b, strict=True))
    return low, high


def sort_pairs(
    d2: Float[Array, "*batch m"], indices: Int[Array, "*batch m"]
) -> tuple[Float[Array, "*batch m"], Int[Array, "*batch m"]]:
    """Sorts each row of `(d2 >= 0, index >= -1)` pairs lexicographically: one sort of
    packed uint64 keys where the pairs fit, which XLA:CPU sorts several times faster
    than a two-key sort."""
    if not packs_pairs(d2.dtype, indices.dtype):
        if jnp.dtype(d2.dtype).itemsize == 8 and d2.shape[-1] < 2**32:
            return _sort_wide_pairs(d2, indices)
        return sort_pairs_reference(d2, indices)
    with enable_x64_locally():
        (keys,) = pack_pairs(d2, indices)
        keys = lax.sort(keys, dimension=keys.ndim - 1)
        return unpack_pairs((keys,), d2.dtype, indices.dtype)


def sort_index_pairs(
    rows: Int[Array, " m"], cols: Int[Array, " m"]
) -> tuple[Int[Array, " m"], Int[Array, " m"]]:
    """Sorts `(row, col)` pairs of non-negative 32-bit indices by row, then column:
    one sort of packed uint64 keys (several times faster on XLA:CPU than a two-key
    sort)."""
    if jnp.dtype(rows.dtype).itemsize != 4 or jnp.dtype(cols.dtype).itemsize != 4:
        return sort_index_pairs_reference(rows, cols)
    with enable_x64_locally():
        high, low = (
            lax.convert_element_type(
                lax.bitcast_convert_type(a, jnp.uint32), jnp.uint64
            )
            for a in (rows, cols)
        )
        keys = lax.sort(lax.bitwise_or(lax.shift_left(high, jnp.uint64(32)), low))
        high = lax.shift_right_logical(keys, jnp.uint64(32))
        return (
            lax.bitcast_convert_type(
                lax.convert_element_type(high, jnp.uint32), rows.dtype
            ),
            lax.bitcast_convert_type(
                lax.convert_element_type(keys, jnp.uint32), cols.dtype
            ),
        )


def sort_index_pairs_reference(rows, cols):
    rows, cols = lax.sort((rows, cols), num_keys=2)
    return rows, cols


def sort_edges(
    senders: Int[Array, " m"],
    receivers: Int[Array, " m"],
    images: Int[Array, " m"],
    nodes: int,
    image_count: int,
) -> tuple[Int[Array, " m"], Int[Array, " m"], Int[Array, " m"]]:
    """Sorts edges by sender, then receiver, then image (`0 <= senders, receivers <
    nodes`, `0 <= images < image_count`): one sort of mixed-radix uint64 keys where
    they fit, as `sort_index_pairs`."""
    if nodes * nodes * image_count >= 2**64:
        return sort_edges_reference(senders, receivers, images)
    with enable_x64_locally():
        wide = [a.astype(jnp.uint64) for a in (senders, receivers, images)]
        radix = jnp.uint64(nodes), jnp.uint64(image_count)
        # Unique but for padding (all equal): stability cannot matter.
        keys = lax.sort(
            (wide[0] * radix[0] + wide[1]) * radix[1] + wide[2], is_stable=False
        )
        image, pair = keys % radix[1], keys // radix[1]
        return (
            (pair // radix[0]).astype(senders.dtype),
            (pair % radix[0]).astype(receivers.dtype),
            image.astype(images.dtype),
        )


def sort_edges_reference(senders, receivers, images):
    senders, receivers, images = lax.sort((senders, receivers, images), num_keys=3)
    return senders, receivers, images


def sort_edges_in_rows(
    receivers: Int[Array, "n k"], images: Int[Array, "n k"]
) -> tuple[Int[Array, "n k"], Int[Array, "n k"]]:
    """Each row sorted by receiver, then image (ties by position). A row of at most
    `RANKED_WIDTH` edges is placed by ranks: each edge's place is the number of
    edges before it in the order, one compare per pair of edges in the row."""
    width = receivers.shape[1]
    if width > RANKED_WIDTH:
        return sort_edges_in_rows_reference(receivers, images)
    position = jnp.arange(width)
    r_i, r_j = receivers[:, :, None], receivers[:, None, :]
    s_i, s_j = images[:, :, None], images[:, None, :]
    ahead = position[None, :] < position[:, None]
    before = (r_j < r_i) | ((r_j == r_i) & ((s_j < s_i) | ((s_j == s_i) & ahead)))
    rank = jnp.sum(before, axis=2, dtype=jnp.int32)
    receivers, images = placed_in_rows(rank, (receivers, images), (0, 0), width)
    return receivers, images


def sort_edges_in_rows_reference(receivers, images):
    receivers, images = lax.sort((receivers, images), dimension=1, num_keys=2)
    return receivers, images


# Rows this narrow are sorted by ranks, wider ones by XLA's sort, which takes each
# row as a sequence (`benchmarks/row_sorts.py`).
RANKED_WIDTH = 32


def placed_in_rows(
    slots: Int[Array, "n w"], arrays: tuple[Array, ...], fills: tuple, width: int
) -> tuple[Array, ...]:
    """Each of `arrays` (shaped as `slots`) with each row's entries moved to their
    `slots` in a row of `width` (no two entries of a row share a slot; those at
    `width` or beyond are dropped), `fills` in the slots no entry moves to.

    By a compare of each entry's slot with each slot and a reduction, with no
    scatter and no sort: for narrow rows, such as a graph's edges of a point."""
    hits = slots[:, :, None] == jnp.arange(width, dtype=slots.dtype)
    found = jnp.any(hits, axis=1)
    return tuple(
        jnp.where(found, picked_where(hits, a[:, :, None], axis=1), fill)
        for a, fill in zip(arrays, fills, strict=True)
    )


def _sort_wide_pairs(d2, indices):
    """`sort_pairs` for float64 distances, which do not pack with an index: three
    sorts of uint64 keys, least significant first (a radix sort in 32-bit digits):
    by index, by the low half of the distance's bits, then by the high half. Each
    key carries the position its pair reached in the previous sort, so that each sort
    keeps the previous order among its ties; single-operand integer sorts are the
    ones XLA:CPU runs fast."""
    axis = d2.ndim - 1
    with enable_x64_locally():
        bits = lax.bitcast_convert_type(d2, jnp.uint64)
        digits = (
            lax.convert_element_type(
                lax.add(lax.bitcast_convert_type(indices, jnp.uint32), jnp.uint32(1)),
                jnp.uint64,
            ),
            lax.bitwise_and(bits, jnp.uint64(2**32 - 1)),
            lax.shift_right_logical(bits, jnp.uint64(32)),
        )
        order = lax.broadcasted_iota(jnp.int32, d2.shape, axis)
        for digit in digits:
            digit = jnp.take_along_axis(digit, order, axis=-1)
            keys = lax.bitwise_or(
                lax.shift_left(digit, jnp.uint64(32)),
                lax.broadcasted_iota(jnp.uint64, d2.shape, axis),
            )
            ranked = lax.sort(keys, dimension=axis)
            position = lax.bitwise_and(ranked, jnp.uint64(2**32 - 1))
            order = jnp.take_along_axis(
                order, lax.convert_element_type(position, jnp.int32), axis=-1
            )
    return (
        jnp.take_along_axis(d2, order, axis=-1),
        jnp.take_along_axis(indices, order, axis=-1),
    )


def sort_pairs_reference(d2, indices):
    d2, indices = lax.sort((d2, indices), dimension=d2.ndim - 1, num_keys=2)
    return d2, indices


def _packed_keys(d2, indices):
    """uint64 keys in the order of `(d2, index)`: the bits of `d2 >= 0` above, and
    `index + 1` below (so an index of -1 sorts first)."""
    high = lax.bitcast_convert_type(d2, jnp.uint32)
    low = lax.add(lax.bitcast_convert_type(indices, jnp.uint32), jnp.uint32(1))
    high, low = (lax.convert_element_type(half, jnp.uint64) for half in (high, low))
    return lax.bitwise_or(lax.shift_left(high, jnp.uint64(32)), low)
