"""Lanes: how many queries the traversal engine walks at once."""

from typing import NamedTuple

import jax


# XLA:CPU, for the walk that leaves far children pending: 1024 lanes and at most 8
# moves between two leaf visits. Fewer or more moves, or half or twice the lanes, were
# no faster (fewer lanes help only small batches far from the points: few queries per
# lane). The walk that climbed back through each parent needed about twice the moves,
# and a cap of 16. Lanes and steps: see `benchmarks/knn_k.py` and
# `benchmarks/walk_order.py`.
CPU_LANES = 1024
CPU_STEPS = 8
# Fewer lanes for larger states, so that the lanes' states stay in cache: large k ran
# far faster on a few lanes than on 1024. k <= 16 keeps all 1024. The budget and the
# floor: see `benchmarks/knn_k.py`.
_CPU_STATE_BYTES = 2**17
_CPU_MIN_LANES = 64

# GPUs and TPUs: enough lanes to fill the device (a GPU keeps far more threads in
# flight than a CPU), as long as the lanes' states fit in this much memory, and 16
# moves between leaf visits. On a GPU, with the walk that climbed back through the
# parents, the cap made no difference; the pending walk's is `benchmarks/gpu.py`'s to
# check.
_ACCELERATOR_MAX_LANES = 2**20
_ACCELERATOR_STATE_BYTES = 2**30
ACCELERATOR_STEPS = 16


def lane_count(state_bytes: int, backend: str | None = None) -> int:
    """The number of lanes for a walk whose per-query state takes `state_bytes`.

    On the CPU a few lanes, fewer for larger states (their states together
    cache-sized); elsewhere as many as fit the memory cap, a power of two
    `>= CPU_LANES`. `backend` defaults to `jax.default_backend()`, the
    backend that programs are compiled for unless arrays are placed elsewhere.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        fit = max(_CPU_MIN_LANES, _CPU_STATE_BYTES // max(1, state_bytes))
        return min(CPU_LANES, _power_of_two_at_most(fit))
    fit = min(_ACCELERATOR_MAX_LANES, _ACCELERATOR_STATE_BYTES // max(1, state_bytes))
    return max(CPU_LANES, _power_of_two_at_most(fit))


def _power_of_two_at_most(m: int) -> int:
    """The largest power of two `<= m` (0 for `m < 1`)."""
    return 1 << (m.bit_length() - 1) if m > 0 else 0


# Local fits: how many queries' small dense systems are solved at once. On XLA:CPU
# 2,048, which bounds the temporaries; elsewhere as many as fit this much memory, and
# at least as many (larger chunks were faster on a GPU: `benchmarks/gpu.py`).
CPU_FIT_CHUNK = 2048
_ACCELERATOR_FIT_BYTES = 2**30


def fit_chunk(system_bytes: int, backend: str | None = None) -> int:
    """How many local systems of `system_bytes` each to solve at once: `CPU_FIT_CHUNK`
    on the CPU, elsewhere a power of two `>= CPU_FIT_CHUNK` whose systems fit in
    `_ACCELERATOR_FIT_BYTES`. `backend` as in `lane_count`."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        return CPU_FIT_CHUNK
    fit = _ACCELERATOR_FIT_BYTES // max(1, system_bytes)
    return max(CPU_FIT_CHUNK, _power_of_two_at_most(fit))


def step_cap(backend: str | None = None) -> int:
    """How many steps every lane of a walk moves between two leaf visits (lanes that
    reach their next leaf sooner wait there). `backend` as in `lane_count`."""
    backend = jax.default_backend() if backend is None else backend
    return CPU_STEPS if backend == "cpu" else ACCELERATOR_STEPS


class BlockShape(NamedTuple):
    """How the block engine (`kdeqx._engine._blocks`) cuts its work: queries per
    block, the leaves of its first pass, the most leaves a block's frontier keeps,
    and the leaves measured per tile."""

    block_size: int
    nearest_leaves: int
    budget: int
    chunk: int


# Queries per block, first-pass leaves, frontier budget and chunk, in leaves of 16 or
# 32 points: see `benchmarks/accelerator.py`, `--shapes`.
_BLOCK_SHAPE = BlockShape(block_size=16, nearest_leaves=32, budget=128, chunk=16)


def query_block_shape(leaf_size: int) -> BlockShape:
    """The block engine's shape for leaves of `leaf_size` points: as many points per
    tile whatever the leaves' size."""
    shape = _BLOCK_SHAPE
    per_leaf = max(1, leaf_size // 16)
    chunk = max(1, shape.chunk // per_leaf)
    nearest = max(1, shape.nearest_leaves // per_leaf)
    budget = max(chunk, shape.budget // per_leaf // chunk * chunk)
    return BlockShape(shape.block_size, nearest, budget, chunk)
