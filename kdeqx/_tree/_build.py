"""The build: a balanced median-split k-d tree as flat arrays, in pure JAX.

Every level is split by the same program (a prefix count and one scatter per level,
in a `lax.fori_loop`), so the build's program does not grow with `n`.
"""

import functools as ft
import math

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from .._backend import argsort_keys, float32_sort_keys, move_rows, move_rows_in_place
from .._backend._buckets import pad_rows
from .._custom_types import Array, Float, Int
from .._engine._metric import wrap_into_box
from .._floats import power_of_two
from .._validate import index_dtype_for


def _tree_depth(n: int, leaf_size: int) -> int:
    """Levels of splits so that `2**depth` leaves of `leaf_size` slots hold `n`."""
    leaves_needed = max(1, math.ceil(n / leaf_size))
    return (leaves_needed - 1).bit_length()


def _leaf_extrema(coords, valid, leaf_size):
    """Per-leaf bounding boxes of the valid points; empty leaves get `(inf, -inf)`."""
    d = coords.shape[1]
    mask = valid[:, None]
    lo = jnp.where(mask, coords, jnp.inf).reshape(-1, leaf_size, d).min(axis=1)
    hi = jnp.where(mask, coords, -jnp.inf).reshape(-1, leaf_size, d).max(axis=1)
    return lo, hi


def _sorted_orders(coords, valid, positions: int, index_dtype):
    """Per dimension, the first `positions` slots sorted by coordinate (stable for
    ties): the points, then the padding slots (not `valid`) among them.

    float64 coordinates are ordered by their float32 rounding: the order only
    balances the tree, every box is computed from the points themselves.
    """
    # Slices even when whole: the same program for every `n`.
    coords = lax.slice_in_dim(coords, 0, positions)
    valid = lax.slice_in_dim(valid, 0, positions)
    keys = float32_sort_keys(jnp.where(valid[:, None], coords, jnp.inf).T)
    # One sort per dimension, not one batched sort: XLA:CPU runs independent sorts
    # in parallel (build: `benchmarks/knn.py`).
    return jnp.stack([argsort_keys(row).astype(index_dtype) for row in keys])


def _positions_with_points(n: int, depth: int, leaf_size: int) -> int:
    """How many leading slot positions the levels must partition.

    Each node's left half is filled first, so the points always occupy positions
    `0, ..., n - 1`, and at every later position each order holds its own slot: a
    level would leave it in place. `n` is rounded up to a sixteenth of the slots (a
    whole number of pairs of leaves, the deepest nodes): arrays whose length has fewer
    factors of two ran slower (rounded to pairs of leaves alone, the build was slower;
    see `benchmarks/knn.py`).
    """
    slots = leaf_size << depth
    granule = max(2 * leaf_size, slots // 16)
    return min(slots, -(-n // granule) * granule)


def _segment_size(level, depth: int, leaf_size: int):
    """The slots of each segment (node) of `level`: `leaf_size * 2**(depth - level)`."""
    return leaf_size << (depth - level)


def _segment_of(position, level, depth: int, leaf_size: int):
    """The segment of `level` that holds each slot `position` (a division by the
    constant `leaf_size`, which the compiler turns into a multiplication, and a shift).
    """
    return (position // leaf_size) >> (depth - level)


def _iota_in_loop(m: int, level, dtype):
    """`arange(m)`, computed in each level rather than hoisted out of the loop.

    XLA moves loop-invariant values out of a while loop and passes them in as part of
    its state; XLA:CPU's kernels that read such values ran several times slower than
    those that computed them. A bound that depends on the level keeps `arange` inside;
    it never binds.
    """
    bound = jnp.asarray(m, dtype) + jnp.asarray(level, dtype)  # `m` may not fit int32
    return jnp.minimum(jnp.arange(m, dtype=dtype), bound)


def _lowest_bit(m: int) -> int:
    return m & -m


def _word_width(leaf_size: int) -> int:
    """Flags per word: a word never spans two segments (its width divides a pair of
    leaves)."""
    return min(32, _lowest_bit(2 * leaf_size))


def _widest_dimension(orders, coords, level, *, n, max_segments, depth, leaf_size):
    """Per segment of `level`, the dimension in which its points spread the most."""
    d, slots = orders.shape
    size = _segment_size(level, depth, leaf_size)
    # Segments are counted up to the deepest level's number; the extra ones repeat
    # the last real segment.
    segment = jnp.minimum(
        jnp.arange(max_segments, dtype=orders.dtype), (1 << level) - 1
    )
    first = segment * size
    last = first + jnp.clip(n - first - 1, 0, size - 1)
    dims = jnp.arange(d)[:, None]
    spread = coords[orders[:, last], dims] - coords[orders[:, first], dims]
    return jnp.argmax(spread, axis=0)


def _left_ranks(flags, words_per_pair: int, level, depth: int):
    """For every slot, the number of set flags before it in its segment of `level`.
    Flags are packed into words, so the prefix count is a population count within a
    word plus a cumulative sum over words. A pair of leaves (a segment of the deepest
    level) spans `words_per_pair` words."""
    d, words, width = flags.shape
    bit = _iota_in_loop(width, level, jnp.uint32)
    packed = jnp.sum(flags.astype(jnp.uint32) << bit, axis=2, dtype=jnp.uint32)
    below = lax.population_count(packed[:, :, None] & ((jnp.uint32(1) << bit) - 1))
    count = lax.population_count(packed).astype(jnp.int32)
    before = jnp.cumsum(count, axis=1, dtype=jnp.int32) - count
    word = _iota_in_loop(words, level, jnp.int32)
    level_shift = depth - 1 - level  # segments of `level` span 2**this pairs
    segment = (word // words_per_pair) >> level_shift
    segment_first_word = (segment << level_shift) * words_per_pair
    before = before - before[:, segment_first_word]
    return below.astype(jnp.int32) + before[:, :, None]


def _split_level(level, orders, *, coords, n, depth, leaf_size):
    """Splits every node of `level` at the median of its widest dimension.

    Nodes are aligned segments of `slots >> level` positions, and `orders[j]` lists each
    segment's slots sorted by coordinate `j`. The widest dimension's first half goes
    left, which leaves its own order in place; every other order is then partitioned
    stably, so it stays sorted within both halves. A prefix count and one scatter, no
    sort: the same program at every level.
    """
    d, slots = orders.shape
    if d == 1:
        return orders  # the one order splits in place
    size = _segment_size(level, depth, leaf_size)
    widest = _widest_dimension(
        orders,
        coords,
        level,
        n=n,
        max_segments=max(1, slots // (2 * leaf_size)),
        depth=depth,
        leaf_size=leaf_size,
    )
    # Each word of flags lies within one segment: values per word, which keeps
    # per-position reads out of the loops over the entries.
    width = _word_width(leaf_size)
    by_word = orders.reshape(d, -1, width)
    segment, _, offset = _segments_of_words(
        by_word.shape[1], width, level, depth, leaf_size, orders.dtype
    )
    widest = widest[segment][:, None]
    chosen_order = jnp.take_along_axis(
        by_word, jnp.broadcast_to(widest, by_word.shape[1:])[None], 0
    )[0]
    goes_left = (
        jnp.zeros(slots, bool)
        .at[chosen_order.ravel()]
        .set((offset < size // 2).ravel(), unique_indices=True)
    )
    if d > _MOVE_OTHERS_UP_TO_D:
        return _partitioned(orders, goes_left, level, depth, leaf_size)
    others = _without_widest(by_word, widest).reshape(d - 1, slots)
    destination = _partition_destinations(others, goes_left, level, depth, leaf_size)
    rows = _rows_of_others(widest, d)
    return move_rows_in_place(orders, others, rows, destination)


# Up to this many dimensions a level moves only the orders it must (faster than
# moving every order); beyond it the selects that set the widest order aside cost what
# they save and lengthen the compile. See `benchmarks/knn.py` (`--d`).
_MOVE_OTHERS_UP_TO_D = 4


def _partitioned(rows, goes_left, level, depth: int, leaf_size: int):
    """Each row partitioned stably within each segment of `level`: the slots flagged
    by `goes_left` first. A prefix count and one scatter, no sort."""
    destination = _partition_destinations(rows, goes_left, level, depth, leaf_size)
    return move_rows(rows, destination.reshape(rows.shape))


def _partition_destinations(rows, goes_left, level, depth, leaf_size):
    """Where each entry of `rows` goes when each row is partitioned stably within
    each segment of `level`, the slots flagged by `goes_left` first."""
    r, slots = rows.shape
    size = _segment_size(level, depth, leaf_size)
    width = _word_width(leaf_size)
    words = slots // width
    flags = goes_left[rows].reshape(r, words, width)
    left_rank = _left_ranks(flags, 2 * leaf_size // width, level, depth)
    left_rank = left_rank.astype(rows.dtype)
    _, segment_start, offset = _segments_of_words(
        words, width, level, depth, leaf_size, rows.dtype
    )
    right = size // 2 + offset
    return segment_start[:, None] + jnp.where(flags, left_rank, right - left_rank)


def _rows_of_others(widest, d: int):
    """The row of `orders` that each of the `d - 1` other orders came from."""
    other = _others_index(d, widest.ndim)
    return other + (other >= widest)


def _without_widest(orders, widest):
    """The `d - 1` orders other than the widest dimension's (`widest` broadcasts
    against one order), in order. One select between two slices: rows stacked inside
    a kernel made XLA:CPU's kernel several times slower."""
    other = _others_index(orders.shape[0], orders.ndim - 1)
    return jnp.where(other < widest, orders[:-1], orders[1:])


def _segments_of_words(
    words: int, width: int, level, depth: int, leaf_size: int, dtype
):
    """Per word of `width` slots, its segment of `level` and where that starts; per
    slot, its offset in the segment (shape `(words, width)`)."""
    word_start = _iota_in_loop(words, level, dtype) * width
    segment = _segment_of(word_start, level, depth, leaf_size)
    segment_start = segment * _segment_size(level, depth, leaf_size)
    bit = _iota_in_loop(width, level, dtype)
    return segment, segment_start, (word_start - segment_start)[:, None] + bit


def _others_index(d: int, ndim: int):
    """`0, ..., d - 2` along a leading axis, to broadcast against values of `ndim`
    axes (per word or per position): the rows of the other orders."""
    return jnp.arange(d - 1, dtype=jnp.int32).reshape(-1, *(1,) * ndim)


def _internal_boxes(lo, hi, min_index, depth):
    """Fills the internal nodes (heap order) from their children, bottom-up."""
    internal = 2**depth - 1

    def merge_children(_, carry):
        lo, hi, min_index = carry
        left, right = slice(1, 2 * internal + 1, 2), slice(2, 2 * internal + 2, 2)
        lo = lo.at[:internal].set(jnp.minimum(lo[left], lo[right]))
        hi = hi.at[:internal].set(jnp.maximum(hi[left], hi[right]))
        min_index = min_index.at[:internal].set(
            jnp.minimum(min_index[left], min_index[right])
        )
        return lo, hi, min_index

    if internal == 0:
        return lo, hi, min_index
    # After `j` sweeps every node of height <= j is exact; the root has height `depth`.
    return lax.fori_loop(0, depth, merge_children, (lo, hi, min_index))


def _search_scale(points: Float[Array, "n d"]) -> Float[Array, ""]:
    """A power of two that brings the largest coordinate into `[0.5, 1]` (`[0.5, 4)`
    within a factor of 4 of the dtype's largest number).

    The search runs on scaled coordinates so that squared distances neither overflow
    (float32 coordinates beyond ~1e19) nor underflow (below ~1e-19); scaling by a power
    of two is exact, so it changes no comparison.
    """
    largest = jnp.max(jnp.abs(points), initial=0)
    _, exponent = jnp.frexp(jnp.where(largest > 0, largest, 1))
    # A normal number: XLA:CPU flushes subnormals to zero, and for data beyond
    # 2**126 (float32) the exact scale would be one. Such data lands in [0.5, 4).
    info = jnp.finfo(points.dtype)
    exponent = jnp.clip(exponent, 1 - info.maxexp, -info.minexp)
    return power_of_two(-exponent, points.dtype)


def _order_dtype(slots: int, index_dtype):
    """The levels' dtype for slot numbers: unsigned where 32 bits hold them (signed
    divisions and shifts take XLA:CPU extra steps, and the build ran slower with
    int32)."""
    return jnp.uint32 if slots <= np.iinfo(np.uint32).max else index_dtype


def build_bucket(n: int, leaf_size: int) -> int:
    """The rows that a tree of `n` points is built (and, eagerly, queried) as: the
    positions that the levels partition, so every `n` with the same positions shares
    the compiled programs."""
    return _positions_with_points(n, _tree_depth(n, leaf_size), leaf_size)


@jax.jit
def sentinels_moved(leaf_indices, node_min_index, n, rows):
    """The tree's index arrays with the sentinel `n` (padding slots, empty nodes)
    moved to `rows`: those of the tree as its build bucket's `rows` points."""
    return (
        jnp.where(leaf_indices < n, leaf_indices, rows).astype(leaf_indices.dtype),
        jnp.where(node_min_index < n, node_min_index, rows).astype(
            node_min_index.dtype
        ),
    )


def build_search_arrays(
    points: Float[Array, "n d"], leaf_size: int, period, halves: bool = False
):
    """The search arrays: leaf slots (points, indices), node boxes (heap order) and the
    scale of the search coordinates.

    With `halves`, the boxes go one level below the leaves: each leaf's slots are
    sorted along its widest dimension, so that its first and second `leaf_size // 2`
    slots are its halves, the nodes of one more level of median splits (of which
    only the slots' order is kept, not the other dimensions' orders).

    The program depends on `n` only through the positions that the levels partition
    (`_positions_with_points`): the points are padded to those, and `n` is traced, so
    that every `n` with the same positions (a sixteenth of the slots) shares one
    compiled build.
    """
    n, _ = points.shape
    positions = build_bucket(n, leaf_size)
    padded = pad_rows(points, positions, fill="zeros")
    count = jnp.asarray(n, index_dtype_for(leaf_size << _tree_depth(n, leaf_size)))
    return _build_search_arrays(padded, count, leaf_size, period, halves)


@ft.partial(jax.jit, static_argnames=("leaf_size", "halves"))
def _build_search_arrays(
    points: Float[Array, "positions d"],
    n: Int[Array, ""],
    leaf_size: int,
    period,
    halves: bool,
):
    """`build_search_arrays` on the points padded to `positions` rows, of which the
    first `n` are points."""
    positions, _ = points.shape
    depth = _tree_depth(positions, leaf_size)
    slots = leaf_size << depth
    index_dtype = index_dtype_for(slots)

    valid = jnp.arange(slots) < n
    coords = wrap_into_box(lax.stop_gradient(points), period)
    scale = _search_scale(coords)  # the padding, zeros, changes no largest value
    coords = coords * scale
    coords = jnp.pad(coords, ((0, slots - positions), (0, 0)))
    # Only the positions that can hold points are sorted and partitioned (at n = 6e5,
    # 62.5 % of the 2^20 slots): the rest keep their own slots.
    orders = _sorted_orders(coords, valid, positions, _order_dtype(slots, index_dtype))
    if depth > 0:
        split = ft.partial(
            _split_level, coords=coords, n=n, depth=depth, leaf_size=leaf_size
        )
        orders = lax.fori_loop(0, depth, split, orders)
    # At the leaves every order holds the same set.
    # (Always concatenated, even with nothing: the same program for every `n`.)
    rest = jnp.arange(positions, slots, dtype=index_dtype)
    if halves:
        order = _halved(orders, coords, n=n, depth=depth, leaf_size=leaf_size)
        # From here on the halves are the leaves whose boxes are computed.
        depth, leaf_size = depth + 1, leaf_size // 2
    else:
        order = orders[0]
    perm = lax.concatenate([order.astype(index_dtype), rest], 0)

    leaf_points = coords[perm]
    leaf_valid = valid[perm]
    leaf_indices = jnp.where(leaf_valid, perm, n).astype(index_dtype)
    leaf_lo, leaf_hi = _leaf_extrema(leaf_points, leaf_valid, leaf_size)
    leaf_min_index = leaf_indices.reshape(-1, leaf_size).min(axis=1)
    internal = 2**depth - 1
    d = points.shape[1]
    lo = jnp.concatenate([jnp.full((internal, d), jnp.inf, points.dtype), leaf_lo])
    hi = jnp.concatenate([jnp.full((internal, d), -jnp.inf, points.dtype), leaf_hi])
    min_index = jnp.concatenate([jnp.full((internal,), n, index_dtype), leaf_min_index])
    lo, hi, min_index = _internal_boxes(lo, hi, min_index, depth)
    # Boxes axis by axis, `(d, nodes)`: the walk gathers one axis at a time.
    lo, hi = lo.T, hi.T

    return leaf_points, leaf_indices, lo, hi, min_index, scale


def _halved(orders, coords, *, n: Int[Array, ""], depth: int, leaf_size: int):
    """Each leaf's slots sorted along its widest dimension (the padding last): its
    first and second halves are the leaves that one more level of splits would
    make. The other dimensions' orders, which a level keeps for the levels below,
    are not needed."""
    d, positions = orders.shape
    widest = _widest_dimension(
        orders,
        coords,
        depth,
        n=n,
        max_segments=positions // leaf_size,
        depth=depth,
        leaf_size=leaf_size,
    )
    by_leaf = orders.reshape(d, -1, leaf_size)
    return jnp.take_along_axis(by_leaf, widest[None, :, None], 0).reshape(positions)
