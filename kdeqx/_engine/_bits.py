"""Flags packed into 32-bit words, and the set bits found again by halving."""

import jax.lax as lax
import jax.numpy as jnp

from .._custom_types import Array, Bool, Int, UInt


WORD = 32


def bitmasks(flags: Bool[Array, "*rows columns"]) -> UInt[Array, "*rows words"]:
    """Each row of flags as 32-bit words, column `c` at bit `c % 32` of word
    `c // 32`."""
    columns = flags.shape[-1]

    def word(first: int):
        bits = flags[..., first : first + WORD].astype(jnp.uint32)
        # The bits are disjoint: their sum sets them.
        shifts = jnp.arange(bits.shape[-1], dtype=jnp.uint32)
        return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)

    # Word by word, without padding the flags to whole words: a padded operand
    # kept XLA:CPU from fusing the flags into the sum (a walk with leaves of a size
    # not a multiple of 32 ran several times slower).
    return jnp.stack([word(first) for first in range(0, columns, WORD)], axis=-1)


def nth_set_bit(words: UInt[Array, "*shape"], n: Int[Array, "*shape"]):
    """The position of set bit number `n` (from 0, lowest first) of each word, by
    halving: each step skips the lower half when it holds `<= n` set bits. Where a
    word has `n` or fewer set bits the answer is some position in `[0, 32)`."""
    position = jnp.zeros(words.shape, jnp.int32)
    n = n.astype(jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = lax.population_count(words & jnp.uint32((1 << width) - 1))
        low = low.astype(jnp.int32)
        skip = n >= low
        n = jnp.where(skip, n - low, n)
        position = jnp.where(skip, position + width, position)
        words = jnp.where(skip, words >> width, words)
    return position


def set_bit_count(words: UInt[Array, "*shape"]) -> Int[Array, "*shape"]:
    return lax.population_count(words).astype(jnp.int32)


def laid_out(counts: Int[Array, " groups"], size: int):
    """`size` outputs laid out as `counts[0]` outputs of group 0, then `counts[1]`
    of group 1, ...: each output's group and its rank within it. The groups with
    outputs must come first. (Outputs past the total belong to the last group with
    outputs, at ranks past its count.)

    Each group with outputs marks its first one (one scatter per group, not per
    output), and a prefix sum counts the marks (XLA:CPU's prefix sum is several times
    faster than its running maximum).
    """
    starts = jnp.cumsum(counts) - counts
    marks = jnp.zeros(size, jnp.int32).at[jnp.where(counts > 0, starts, size)]
    group = jnp.maximum(jnp.cumsum(marks.add(1, mode="drop")) - 1, 0)
    return group, jnp.arange(size, dtype=jnp.int32) - starts[group]
