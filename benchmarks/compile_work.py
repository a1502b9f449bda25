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
"""

import argparse

import jax
import jax.numpy as jnp

import kdeqx


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lower-only", action="store_true")
    parser.add_argument("--n", type=float, default=1e5)
    parser.add_argument("--queries", type=float, default=1e4)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    points = jax.ShapeDtypeStruct((int(args.n), 3), jnp.float32)
    tree = jax.eval_shape(kdeqx.KDTree, points)
    x = jax.ShapeDtypeStruct((int(args.queries), 3), jnp.float32)
    lowered = jax.jit(lambda t, x: t.query(x, args.k)).lower(tree, x)
    if not args.lower_only:
        lowered.compile()


if __name__ == "__main__":
    main()
