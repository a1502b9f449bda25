"""Keeping the k best `(squared distance, index)` pairs as a walk visits leaves.

Three merges of a leaf into the sorted best list, with the same answers:

- by one reduction (`k <= SMALL_K`, pairs packed into 64-bit keys): the best list
  and the leaf's entries, in small sorted groups, as sorted lists of `K` keys (`K`
  the next power of two `>= k`) combined two at a time by a merge that keeps the `K`
  smallest: `O((K + L) log K)` work for `L` leaf entries, which XLA:CPU emits as one
  loop;
- by ranks (`k <= SMALL_K` otherwise, `L <= RANK_MERGE_MAX_LEAF`): each entry's
  merged position is a count of comparisons, `O(k^2 + k L + L^2)` work;
- by bitonic networks (otherwise): the leaf is sorted by one network, folded into the
  best list by an elementwise minimum with its reverse (which leaves the `K` smallest of
  both as one bitonic sequence), and that is sorted by a bitonic merge: `O(K log K +
  L log^2 L)` work, and nothing of size `k x k`.

Pairs are compared as packed 64-bit keys where they fit (`kdeqx._backend.pack_pairs`).
Inside the packed keys' x64 context everything is written in `lax` alone.
"""

import jax.lax as lax
import jax.numpy as jnp

from .._backend import (
    enable_x64_locally,
    halves_of_keys,
    keys_of_halves,
    largest_pairs,
    lexicographic_less,
    pack_pairs,
    packs_pairs,
    pair_halves,
    pair_keys_context,
    pairs_before,
    pairs_minmax,
    pairs_of_halves,
    pick_one_hot,
    precedes_halves,
    unpack_pairs,
)
from .._custom_types import Array, Float, Int


# Up to this k the small merges (by reduction or by ranks), the networks beyond: on
# XLA:CPU the reduction beats the ranks up to here, and the networks beat the
# reduction above it (see `benchmarks/knn_k.py`).
SMALL_K = 16
# The rank merge only for leaves of at most this many entries: its leaf-by-leaf
# comparisons grow as `L^2`, and for larger leaves the networks overtake it (see
# `benchmarks/knn_k.py`, `--leaf-size`).
RANK_MERGE_MAX_LEAF = 40

_Keys = tuple[Array, ...]


def leaves_per_merge(k: int, leaf_size: int) -> int:
    """How many leaves of `leaf_size` a walk gathers per merge into the k best (see
    `AbstractVisitor.leaves_per_visit`): about `k / (2 leaf_size)`, at most 8.

    A network merge costs about `K log K` for `K >= k` keys however few leaves it
    takes in, so beyond k = 64 it pays to take several; the walk then prunes with
    a staler k-th distance, and more than 8 leaves gain nothing. See
    `benchmarks/knn_k.py`.
    """
    if k <= SMALL_K:
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
    k, leaf_size = best_d2.shape[0], d2.shape[0]
    if k <= SMALL_K and packs_pairs(d2.dtype, best_indices.dtype):
        return merge_by_reduction(best_d2, best_indices, d2, indices)
    if k <= SMALL_K and leaf_size <= RANK_MERGE_MAX_LEAF:
        # Pairs that do not pack (float64): by reduction, its merges compare and
        # select two arrays each, and the rank merge was faster.
        return merge_by_ranks(best_d2, best_indices, d2, indices)
    return merge_by_networks(best_d2, best_indices, d2, indices)


# The k best as a walk keeps them: where pairs pack into 64-bit keys, one array
# `(k, 2)` of the keys' uint32 halves (`kdeqx._backend.pair_halves`), else the pair
# `(d2, indices)`. As one array, a lane's list is selected, reset and written out
# once, not twice: a float32 kNN query compiles to fewer kernels.
Best = tuple[Array, ...]


def best_of_pairs(d2: Float[Array, " k"], indices: Int[Array, " k"]) -> Best:
    if packs_pairs(d2.dtype, indices.dtype):
        return (pair_halves(d2, indices),)
    return d2, indices


def pairs_of_best(best: Best, d2_dtype, index_dtype) -> tuple[Array, Array]:
    """The `(d2, indices)` of a best list (or of lists batched along leading axes, or
    of one entry, `best[...][-1]`)."""
    if len(best) == 2:
        return best[0], best[1]
    return pairs_of_halves(best[0], d2_dtype, index_dtype)


def precedes_last(d2: Float[Array, ""], index: Int[Array, ""], best: Best):
    """Whether `(d2, index)` comes before the last pair of a best list."""
    if len(best) == 2:
        return lexicographic_less(d2, index, best[0][-1], best[1][-1])
    return precedes_halves(d2, index, best[0][-1])


def merge_into_best(best: Best, d2: Float[Array, " leaf"], indices) -> Best:
    """`merge_k_best` for a best list as the walk keeps it (`best_of_pairs`)."""
    if len(best) == 2:
        return merge_k_best(best[0], best[1], d2, indices)
    (halves,) = best
    smallest = (
        _smallest_by_reduction if halves.shape[0] <= SMALL_K else _smallest_by_networks
    )
    with enable_x64_locally():
        (merged,) = smallest((keys_of_halves(halves),), pack_pairs(d2, indices))
        return (halves_of_keys(merged),)


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
    # merge several times slower on XLA:CPU (the concatenation is not fused into the
    # loop).
    slot = jnp.arange(k, dtype=rank_dtype)[:, None]
    from_best = best_rank[None, :] == slot  # (k, k), one-hot rows
    from_leaf = leaf_rank[None, :] == slot  # (k, leaf)
    return (
        pick_one_hot(((from_best, best_d2), (from_leaf, d2))),
        pick_one_hot(((from_best, best_indices), (from_leaf, indices))),
    )


def merge_by_reduction(best_d2, best_indices, d2, indices):
    """The k best by `_smallest_by_reduction`, on packed keys where pairs pack."""
    return _merged_pairs(_smallest_by_reduction, best_d2, best_indices, d2, indices)


def _merged_pairs(smallest, best_d2, best_indices, d2, indices):
    """A merge of keys (`smallest(best, leaf)`) applied to pairs."""
    with pair_keys_context(d2.dtype, indices.dtype):
        keys = smallest(pack_pairs(best_d2, best_indices), pack_pairs(d2, indices))
        return unpack_pairs(keys, best_d2.dtype, best_indices.dtype)


def _smallest_by_reduction(best: _Keys, leaf: _Keys) -> _Keys:
    """The `k = len(best)` smallest of `best` (sorted) and `leaf`, sorted: one reduction
    over sorted lists of `K` keys (`K` the next power of two `>= k`), each padded with
    the largest key: the best list, and the leaf's entries in groups of `_GROUP`, each
    sorted by a small network. Two lists are combined by a merge that keeps the `K`
    smallest, which is associative and commutative, so XLA may reduce in any order.

    XLA:CPU emits the reduction, with the leaf's keys and the groups' networks, as
    one loop over the lanes that writes every slot of the list (the same merge
    written slot by slot went to a loop per slot, each computing the slots before
    it again; the rank merge's reductions run element by element).
    """
    k = _length(best)
    size = _next_power_of_two(k)
    group = min(_GROUP, size)
    leaf = _padded(leaf, -(-_length(leaf) // group) * group)
    groups = _length(leaf) // group
    # Slot `j` of every group, sorted within each group.
    columns = _sorting_network(
        [tuple(lax.slice_in_dim(a, j, None, group) for a in leaf) for j in range(group)]
    )
    largest = largest_pairs(best, 1)
    beyond = largest_pairs(best, groups)

    def slot(i: int) -> _Keys:
        """Slot `i` of every list of the reduction."""
        head = _slice(best, i, i + 1) if i < k else largest
        return _concatenate(head, columns[i] if i < group else beyond)

    parts = len(best)
    operands = tuple(a for i in range(size) for a in slot(i))
    identity = tuple(lax.index_in_dim(a, 0, keepdims=False) for a in largest)

    def merge(a, b):
        a = [a[i * parts : (i + 1) * parts] for i in range(size)]
        b = [b[i * parts : (i + 1) * parts] for i in range(size)]
        return tuple(key for slot in _smallest_of_sorted(a, b) for key in slot)

    merged = lax.reduce(operands, identity * size, merge, (0,))
    return tuple(
        lax.concatenate(
            [lax.expand_dims(merged[i * parts + part], (0,)) for i in range(k)], 0
        )
        for part in range(parts)
    )


# The leaf's entries enter `merge_by_reduction` in sorted groups of this many:
# fewer, larger lists to merge, each sorted by a small network. Groups of 4 merged
# faster than of 1, 2 or 8 (see `benchmarks/knn.py`).
_GROUP = 4
# Optimal sorting networks (Knuth, TAOCP 5.3.4) as compare-exchange pairs.
_NETWORKS = {
    1: (),
    2: ((0, 1),),
    4: ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2)),
}


def _sorting_network(keys: list[_Keys]) -> list[_Keys]:
    """Sorts `len(keys)` arrays of keys elementwise (entry `i` of the outputs, in
    order, are the sorted entries `i` of the inputs)."""
    keys = list(keys)
    for i, j in _NETWORKS[len(keys)]:
        keys[i], keys[j] = pairs_minmax(keys[i], keys[j])
    return keys


def _smallest_of_sorted(a: list[_Keys], b: list[_Keys]) -> list[_Keys]:
    """The `K` smallest of two sorted lists of `K` keys, sorted: the elementwise
    minimum of `a` and reversed `b` is bitonic, which one compare-exchange stage per
    halving of the stride sorts."""
    size = len(a)
    keys = [pairs_minmax(a[i], b[size - 1 - i])[0] for i in range(size)]
    stride = size // 2
    while stride >= 1:
        for start in range(0, size, 2 * stride):
            for i in range(start, start + stride):
                keys[i], keys[i + stride] = pairs_minmax(keys[i], keys[i + stride])
        stride //= 2
    return keys


def merge_by_networks(best_d2, best_indices, d2, indices):
    """The k best by `_smallest_by_networks`, on packed keys where pairs pack."""
    return _merged_pairs(_smallest_by_networks, best_d2, best_indices, d2, indices)


def _smallest_by_networks(best: _Keys, leaf: _Keys) -> _Keys:
    """The `k = len(best)` smallest of `best` (sorted) and `leaf`, sorted."""
    k = _length(best)
    leaf_size = _next_power_of_two(_length(leaf))
    size = max(_next_power_of_two(k), leaf_size)
    best = _padded(best, size)
    leaf = _bitonic_sort(_padded(leaf, leaf_size))
    # The `size` smallest of two sorted runs, as one bitonic sequence: the elementwise
    # minimum of one run and the other reversed (padded with the largest key; only
    # the last `leaf_size` entries can change).
    kept = size - leaf_size
    low, _ = pairs_minmax(_slice(best, kept, size), _reverse(leaf))
    merged = _merge_bitonic(_concatenate(_slice(best, 0, kept), low), size)
    return _slice(merged, 0, k)


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


def merge_sorted_into_best(best: Best, d2: Float[Array, " k"], indices) -> Best:
    """The k best of a best list (`best_of_pairs`) and k more pairs, sorted (as
    `smallest_pairs` gives them), by one bitonic merge of the pairs as they are:
    the elementwise least of one list and the other reversed is bitonic, which one
    compare-exchange stage per halving of the stride sorts.

    No 64-bit keys: a TPU emulates them, and the packed merge (`merge_into_best`)
    was a large share of the time to compile a kNN query of the block engine there
    (see `benchmarks/accelerator.py --compile-kernels`).
    """
    k = d2.shape[0]
    size = _next_power_of_two(k)
    best_d2, best_indices = pairs_of_best(best, d2.dtype, indices.dtype)
    padded = ((best_d2, best_indices), (d2, indices))
    ours, theirs = (
        _padded_pairs(a, i, size, jnp.iinfo(indices.dtype).max) for a, i in padded
    )
    low, _ = pairs_minmax(ours, _reverse(theirs))
    return best_of_pairs(*_slice(_merge_bitonic(low, size), 0, k))


def _padded_pairs(d2, indices, size: int, empty) -> _Keys:
    """Pairs padded with `(inf, empty)` to `size`."""
    missing = size - d2.shape[0]
    return (
        jnp.pad(d2, (0, missing), constant_values=jnp.inf),
        jnp.pad(indices, (0, missing), constant_values=empty),
    )


# Up to this k a tile's k best are taken by rounds of minima, beyond it by a sort:
# `k` passes over the tile against a sort of it by two keys, which runs and compiles
# slower until k is large (see `benchmarks/accelerator.py --tile-k`).
ROUNDS_MAX_K = 64


def smallest_pairs(
    d2: Float[Array, " tile"], indices: Int[Array, " tile"], k: int
) -> tuple[Float[Array, " k"], Int[Array, " k"]]:
    """The k lexicographically smallest `(d2, index)` pairs of a tile, sorted; the
    rest `(inf, max index)`. The real indices are distinct.

    For small k by `k` rounds, each a minimum, the least index at that minimum, and
    that entry taken out: a few elementwise passes over the tile, which a vector
    machine runs at full width (no sort, no 64-bit keys). Beyond, by one sort.
    """
    empty = jnp.iinfo(indices.dtype).max
    if k > ROUNDS_MAX_K or k >= d2.shape[0]:
        d2, indices = lax.sort((d2, indices), num_keys=2)
        d2 = jnp.pad(d2[:k], (0, max(0, k - d2.shape[0])), constant_values=jnp.inf)
        indices = jnp.pad(indices[:k], (0, max(0, k - indices.shape[0])))
        return d2, jnp.where(d2 < jnp.inf, indices, empty)
    # In a loop, whose carry holds the distances computed once: outside one, XLA may
    # compute them again inside each consumer, fused differently (a contracted
    # multiply-add or not), and a minimum would then match no entry. One round
    # compiled, not `k`: a TPU compiles each for seconds.

    def one_round(d2, _):
        least, index = _lexicographic_min(d2, indices)
        taken = (least, jnp.where(least < jnp.inf, index, empty))
        return jnp.where(indices == index, jnp.inf, d2), taken

    return lax.scan(one_round, lax.optimization_barrier(d2), None, length=k)[1]


def _lexicographic_min(d2: Float[Array, " m"], indices: Int[Array, " m"]):
    """The least `(d2, index)` pair: the least `d2`, then the least index where
    `d2` equals it (`d2` computed once, see `smallest_pairs`).

    Two plain reductions, not one of both: a TPU took seconds to compile each
    reduction with two operands and a comparator of its own, and XLA:CPU ran it
    several times slower (see `benchmarks/accelerator.py --compile-kernels`)."""
    least = jnp.min(d2)
    at_least = jnp.where(d2 == least, indices, jnp.iinfo(indices.dtype).max)
    return least, jnp.min(at_least)
