"""k-nearest-neighbour queries: a visitor that keeps the k best, and its entry."""

from typing import TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp

from ._backend import lexicographic_less
from ._custom_types import Array, Bool, Float, Int, Neighbours, Queries, Threshold
from ._merge import leaves_per_merge, merge_k_best
from ._mesh import split_like_queries, split_over_cpu_devices
from ._metric import Minkowski
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

    def leaves_per_visit(self, leaf_size: int) -> int:
        return leaves_per_merge(self.k, leaf_size)

    def visit_leaf(self, state, d2, indices) -> _KnnState:
        best_d2, best_indices = state
        return merge_k_best(best_d2, best_indices, d2, indices)


# Up to this k a query walks the default leaves' halves, leaves of 16 (2 CPU devices,
# n = 1e6, Q = 1e5, 16 against 32 slots: k = 8 0.411 against 0.485 s on clustered
# data, k = 16 0.205 against 0.220 s uniform; but k = 32 at n = 1e5 0.034 against
# 0.030 s).
HALVES_MAX_K = 16


@split_over_cpu_devices
@eqx.filter_jit
@split_like_queries
def knn(
    tree: "KDTree", x: Queries, bound: Threshold, k: int, metric: Minkowski
) -> Neighbours:
    """`tree.query` on validated queries. Queries for few neighbours walk the
    halves of the leaves as leaves, where the tree has them (see `KDTree`)."""
    if k <= HALVES_MAX_K:
        tree = tree._halves_as_leaves()
    index_dtype = tree.leaf_indices.dtype
    states, far = search(
        tree, x, bound, lambda b2: _KNearest(k, b2, index_dtype), metric
    )
    d2, indices = states
    missing = (indices < 0) | far.beyond(far.distance < bound)[..., None]
    indices = jnp.where(missing, tree.n, indices)
    return found_distances(tree, x, indices, d2, far, metric), indices
