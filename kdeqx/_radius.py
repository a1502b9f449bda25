"""Fixed-radius queries: counting and collecting the points within `r` of each query."""

from typing import TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp

from ._custom_types import Array, ArrayLike, Bool, Float, Int
from ._mesh import split_like_queries
from ._query import FarQueries, found_distances, merge_k_best, prepare_queries
from ._traverse import AbstractVisitor, search_radius2, walk_queries
from ._validate import check_radius, check_static_int


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


def _prepare_radius(tree: "KDTree", x, r):
    x = prepare_queries(tree, x)
    return x, check_radius(r, x.shape[:-1], x.dtype)


def count_ball_point(tree: "KDTree", x: ArrayLike, r) -> Int[Array, "*batch"]:
    x, r = _prepare_radius(tree, x, r)
    return _count(tree, x, r)


@eqx.filter_jit
@split_like_queries
def _count(tree: "KDTree", x, r):
    index_dtype = tree.leaf_indices.dtype
    if tree.n == 0 or x.size == 0:
        return jnp.zeros(x.shape[:-1], index_dtype)

    counts = walk_queries(
        tree,
        x.reshape(-1, tree.d),
        lambda ri: _BallCount(search_radius2(tree, ri), index_dtype),
        r,
    )
    far = FarQueries(tree, x)
    return jnp.where(far.beyond(far.distance <= r), 0, counts.reshape(x.shape[:-1]))


def query_ball_point(
    tree: "KDTree", x: ArrayLike, r, max_neighbors: int, raise_on_overflow: bool
):
    max_neighbors = check_static_int("max_neighbors", max_neighbors, 1)
    x, r = _prepare_radius(tree, x, r)
    distances, indices, counts = _collect(tree, x, r, max_neighbors)
    if raise_on_overflow:
        distances = eqx.error_if(
            distances,
            jnp.any(counts > max_neighbors),
            f"query_ball_point: more than max_neighbors={max_neighbors} points lie "
            "within `r` of a query; raise `max_neighbors` (see `counts`).",
        )
    return distances, indices, counts


@eqx.filter_jit
@split_like_queries
def _collect(tree: "KDTree", x, r, k: int):
    batch = x.shape[:-1]
    index_dtype = tree.leaf_indices.dtype
    if tree.n == 0 or x.size == 0:
        indices = jnp.full((*batch, k), tree.n, index_dtype)
        return (
            jnp.full((*batch, k), jnp.inf, x.dtype),
            indices,
            jnp.zeros(batch, index_dtype),
        )

    d2, indices, counts = walk_queries(
        tree,
        x.reshape(-1, tree.d),
        lambda ri: _BallNearest(k, search_radius2(tree, ri), index_dtype),
        r,
    )
    far = FarQueries(tree, x)
    beyond = far.beyond(far.distance <= r)
    empty = (indices == jnp.iinfo(index_dtype).max).reshape(*batch, k)
    indices = jnp.where(empty | beyond[..., None], tree.n, indices.reshape(*batch, k))
    distances = found_distances(tree, x, indices, d2.reshape(*batch, k), far)
    return distances, indices, jnp.where(beyond, 0, counts.reshape(batch))
