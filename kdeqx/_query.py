"""k-nearest-neighbour queries: a visitor on the traversal engine, and its entry."""

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp

from ._custom_types import Array, ArrayLike, Bool, Float, Int
from ._mesh import split_like_queries
from ._metric import minimum_image, norm_without_overflow, wrap_into_box
from ._sort import enable_x64_locally
from ._traverse import AbstractVisitor, far_limit, search_radius2, walk_queries
from ._validate import (
    as_float_array,
    check_finite,
    check_queries_shape,
    check_static_int,
)


if TYPE_CHECKING:
    from ._tree import KDTree


def lexicographic_less(d2_a, index_a, d2_b, index_b):
    """`(d2_a, index_a) < (d2_b, index_b)`: distance first, then the lower index."""
    return (d2_a < d2_b) | ((d2_a == d2_b) & (index_a < index_b))


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
    entries `(bound2, -1)`, which are all in `best` and ranked by position there, and
    the leaf's padding slots `(inf, n)` tie. Every entry of `best` precedes the
    padding, so padding ranks `k` or later, and its ties do not matter.
    """
    if d2.dtype.itemsize == 4 and indices.dtype.itemsize == 4:
        candidate_first, candidate_before_candidate = _packed_comparisons(
            best_d2, best_indices, d2, indices
        )
    else:
        candidate_first = lexicographic_less(
            d2[None, :], indices[None, :], best_d2[:, None], best_indices[:, None]
        )
        candidate_before_candidate = lexicographic_less(
            d2[None, :], indices[None, :], d2[:, None], indices[:, None]
        )
    # Distances are picked as their bits: a float sum would go to a YNNPACK kernel on
    # XLA:CPU, which made the whole query ~1.2x slower.
    bits = jnp.dtype(f"int{8 * d2.dtype.itemsize}")
    picked_bits, picked_indices = _pick_by_rank(
        candidate_first,
        candidate_before_candidate,
        (lax.bitcast_convert_type(best_d2, bits), lax.bitcast_convert_type(d2, bits)),
        (best_indices, indices),
    )
    return lax.bitcast_convert_type(picked_bits, d2.dtype), picked_indices


def _packed_comparisons(best_d2, best_indices, d2, indices):
    """`merge_k_best`'s two comparison matrices for 32-bit distances and indices,
    each pair ordered by one comparison of uint64 keys rather than the five of the
    lexicographic order (kNN queries ran ~1.1x faster).

    Written in `lax` alone: inside the local x64 context each `jax.numpy` function
    would be traced afresh, which added ~0.1 s to a query's first call.
    """
    k, leaf = best_d2.shape[0], d2.shape[0]
    with enable_x64_locally():
        best_keys = _packed_keys(best_d2, best_indices)
        leaf_keys = _packed_keys(d2, indices)

        def spread(keys, shape, axis):
            return lax.broadcast_in_dim(keys, shape, (axis,))

        candidate_first = lax.lt(
            spread(leaf_keys, (k, leaf), 1), spread(best_keys, (k, leaf), 0)
        )
        candidate_before_candidate = lax.lt(
            spread(leaf_keys, (leaf, leaf), 1), spread(leaf_keys, (leaf, leaf), 0)
        )
    return candidate_first, candidate_before_candidate


def _packed_keys(d2, indices):
    """uint64 keys in the order of `(d2, index)`: the bits of `d2 >= 0` above, and
    `index + 1` below (so the empty entries' index -1 sorts first)."""
    high = lax.bitcast_convert_type(d2, jnp.uint32)
    low = lax.add(lax.bitcast_convert_type(indices, jnp.uint32), jnp.uint32(1))
    high, low = (lax.convert_element_type(half, jnp.uint64) for half in (high, low))
    return lax.bitwise_or(lax.shift_left(high, jnp.uint64(32)), low)


def _pick_by_rank(candidate_first, candidate_before_candidate, *values):
    """Merges by ranks: `candidate_first[i, j]` says leaf entry `j` precedes best
    entry `i`, `candidate_before_candidate[i, j]` that leaf entry `j` precedes leaf
    entry `i`. Returns, for each `(best, leaf)` pair of `values`, the first k of their
    merged order."""
    k = candidate_first.shape[0]
    rank_dtype = jnp.int32
    best_rank = jnp.arange(k, dtype=rank_dtype) + jnp.sum(
        candidate_first, axis=1, dtype=rank_dtype
    )
    candidate_rank = jnp.sum(~candidate_first, axis=0, dtype=rank_dtype) + jnp.sum(
        candidate_before_candidate, axis=1, dtype=rank_dtype
    )
    # Two one-hot picks, one per source: concatenating best and leaf first made this
    # merge ~3x slower on XLA:CPU (the concatenation is not fused into the loop).
    slot = jnp.arange(k, dtype=rank_dtype)
    from_best = best_rank[None, :] == slot[:, None]  # (k, k), one-hot rows
    from_leaf = candidate_rank[None, :] == slot[:, None]  # (k, leaf)

    def pick(best_values, leaf_values):
        dtype = best_values.dtype
        zero = jnp.zeros((), dtype)
        from_best_values = jnp.where(from_best, best_values[None, :], zero)
        from_leaf_values = jnp.where(from_leaf, leaf_values[None, :], zero)
        return jnp.sum(from_best_values, axis=1, dtype=dtype) + jnp.sum(
            from_leaf_values, axis=1, dtype=dtype
        )

    return tuple(pick(best, leaf) for best, leaf in values)


def neighbour_distances(
    tree: "KDTree", x: Float[Array, "*batch d"], indices: Int[Array, "*batch k"]
) -> Float[Array, "*batch k"]:
    """Differentiable distances to the chosen rows of `points`; `inf` at sentinels."""
    if tree.n == 0:
        return jnp.full(indices.shape, jnp.inf, x.dtype)
    found = indices < tree.n
    rows = tree.points[jnp.where(found, indices, 0)]
    diff = minimum_image(x[..., None, :] - rows, tree.period)
    return jnp.where(found, norm_without_overflow(diff), jnp.inf)


class FarQueries(eqx.Module):
    """Which queries lie beyond the search's clamp (`far_limit`), and each query's
    distance to the tree's bounding box: for a far query, the distance to every point
    of the tree, to float precision.

    The walk answers a far query from its clamped position, which is nearer the tree:
    it ranks every point equal (so by index) and may admit points that are beyond the
    bound or radius. The entry points drop those (`beyond`) and report `distance`.
    """

    far: Bool[Array, "*batch"]
    distance: Float[Array, "*batch"]

    def __init__(self, tree: "KDTree", x: Float[Array, "*batch d"]):
        x = wrap_into_box(lax.stop_gradient(x), tree.period)
        scale = lax.stop_gradient(tree.scale)
        lo, hi = (
            lax.stop_gradient(box[0]) / scale for box in (tree.node_lo, tree.node_hi)
        )
        gap = jnp.maximum(jnp.maximum(lo - x, x - hi), 0)
        largest = jnp.max(gap, axis=-1)
        self.distance = norm_without_overflow(gap, largest[..., None])
        # Every clamped query is this far (the tree lies within 1 of the origin), and
        # from this far every point is at `distance`, to float precision, anyway.
        self.far = largest * scale >= far_limit(x.dtype, x.shape[-1]) / 2

    def beyond(self, admits: Bool[Array, "*batch"]) -> Bool[Array, "*batch"]:
        """The far queries whose threshold test `admits(distance)` fails."""
        return self.far & ~admits


def found_distances(
    tree: "KDTree",
    x: Float[Array, "*batch d"],
    indices: Int[Array, "*batch k"],
    d2: Float[Array, "*batch k"],
    far: FarQueries,
) -> Float[Array, "*batch k"]:
    """The distances to the found neighbours, `inf` at sentinels, from the squared
    distances `d2` the walk measured (in search coordinates; for far queries, their
    distance to the tree), with the derivatives of `neighbour_distances`.

    The values are the walk's (the ones it ranked by; a recomputation from the rows
    may differ in the last bit, as the sums round in another order), so a query's
    program needs no second pass over the neighbours' rows, which was an eighth of
    its compile work; only derivatives gather them.
    """
    measured = jnp.sqrt(d2) / lax.stop_gradient(tree.scale)
    measured = jnp.where(far.far[..., None], far.distance[..., None], measured)
    return _differentiable(
        jnp.where(indices < tree.n, measured, jnp.inf), tree, x, indices
    )


@jax.custom_jvp
def _differentiable(measured, tree, x, indices):
    """`measured`, differentiated as `neighbour_distances(tree, x, indices)`."""
    return measured


@_differentiable.defjvp
def _differentiable_jvp(primals, tangents):
    measured, tree, x, indices = primals
    _, tree_dot, x_dot, _ = tangents
    value, value_dot = jax.jvp(
        lambda t, y: neighbour_distances(t, y, indices), (tree, x), (tree_dot, x_dot)
    )
    # The value of `measured` (equal up to rounding), the derivatives of `value`, to
    # every order.
    return measured + (value - lax.stop_gradient(value)), value_dot


def prepare_queries(tree: "KDTree", x: ArrayLike) -> Float[Array, "*batch d"]:
    x = as_float_array("x", x, dtype=tree.points.dtype)
    check_queries_shape("x", x, tree.d)
    return check_finite("x", x)


def knn(
    tree: "KDTree", x: ArrayLike, k: int, distance_upper_bound
) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"]]:
    k = check_static_int("k", k, 1)
    x = prepare_queries(tree, x)
    bound = jnp.asarray(distance_upper_bound, x.dtype)
    if bound.ndim > 0:
        bound = jnp.broadcast_to(bound, x.shape[:-1])
    return _knn(tree, x, bound, k)


@eqx.filter_jit
@split_like_queries
def _knn(tree: "KDTree", x, bound, k: int):
    batch = x.shape[:-1]
    index_dtype = tree.leaf_indices.dtype

    flat_x = x.reshape(-1, tree.d)
    if flat_x.shape[0] == 0 or tree.n == 0:
        indices = jnp.full((*batch, k), tree.n, index_dtype)
    else:
        d2, indices = walk_queries(
            tree,
            flat_x,
            lambda b: _KNearest(k, search_radius2(tree, b), index_dtype),
            bound,
        )
        far = FarQueries(tree, x)
        missing = (indices < 0).reshape(*batch, k)
        missing = missing | far.beyond(far.distance < bound)[..., None]
        indices = jnp.where(missing, tree.n, indices.reshape(*batch, k))
        d2 = d2.reshape(*batch, k)
        return found_distances(tree, x, indices, d2, far), indices
    return neighbour_distances(tree, x, indices), indices
