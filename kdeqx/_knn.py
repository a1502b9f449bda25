"""k-nearest-neighbour queries: a visitor that keeps the k best, and its entry."""

from typing import TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp

from ._backend import lexicographic_less, pairs_before, pick_one_hot
from ._custom_types import Array, Bool, Float, Int, Neighbours, Queries, Threshold
from ._mesh import split_like_queries
from ._search import found_distances, search
from ._traverse import AbstractVisitor


if TYPE_CHECKING:
    from ._tree import KDTree


_KnnState = tuple[Float[Array, " k"], Int[Array, " k"]]


class _KNearest(AbstractVisitor):
    """Keeps the k best `(d2, index)` pairs, sorted lexicographically.

    Empty entries are `(bound2, -1)`: index -1 sorts before any real index of equal
    distance, so a point exactly at the upper bound never enters (scipy's `d < bound`).
    """

    k: int = eqx.field(static=True)
    bound2: Float[Array, ""]
    index_dtype: jnp.dtype = eqx.field(static=True)

    def init(self) -> _KnnState:
        return (
            jnp.full((self.k,), self.bound2),
            jnp.full((self.k,), -1, self.index_dtype),
        )

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        d2, indices = state
        return lexicographic_less(box_d2, min_index, d2[-1], indices[-1])

    def visit_leaf(self, state, d2, indices) -> _KnnState:
        best_d2, best_indices = state
        return merge_k_best(best_d2, best_indices, d2, indices)


def merge_k_best(best_d2, best_indices, d2, indices):
    """The k lexicographically smallest of `best` (sorted, length k) and a leaf.

    A merge by ranks, not a sort: each entry's position in the merged order is a count
    of comparisons, all vectorised. No real point appears twice, so only the empty
    entries of `best`, ranked by position there, and the leaf's padding slots
    `(inf, n)` tie. Every entry of `best` precedes the padding, so padding ranks `k`
    or later, and its ties do not matter.
    """
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


@eqx.filter_jit
@split_like_queries
def knn(tree: "KDTree", x: Queries, bound: Threshold, k: int) -> Neighbours:
    """`tree.query` on validated queries."""
    states, far = search(
        tree, x, bound, lambda b2: _KNearest(k, b2, tree.leaf_indices.dtype)
    )
    d2, indices = states
    missing = (indices < 0) | far.beyond(far.distance < bound)[..., None]
    indices = jnp.where(missing, tree.n, indices)
    return found_distances(tree, x, indices, d2, far), indices
