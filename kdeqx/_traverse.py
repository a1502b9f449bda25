"""The one traversal engine: a stackless, near-child-first walk in a `lax.while_loop`.

Every query kind is a small visitor on this engine. The walk needs no stack: in the
heap layout a node's parent is `(i - 1) // 2`, so remembering the previous node tells
whether the walk came down from the parent or up from a child, and which child is
"near" is recomputed from the children's bounding boxes. One outer iteration visits
one leaf; the inner loop moves node by node to the next leaf worth visiting. Under
`vmap` each loop runs until its slowest lane finishes, so leaf work is done once per
leaf, not once per node step.
"""

import abc

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp

from ._custom_types import Array, Bool, Float, Int, PyTree
from ._metric import squared_distance_to_box, squared_distances, wrap_into_box


# A visitor's state: any pytree of arrays of fixed shape.
_State = PyTree


class AbstractVisitor(eqx.Module):
    """What a query kind does at the nodes and leaves of the walk (one query)."""

    @abc.abstractmethod
    def init(self) -> _State:
        """The state before any point was seen."""

    @abc.abstractmethod
    def should_visit(
        self, state: _State, box_d2: Float[Array, ""], min_index: Int[Array, ""]
    ) -> Bool[Array, ""]:
        """Whether a subtree may still change the state.

        `box_d2` lower-bounds the squared distance of every point in the subtree and
        `min_index` is the lowest point index in it.
        """

    @abc.abstractmethod
    def visit_leaf(
        self, state: _State, d2: Float[Array, " leaf"], indices: Int[Array, " leaf"]
    ) -> _State:
        """Folds one leaf's points into the state; padding slots have `d2 = inf`."""


def search_radius2(tree, r: Float[Array, "*batch"]) -> Float[Array, "*batch"]:
    """A distance `r` as a squared distance in the tree's scaled search coordinates."""
    scaled = r * lax.stop_gradient(tree.scale)
    return scaled * scaled


def walk(tree, x: Float[Array, " d"], visitor: AbstractVisitor) -> _State:
    """Runs `visitor` over every leaf it does not prune, nearest subtrees first.

    The visitor sees squared distances in the tree's search coordinates, which are
    scaled by `tree.scale`: express its thresholds with `search_radius2`.
    """
    first_leaf = tree.num_leaves - 1
    leaf_size = tree.leaf_size
    leaf_points = lax.stop_gradient(tree.leaf_points)
    node_lo = lax.stop_gradient(tree.node_lo)
    node_hi = lax.stop_gradient(tree.node_hi)
    scale = lax.stop_gradient(tree.scale)
    period = None if tree.period is None else lax.stop_gradient(tree.period)
    x = wrap_into_box(lax.stop_gradient(x), period) * scale
    period = None if period is None else period * scale

    def move(carry):
        """One step from an internal node: down to a child, or back up to the parent."""
        node, previous, state = carry
        parent = (node - 1) >> 1  # the root's parent is -1: the walk is over
        left = 2 * node + 1
        right = left + 1
        d2_left = squared_distance_to_box(x, node_lo[left], node_hi[left], period)
        d2_right = squared_distance_to_box(x, node_lo[right], node_hi[right], period)
        left_is_near = d2_left <= d2_right
        near = jnp.where(left_is_near, left, right)
        far = jnp.where(left_is_near, right, left)
        near_d2 = jnp.minimum(d2_left, d2_right)
        far_d2 = jnp.maximum(d2_left, d2_right)
        visit_near = visitor.should_visit(state, near_d2, tree.node_min_index[near])
        visit_far = visitor.should_visit(state, far_d2, tree.node_min_index[far])
        after_parent = jnp.where(visit_near, near, jnp.where(visit_far, far, parent))
        after_near = jnp.where(visit_far, far, parent)
        following = jnp.where(
            previous == parent,
            after_parent,
            jnp.where(previous == near, after_near, parent),
        )
        return following, node, state

    def to_next_leaf(carry):
        def is_internal(c):
            return (c[0] >= 0) & (c[0] < first_leaf)

        return lax.while_loop(is_internal, move, carry)

    def visit_then_move_on(carry):
        node, _, state = carry
        start = (node - first_leaf) * leaf_size
        points = lax.dynamic_slice_in_dim(leaf_points, start, leaf_size)
        indices = lax.dynamic_slice_in_dim(tree.leaf_indices, start, leaf_size)
        d2 = jnp.where(indices < tree.n, squared_distances(x, points, period), jnp.inf)
        state = visitor.visit_leaf(state, d2, indices)
        return to_next_leaf(((node - 1) >> 1, node, state))

    index_dtype = tree.leaf_indices.dtype
    root = (jnp.array(0, index_dtype), jnp.array(-1, index_dtype), visitor.init())
    walked = lax.while_loop(lambda c: c[0] >= 0, visit_then_move_on, to_next_leaf(root))
    return walked[2]
