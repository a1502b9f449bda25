"""Bitmask helpers (`kdeqx._engine._bits`) against plain numpy."""

import jax
import jax.numpy as jnp
import numpy as np

from kdeqx._engine._bits import bitmasks, laid_out, nth_set_bit


def test_bitmasks_pack_flags_by_column():
    rng = np.random.default_rng(0)
    flags = rng.random((5, 70)) < 0.4
    words = np.asarray(bitmasks(jnp.asarray(flags)))
    assert words.shape == (5, 3) and words.dtype == np.uint32
    unpacked = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(unpacked.reshape(5, 96)[:, :70], flags)
    assert not unpacked.reshape(5, 96)[:, 70:].any()


def test_nth_set_bit_finds_every_set_bit():
    rng = np.random.default_rng(1)
    words = np.concatenate(
        [rng.integers(0, 2**32, 200, dtype=np.uint32), [0xFFFFFFFF, 1, 2**31]]
    ).astype(np.uint32)
    # Every (word, n) with n < the word's set bits, in one call.
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    word_of, position = np.nonzero(bits)
    n = np.concatenate([np.arange(c) for c in bits.sum(1)])
    found = nth_set_bit(jnp.asarray(words[word_of]), jnp.asarray(n, jnp.int32))
    np.testing.assert_array_equal(found, position)


def test_laid_out_gives_each_output_its_group_and_rank():
    rng = np.random.default_rng(2)
    groups, size = 30, 124  # one shape: one compilation
    check = jax.jit(laid_out, static_argnums=1)
    for _ in range(50):
        counts = rng.integers(1, 5, groups)
        counts[rng.integers(groups + 1) :] = 0  # the groups with outputs first
        total = int(counts.sum())
        group, rank = check(jnp.asarray(counts, jnp.int32), size)
        expected_group = np.repeat(np.arange(groups), counts)
        expected_rank = np.concatenate([np.arange(c) for c in counts])
        np.testing.assert_array_equal(np.asarray(group)[:total], expected_group)
        np.testing.assert_array_equal(np.asarray(rank)[:total], expected_rank)
