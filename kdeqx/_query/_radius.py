"""Fixed-radius queries: counting and collecting the points within `r` of each query."""

import equinox as eqx
import jax
import jax.numpy as jnp

from .._backend import (
    append_in_order,
    gather_clamped,
    redone_in_groups,
    sort_pairs,
)
from .._backend._mesh import split_like_queries, split_over_cpu_devices
from .._custom_types import Array, Ball, Bool, Float, Int, Queries, Threshold
from .._engine._base import AbstractSearchTree
from .._engine._merge import (
    leaves_per_merge,
    merge_k_best,
    merge_sorted_into_best,
    pairs_of_best,
    SMALL_K,
    smallest_pairs,
)
from .._engine._metric import Minkowski
from .._engine._search import found_distances, search
from .._engine._traverse import AbstractVisitor


class _BallCount(AbstractVisitor):
    """Counts the points with `d2 <= accept2` in the subtrees within `r2`."""

    r2: Float[Array, ""]
    accept2: Float[Array, ""]
    count_dtype: jnp.dtype = eqx.field(static=True)

    def init(self) -> Int[Array, ""]:
        return jnp.zeros((), self.count_dtype)

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        return box_d2 <= self.r2

    def reach(self, state) -> Float[Array, ""]:
        return self.r2

    def visit_leaf(self, state, d2, indices) -> Int[Array, ""]:
        return state + jnp.sum(d2 <= self.accept2, dtype=self.count_dtype)

    def whole_within(self) -> Float[Array, ""]:
        return self.accept2

    def visit_whole(self, state, count) -> Int[Array, ""]:
        return state + count.astype(self.count_dtype)


class _BallCollect(AbstractVisitor):
    """Counts the points with `d2 <= accept2` in the subtrees within `r2` and keeps
    `k` of them: the nearest, merged as the walk goes (`nearest=True`), or the first
    found, unordered, in `O(leaf)` work per leaf whatever `k`.

    The state is `(d2, indices, count, listed)`: the kept points, how many points
    lie within the ball, and how many of them were seen one by one. Keeping the
    first found, a subtree that lies within the ball is counted whole, unseen, where
    the block engine takes it so (`whole_within`, in dense regions): there the kept
    points may miss some, and `listed < count` says so.

    Empty entries are `(accept2, max index)`, so a point exactly at the accepted
    distance (a tie with the empty entry at a lower index) does enter: the ball is
    closed.
    """

    k: int = eqx.field(static=True)
    r2: Float[Array, ""]
    accept2: Float[Array, ""]
    index_dtype: jnp.dtype = eqx.field(static=True)
    nearest: bool = eqx.field(static=True)
    # Whether the count is wanted: else, keeping the nearest, the search may prune
    # beyond the last of them once full, and the count is a lower bound.
    counting: bool = eqx.field(static=True, default=True)

    def init(self):
        zero = jnp.zeros((), self.index_dtype)
        return (
            jnp.full((self.k,), self.accept2),
            jnp.full((self.k,), jnp.iinfo(self.index_dtype).max, self.index_dtype),
            zero,
            zero,
        )

    def should_visit(self, state, box_d2, min_index) -> Bool[Array, ""]:
        return box_d2 <= self.reach(state)

    def reach(self, state) -> Float[Array, ""]:
        if self.nearest and not self.counting:
            # Once full, as the k nearest: nothing beyond the last kept point.
            return jnp.minimum(self.r2, state[0][-1])
        return self.r2

    def leaves_per_visit(self, leaf_size: int) -> int:
        # The merges cost the same for several leaves; the pruning uses no state.
        return leaves_per_merge(self.k, leaf_size) if self.nearest else 1

    def visit_leaf(self, state, d2, indices):
        kept_d2, kept_indices, count, listed = state
        inside = d2 <= self.accept2
        if self.nearest:
            kept_d2, kept_indices = merge_k_best(kept_d2, kept_indices, d2, indices)
        else:
            # The found points go to the next free slots; the rest (and any beyond
            # the `k` slots) are dropped.
            kept = (kept_d2, kept_indices)
            kept_d2, kept_indices = append_in_order(kept, (d2, indices), inside, listed)
        found = jnp.sum(inside, dtype=count.dtype)
        return kept_d2, kept_indices, count + found, listed + found

    def visit_tile(self, state, d2, indices):
        if not self.nearest:
            return self.visit_leaf(state, d2, indices)
        # A tile holds hundreds of points: its best by `smallest_pairs`, not a
        # network over the whole tile.
        kept_d2, kept_indices, count, listed = state
        best = merge_sorted_into_best(
            (kept_d2, kept_indices), *smallest_pairs(d2, indices, self.k)
        )
        found = jnp.sum(d2 <= self.accept2, dtype=count.dtype)
        kept = pairs_of_best(best, d2.dtype, indices.dtype)
        return (*kept, count + found, listed + found)

    def whole_within(self) -> Float[Array, ""] | None:
        # Only the first found are taken whole: the nearest would all be searched
        # again where a subtree was, a second program for every small capacity.
        return None if self.nearest else self.accept2

    def visit_whole(self, state, count):
        kept_d2, kept_indices, found, listed = state
        return kept_d2, kept_indices, found + count.astype(found.dtype), listed


@split_over_cpu_devices
@eqx.filter_jit
@split_like_queries
def count_ball_point(
    tree: AbstractSearchTree, x: Queries, r: Threshold, metric: Minkowski
) -> Int[Array, "*batch"]:
    """`tree.count_ball_point` on validated queries and radii."""
    index_dtype = tree.leaf_indices.dtype
    counts, far = search(
        tree,
        x,
        r,
        lambda r2: _BallCount(r2, metric.accepts_within(r2), index_dtype),
        metric,
    )
    return jnp.where(far.beyond(far.distance <= r), 0, counts)


def _nearest_in_ball(
    tree: AbstractSearchTree, x: Queries, r: Threshold, capacity: int, metric: Minkowski
):
    """The `capacity` nearest points within `r` of each query (sorted), and the
    counts. Small capacities keep the nearest as the walk goes; large ones collect
    the points found in `O(found)` and sort them once, and search the queries
    that found more than `capacity` again, keeping the nearest (pruning beyond the
    last kept once full, as the k nearest do; the counts are the first search's)."""
    index_dtype = tree.leaf_indices.dtype

    def collecting(nearest: bool, counting: bool = True, x=x, r=r):
        return search(
            tree,
            x,
            r,
            lambda r2: _BallCollect(
                capacity,
                r2,
                metric.accepts_within(r2),
                index_dtype,
                nearest,
                counting,
            ),
            metric,
        )

    if capacity <= SMALL_K:
        (d2, indices, counts, _), far = collecting(nearest=True)
        return (d2, indices, counts), far
    (d2, indices, counts, listed), far = collecting(nearest=False)
    collected = sort_pairs(d2, indices)
    # More points than the capacity, or some counted whole, unseen.
    missed = (counts > capacity) | (listed < counts)

    def nearest_again(x, r):
        return collecting(nearest=True, counting=False, x=x, r=r)[0][:2]

    kept = _searched_again(missed, x, r, nearest_again, collected)
    return (*kept, counts), far


def _searched_again(redo: Bool[Array, "*batch"], x, r, search_again, states):
    """`states` (leading axes `batch`) where `redo` is set replaced by
    `search_again(x, r)` of those queries alone (`x` and `r` shaped as
    `search`'s): `1 / AGAIN_FRACTION` of the queries at a time, but at least
    `AGAIN_AT_LEAST`, as many times as they take (none where none is set).

    A ball that holds more than its capacity is searched again for the nearest;
    on clustered points those are a few queries near the dense regions, and the
    others would be searched again for nothing."""
    batch = x.shape[:-1]
    q = redo.size
    group = min(q, max(AGAIN_AT_LEAST, q // AGAIN_FRACTION))
    flat_x = x.reshape(q, -1)
    flat_r = r if jnp.ndim(r) == 0 else jnp.broadcast_to(r, batch).reshape(q)
    flat = jax.tree.map(lambda s: s.reshape(q, *s.shape[len(batch) :]), states)

    def search_rows(rows, valid, carry):
        some_r = flat_r if jnp.ndim(flat_r) == 0 else gather_clamped(flat_r, rows)
        return search_again(gather_clamped(flat_x, rows), some_r), carry

    flat, _ = redone_in_groups(redo.reshape(q), group, search_rows, flat, None)
    return jax.tree.map(lambda s: s.reshape(*batch, *s.shape[1:]), flat)


# Queries searched again are searched `1 / AGAIN_FRACTION` of them at a time (a few
# cost a fraction of a whole search), but at least `AGAIN_AT_LEAST` (enough to fill
# the walk's lanes and the block engine's blocks); `benchmarks/accelerator.py`,
# `query_ball_point` on the blobs.
AGAIN_FRACTION = 64
AGAIN_AT_LEAST = 1024


@split_over_cpu_devices
@eqx.filter_jit
@split_like_queries
def query_ball_point(
    tree: AbstractSearchTree, x: Queries, r: Threshold, capacity: int, metric: Minkowski
) -> Ball:
    """`tree.query_ball_point` on validated queries and radii."""
    index_dtype = tree.leaf_indices.dtype
    (d2, indices, counts), far = _nearest_in_ball(tree, x, r, capacity, metric)
    beyond = far.beyond(far.distance <= r)
    empty = indices == jnp.iinfo(index_dtype).max
    indices = jnp.where(empty | beyond[..., None], tree.n, indices)
    distances = found_distances(tree, x, indices, d2, far, metric)
    return distances, indices, jnp.where(beyond, 0, counts)
