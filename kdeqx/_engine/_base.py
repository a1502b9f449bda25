"""The abstract search tree: what the engine walks and every query kind reads. The
tree types implement it, so nothing in the engine or the query kinds names them."""

import abc

import equinox as eqx
import jax.numpy as jnp

from .._custom_types import Array, Float, Int


class AbstractSearchTree(eqx.Module):
    """A balanced k-d tree as flat arrays in heap order (node `i` has children
    `2i + 1` and `2i + 2`): `2**depth` leaves of `leaf_size` slots holding the points
    in the tree's order, each node's box axis by axis, all in search coordinates (the
    points times `scale`, wrapped into a periodic box where there is one). `engine`
    says how queries search it: `"walk"` (`_traverse.py`) or `"blocks"`
    (`_blocks.py`)."""

    points: eqx.AbstractVar[Float[Array, "n d"]]
    leaf_points: eqx.AbstractVar[Float[Array, "slots d"]]
    leaf_indices: eqx.AbstractVar[Int[Array, " slots"]]
    node_lo: eqx.AbstractVar[Float[Array, "d nodes"]]
    node_hi: eqx.AbstractVar[Float[Array, "d nodes"]]
    node_min_index: eqx.AbstractVar[Int[Array, " nodes"]]
    period: eqx.AbstractVar[Float[Array, " d"] | None]
    scale: eqx.AbstractVar[Float[Array, ""]]
    leaf_size: eqx.AbstractVar[int]
    split_queries: eqx.AbstractVar[bool]
    engine: eqx.AbstractVar[str]

    @property
    def n(self) -> int:
        return self.points.shape[-2]

    @property
    def d(self) -> int:
        return self.points.shape[-1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.points.dtype

    @property
    def num_leaves(self) -> int:
        """The number of leaves, a power of two."""
        return self.leaf_points.shape[-2] // self.leaf_size

    @property
    def halves(self) -> bool:
        """Whether the nodes go one level below the leaves: the children of leaf node
        `i` are its first and second `leaf_size // 2` slots (the default leaves)."""
        return self.node_lo.shape[-1] > 2 * self.num_leaves - 1

    def _leaf_boxes(self) -> tuple[Float[Array, "leaves d"], Float[Array, "leaves d"]]:
        """Each leaf's box, `(lo, hi)` (the nodes may go on below the leaves)."""
        first, last = self.num_leaves - 1, 2 * self.num_leaves - 1
        return self.node_lo[:, first:last].T, self.node_hi[:, first:last].T

    @abc.abstractmethod
    def _halves_as_leaves(self) -> "AbstractSearchTree":
        """This tree with each leaf's halves as leaves of their own (itself without
        halves)."""
