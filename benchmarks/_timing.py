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


def compile_time(make_jitted, *args):
    """Seconds to trace, lower and compile a fresh `make_jitted()` (a new `jax.jit`
    or `eqx.filter_jit` function, so that no cache answers) for `args`, not run."""
    jitted = make_jitted()
    start = time.perf_counter()
    jitted.lower(*args).compile()
    return time.perf_counter() - start
