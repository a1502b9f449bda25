"""Fixed-radius queries: counting and collecting the points within `r` of each query."""

from typing import TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp

from ._custom_types import Array, Ball, Bool, Float, Int, Queries, Threshold
from ._knn import merge_k_best
from ._mesh import split_like_queries
from ._search import found_distances, search
from ._traverse import AbstractVisitor


if TYPE_CHECKING:
    from ._tree import KDTree


class _BallCount(AbstractVisitor):
    """Counts the points with `d2 <= r2`."""

    r2: Float[Array, ""]
    count_dtype: jnp.dtype = eqx.field(static=True)

    def init(self) -> Int[Array, ""]:
        return jnp.zeros((), self.count_dtype)

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        return box_d2 <= self.r2

    def visit_leaf(self, state, d2, indices) -> Int[Array, ""]:
        return state + jnp.sum(d2 <= self.r2, dtype=self.count_dtype)


class _BallNearest(AbstractVisitor):
    """Counts the points with `d2 <= r2` and keeps the `k` nearest of them.

    Empty entries are `(r2, max index)`, so a point exactly at distance `r` (a tie
    with the empty entry at a lower index) does enter: the ball is closed.
    """

    k: int = eqx.field(static=True)
    r2: Float[Array, ""]
    index_dtype: jnp.dtype = eqx.field(static=True)

    def init(self):
        empty = jnp.iinfo(self.index_dtype).max
        return (
            jnp.full((self.k,), self.r2),
            jnp.full((self.k,), empty, self.index_dtype),
            jnp.zeros((), self.index_dtype),
        )

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        return box_d2 <= self.r2

    def visit_leaf(self, state, d2, indices):
        best_d2, best_indices, count = state
        best_d2, best_indices = merge_k_best(best_d2, best_indices, d2, indices)
        return best_d2, best_indices, count + jnp.sum(d2 <= self.r2, dtype=count.dtype)


@eqx.filter_jit
@split_like_queries
def count_ball_point(tree: "KDTree", x: Queries, r: Threshold) -> Int[Array, "*batch"]:
    """`tree.count_ball_point` on validated queries and radii."""
    counts, far = search(tree, x, r, lambda r2: _BallCount(r2, tree.leaf_indices.dtype))
    return jnp.where(far.beyond(far.distance <= r), 0, counts)


@eqx.filter_jit
@split_like_queries
def query_ball_point(tree: "KDTree", x: Queries, r: Threshold, capacity: int) -> Ball:
    """`tree.query_ball_point` on validated queries and radii."""
    index_dtype = tree.leaf_indices.dtype
    states, far = search(tree, x, r, lambda r2: _BallNearest(capacity, r2, index_dtype))
    d2, indices, counts = states
    beyond = far.beyond(far.distance <= r)
    empty = indices == jnp.iinfo(index_dtype).max
    indices = jnp.where(empty | beyond[..., None], tree.n, indices)
    distances = found_distances(tree, x, indices, d2, far)
    return distances, indices, jnp.where(beyond, 0, counts)
