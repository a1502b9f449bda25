"""A pytree held fixed inside a trainable model: its floating-point arrays stored as
their bit patterns, so that `eqx.is_inexact_array` (and with it `eqx.filter`,
`eqx.filter_grad` and optax's updates, weight decay included) leaves them alone."""

from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp


_T = TypeVar("_T")
_BITS = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _to_bits(leaf):
    if not eqx.is_inexact_array(leaf) or jnp.issubdtype(
        leaf.dtype, jnp.complexfloating
    ):
        return leaf, None
    return lax.bitcast_convert_type(leaf, _BITS[leaf.dtype.itemsize]), leaf.dtype


class Frozen(eqx.Module, Generic[_T]):
    """A pytree whose floating-point arrays are held as unsigned integers of the same
    width: bit for bit the same values, but not inexact arrays, so that training
    cannot move them. [`Frozen.thaw`][] gives the pytree back (a bitcast, which XLA
    compiles to nothing)."""

    bits: Any
    dtypes: tuple[Any, ...] = eqx.field(static=True)

    def __init__(self, tree: _T):
        leaves, structure = jax.tree.flatten(tree)
        pairs = [_to_bits(leaf) for leaf in leaves]
        self.bits = jax.tree.unflatten(structure, [bits for bits, _ in pairs])
        self.dtypes = tuple(dtype for _, dtype in pairs)

    def thaw(self) -> _T:
        """The pytree as it was given."""
        leaves, structure = jax.tree.flatten(self.bits)
        thawed = [
            leaf if dtype is None else lax.bitcast_convert_type(leaf, dtype)
            for leaf, dtype in zip(leaves, self.dtypes, strict=True)
        ]
        return jax.tree.unflatten(structure, thawed)
