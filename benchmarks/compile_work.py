"""Compile work of a kNN query, counted in CPU instructions (deterministic).

    valgrind --tool=callgrind --callgrind-out-file=OUT python benchmarks/compile_work.py
    ... python benchmarks/compile_work.py --lower-only

(`python` must be the interpreter itself, not a pyenv shim, which valgrind would not
follow.)

Wall-clock compile times on a shared 2-core host vary by +-20% from run to run, more
than most changes to the query program; instruction counts do not vary. The first
command traces, lowers and compiles `tree.query(x, 8)` (n = 1e5, Q = 1e4, float32)
from shapes alone (nothing runs); the second stops after lowering. Their difference is
the XLA compile; `callgrind_annotate --inclusive=yes OUT` splits it into LLVM
(`xla::cpu::IrCompiler`), the MLIR fusion emitters (`xla::cpu::FusionCompiler`) and
the HLO passes. Each run takes about two minutes under valgrind.

    python benchmarks/compile_work.py --time [--n 1e6 --queries 1e5] [--engine blocks]

times the three stages on the wall clock instead (a fresh `jax.jit` each time; the
first time, in a fresh process, also traces the library's inner functions, which later
times find in JAX's caches). The query is compiled as inside a caller's `jit`; with
`--as-called`, with the compiler options of a query called from outside any `jit`
(which differ with several CPU devices, one per core).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import kdeqx
from kdeqx._backend import device_per_core_options


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lower-only", action="store_true")
    parser.add_argument("--n", type=float, default=1e5)
    parser.add_argument("--queries", type=float, default=1e4)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--as-called", action="store_true")
    parser.add_argument("--engine", default="auto", choices=["auto", "walk", "blocks"])
    args = parser.parse_args()
    points = jax.ShapeDtypeStruct((int(args.n), 3), jnp.float32)
    tree = jax.eval_shape(lambda p: kdeqx.KDTree(p, engine=args.engine), points)
    x = jax.ShapeDtypeStruct((int(args.queries), 3), jnp.float32)
    if args.time:
        time_stages(tree, x, args.k, jit_options(args.as_called))
        return
    jitted = jax.jit(lambda t, x: t.query(x, args.k), **jit_options(args.as_called))
    lowered = jitted.lower(tree, x)
    if not args.lower_only:
        lowered.compile()


def jit_options(as_called: bool) -> dict:
    """`jax.jit`'s options: none (a query inside the caller's `jit`), or, `as_called`,
    the compiler options of a query called from outside any `jit`, which is compiled
    as its own program (`kdeqx._backend.device_per_core_options`)."""
    if not as_called or jax.device_count() < 2:
        return {}
    return {"compiler_options": device_per_core_options(jax.device_count())}


def time_stages(tree, x, k, options, repeats=6):
    """Prints the wall-clock seconds of tracing, lowering and compiling the query,
    and the size of its compiled program (instructions, nested computations
    included): the program of a query that does not grow with the tree has the same
    size at every `--n`."""
    stages = {"trace": [], "lower": [], "compile": [], "total": []}
    for _ in range(repeats):
        start = time.perf_counter()
        traced = jax.jit(lambda t, x: t.query(x, k), **options).trace(tree, x)
        traced_at = time.perf_counter()
        lowered = traced.lower()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        compiled_at = time.perf_counter()
        stages["trace"].append(traced_at - start)
        stages["lower"].append(lowered_at - traced_at)
        stages["compile"].append(compiled_at - lowered_at)
        stages["total"].append(compiled_at - start)
    text = compiled.as_text() or ""
    instructions = sum(" = " in line for line in text.splitlines())
    print(
        f"n = {tree.n:,}, Q = {x.shape[0]:,}, k = {k}, float32, jax {jax.__version__}, "
        f"{type(tree).__name__} engine {tree.engine!r}: {instructions} instructions"
    )
    for name, seconds in stages.items():
        print(
            f"{name:<8} first {seconds[0]:.3f} s (cold caches), then best "
            f"{min(seconds[1:]):.3f} s, median {statistics.median(seconds[1:]):.3f} s"
        )


if __name__ == "__main__":
    main()
