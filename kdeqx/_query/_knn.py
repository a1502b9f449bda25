"""k-nearest-neighbour queries: a visitor that keeps the k best, and its entry."""

import equinox as eqx
import jax.numpy as jnp

from .._backend._mesh import split_like_queries, split_over_cpu_devices
from .._custom_types import Array, Bool, Float, Neighbours, Queries, Threshold
from .._engine._base import AbstractSearchTree
from .._engine._merge import (
    Best,
    best_of_pairs,
    leaves_per_merge,
    merge_into_best,
    merge_sorted_into_best,
    pairs_of_best,
    precedes_last,
    smallest_pairs,
)
from .._engine._metric import Minkowski
from .._engine._search import found_distances, search
from .._engine._traverse import AbstractVisitor


class _KNearest(AbstractVisitor):
    """Keeps the k best `(d2, index)` pairs, sorted lexicographically, as a `Best`
    list (`kdeqx._merge.best_of_pairs`).

    Empty entries are `(bound2, -1)`: index -1 sorts before any real index of equal
    distance, so a point exactly at the upper bound never enters (scipy's `d < bound`).
    """

    k: int = eqx.field(static=True)
    bound2: Float[Array, ""]
    index_dtype: jnp.dtype = eqx.field(static=True)

    def init(self) -> Best:
        return best_of_pairs(
            jnp.full((self.k,), self.bound2),
            jnp.full((self.k,), -1, self.index_dtype),
        )

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        return precedes_last(box_d2, min_index, state)

    def leaves_per_visit(self, leaf_size: int) -> int:
        return leaves_per_merge(self.k, leaf_size)

    def visit_leaf(self, state, d2, indices) -> Best:
        return merge_into_best(state, d2, indices)

    def reach(self, state) -> Float[Array, ""]:
        return pairs_of_best(state, self.bound2.dtype, self.index_dtype)[0][-1]

    def first_points(self) -> int:
        return 2 * self.k

    def visit_tile(self, state, d2, indices) -> Best:
        # The tile's k best first (a few passes over it), then one small merge.
        return merge_sorted_into_best(state, *smallest_pairs(d2, indices, self.k))


# Up to this k a query walks the default leaves' halves, leaves of 16, which answer
# it faster than leaves of 32 (most of all in clustered data); from k = 32 the whole
# leaves are faster. See `benchmarks/knn_k.py` (`--k 17 24 32`, uniform and
# clustered: halves faster at 17 and 24). A `knn_graph` of k = 16 asks for 17.
HALVES_MAX_K = 24


@split_over_cpu_devices
@eqx.filter_jit
@split_like_queries
def knn(
    tree: AbstractSearchTree, x: Queries, bound: Threshold, k: int, metric: Minkowski
) -> Neighbours:
    """`tree.query` on validated queries. Queries for few neighbours walk the
    halves of the leaves as leaves, where the tree has them (see `KDTree`)."""
    if k <= HALVES_MAX_K:
        tree = tree._halves_as_leaves()
    index_dtype = tree.leaf_indices.dtype
    states, far = search(
        tree, x, bound, lambda b2: _KNearest(k, b2, index_dtype), metric
    )
    d2, indices = pairs_of_best(states, tree.leaf_points.dtype, index_dtype)
    missing = (indices < 0) | far.beyond(far.distance < bound)[..., None]
    indices = jnp.where(missing, tree.n, indices)
    return found_distances(tree, x, indices, d2, far, metric), indices
