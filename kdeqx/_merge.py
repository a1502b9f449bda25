"""Keeping the k best `(squared distance, index)` pairs as a walk visits leaves.

Two merges of a leaf into the sorted best list, with the same answers:

- by ranks (`k <= RANK_MERGE_MAX_K` and `L <= RANK_MERGE_MAX_LEAF`): each entry's
  merged position is a count of comparisons, `O(k^2 + k L + L^2)` work for `L` leaf
  entries, all vectorised: the fastest for small `k` and small leaves;
- by bitonic networks (otherwise): the leaf is sorted by one network, folded into the
  best list by an elementwise minimum with its reverse (which leaves the `K` smallest of
  both as one bitonic sequence), and that is sorted by a bitonic merge: `O(K log K +
  L log^2 L)` work, `K` the next power of two `>= k`, and nothing of size `k x k`.

Pairs are compared as packed 64-bit keys where they fit (`kdeqx._backend.pack_pairs`).
Inside the packed keys' x64 context everything is written in `lax` alone.
"""

import jax.lax as lax
import jax.numpy as jnp

from ._backend import (
    largest_pairs,
    pack_pairs,
    pair_keys_context,
    pairs_before,
    pairs_minmax,
    pick_one_hot,
    unpack_pairs,
)
from ._custom_types import Array, Float, Int


# Measured on XLA:CPU (n = 1e5, Q = 1e4, leaf 32, 2 devices): the rank merge is faster
# up to here (k = 8: 0.017 s against 0.021 s; k = 16: 0.027 against 0.030), the
# networks beyond (k = 24: 0.029 against 0.038; k = 32: 0.035 against 0.053).
RANK_MERGE_MAX_K = 16
# ... and for leaves of at most this many entries: its leaf-by-leaf comparisons grow
# as `L^2`. k = 8, n = 1e6, Q = 1e5, 2 devices, by ranks against by networks:
# leaves of 32, 0.15 s against 0.22 s; 40, 0.36 against 0.43 s; 48, 0.47 against
# 0.41 s; 64, 0.72 against 0.35 s.
RANK_MERGE_MAX_LEAF = 40

_Keys = tuple[Array, ...]


def leaves_per_merge(k: int, leaf_size: int) -> int:
    """How many leaves of `leaf_size` a walk gathers per merge into the k best (see
    `AbstractVisitor.leaves_per_visit`): about `k / (2 leaf_size)`, at most 8.

    A network merge costs about `K log K` for `K >= k` keys however few leaves it
    takes in, so beyond k = 64 it pays to take several; the walk then prunes with
    a staler k-th distance. Measured with leaves of 32 (float32, n = 1e5, Q = 1e4,
    3-D; 2 CPU devices, then one core): k = 64, 1 leaf 0.058 s, 2 leaves 0.095 s;
    k = 128, 1, 2, 4: 0.142, 0.118, 0.145 s and 0.210, 0.203, 0.192 s; k = 256, 1,
    4, 8: 0.35, 0.26, 0.23 s and 0.54, 0.39, 0.47 s; k = 512, 1, 4, 8: 0.90, 0.43,
    0.40 s; k = 1024, one core, 1, 4, 8, 16: 5.44, 2.27, 1.67, 1.69 s.
    """
    if k <= RANK_MERGE_MAX_K:
        return 1
    return min(8, max(1, _next_power_of_two(k) // (2 * leaf_size)))


def merge_k_best(
    best_d2: Float[Array, " k"],
    best_indices: Int[Array, " k"],
    d2: Float[Array, " leaf"],
    indices: Int[Array, " leaf"],
) -> tuple[Float[Array, " k"], Int[Array, " k"]]:
    """The k lexicographically smallest of `best` (sorted, length k) and a leaf.

    No real point appears twice. Squared distances are `>= 0` (the leaf's padding is
    `(inf, n)`) and indices `>= -1`.
    """
    if best_d2.shape[0] <= RANK_MERGE_MAX_K and d2.shape[0] <= RANK_MERGE_MAX_LEAF:
        return merge_by_ranks(best_d2, best_indices, d2, indices)
    return merge_by_networks(best_d2, best_indices, d2, indices)


def merge_by_ranks(best_d2, best_indices, d2, indices):
    """Only the empty entries of `best`, ranked by position there, and the leaf's
    padding slots `(inf, n)` tie. Every entry of `best` precedes the padding, so
    padding ranks `k` or later, and its ties do not matter."""
    k = best_d2.shape[0]
    rank_dtype = jnp.int32
    leaf_before_best = pairs_before(d2, indices, best_d2, best_indices)  # (k, leaf)
    leaf_before_leaf = pairs_before(d2, indices, d2, indices)  # (leaf, leaf)
    best_rank = jnp.arange(k, dtype=rank_dtype) + jnp.sum(
        leaf_before_best, axis=1, dtype=rank_dtype
    )
    leaf_rank = jnp.sum(~leaf_before_best, axis=0, dtype=rank_dtype) + jnp.sum(
        leaf_before_leaf, axis=1, dtype=rank_dtype
    )
    # Two one-hot picks, one per source: concatenating best and leaf first made this
    # merge ~3x slower on XLA:CPU (the concatenation is not fused into the loop).
    slot = jnp.arange(k, dtype=rank_dtype)[:, None]
    from_best = best_rank[None, :] == slot  # (k, k), one-hot rows
    from_leaf = leaf_rank[None, :] == slot  # (k, leaf)
    return (
        pick_one_hot(((from_best, best_d2), (from_leaf, d2))),
        pick_one_hot(((from_best, best_indices), (from_leaf, indices))),
    )


def merge_by_networks(best_d2, best_indices, d2, indices):
    k = best_d2.shape[0]
    leaf_size = _next_power_of_two(d2.shape[0])
    size = max(_next_power_of_two(k), leaf_size)
    with pair_keys_context(d2.dtype, indices.dtype):
        best = _padded(pack_pairs(best_d2, best_indices), size)
        leaf = _bitonic_sort(_padded(pack_pairs(d2, indices), leaf_size))
        # The `size` smallest of two sorted runs, as one bitonic sequence: the
        # elementwise minimum of one run and the other reversed (padded with the
        # largest key; only the last `leaf_size` entries can change).
        kept = size - leaf_size
        low, _ = pairs_minmax(_slice(best, kept, size), _reverse(leaf))
        merged = _merge_bitonic(_concatenate(_slice(best, 0, kept), low), size)
        return unpack_pairs(_slice(merged, 0, k), best_d2.dtype, best_indices.dtype)


def _next_power_of_two(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _length(keys: _Keys) -> int:
    return keys[0].shape[0]


def _padded(keys: _Keys, size: int) -> _Keys:
    missing = size - _length(keys)
    return keys if missing == 0 else _concatenate(keys, largest_pairs(keys, missing))


def _slice(keys: _Keys, start: int, stop: int) -> _Keys:
    return tuple(lax.slice_in_dim(a, start, stop) for a in keys)


def _reverse(keys: _Keys) -> _Keys:
    return tuple(lax.rev(a, (a.ndim - 1,)) for a in keys)


def _concatenate(a: _Keys, b: _Keys) -> _Keys:
    return tuple(lax.concatenate([x, y], 0) for x, y in zip(a, b, strict=True))


def _reshape(keys: _Keys, shape: tuple[int, ...]) -> _Keys:
    return tuple(lax.reshape(a, shape) for a in keys)


def _half(keys: _Keys, which: int) -> _Keys:
    """Of keys shaped `(blocks, 2, width)`, the first (0) or second (1) halves."""
    return tuple(lax.index_in_dim(a, which, 1, keepdims=False) for a in keys)


def _interleave(first: _Keys, second: _Keys) -> _Keys:
    """Halves `(blocks, width)` back into one run, block by block."""
    return tuple(
        lax.reshape(
            lax.concatenate([lax.expand_dims(x, (1,)), lax.expand_dims(y, (1,))], 1),
            (x.size + y.size,),
        )
        for x, y in zip(first, second, strict=True)
    )


def _merge_bitonic(keys: _Keys, block: int) -> _Keys:
    """Sorts each aligned block of `block` keys that is bitonic (increasing then
    decreasing): one compare-exchange stage per halving of the stride."""
    size = _length(keys)
    stride = block // 2
    while stride >= 1:
        pairs = _reshape(keys, (size // (2 * stride), 2, stride))
        keys = _interleave(*pairs_minmax(_half(pairs, 0), _half(pairs, 1)))
        stride //= 2
    return keys


def _bitonic_sort(keys: _Keys) -> _Keys:
    """Sorts keys of a power-of-two length: sorted blocks of `b` become bitonic blocks
    of `2 b` by reversing every second one, which are then merged."""
    size = _length(keys)
    block = 2
    while block <= size:
        halves = _reshape(keys, (size // block, 2, block // 2))
        keys = _interleave(_half(halves, 0), _reverse(_half(halves, 1)))
        keys = _merge_bitonic(keys, block)
        block *= 2
    return keys
