"""Timing shared by the benchmark scripts (run them from the repository root)."""

import time


def best_of(fn, repeats=3):
    """The fastest of `repeats` calls of `fn`, each waited for (call it warm)."""
    import jax  # late: benchmarks/sharded.py sets XLA_FLAGS before JAX starts

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)
