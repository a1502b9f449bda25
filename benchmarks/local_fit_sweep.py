"""Local fits over every batch size: `kernel="rbf"` and `"mls"`, value and gradient,
jitted and eager, ten calls each, for query counts from 1 to 8,192.

    python benchmarks/local_fit_sweep.py [--n 20000] [--calls 10] [--eager-calls 10]

Each case runs in this process (compiled programs are released after each query
count: a process holding every one runs out of memory maps); a case that hangs stops
the script, so finishing is the result (it guards the deadlock that jaxlib's LAPACK
kernels caused, see `kdeqx/_interpolation/_dense.py`). Prints one line per query
count with the slowest steady call.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdeqx


def query_counts() -> list[int]:
    counts = {1, 2, 3, 7, 100, 1023, 1024, 1025, 1280, 1536, 1777, 2047, 2048, 2049}
    counts |= {2**j for j in range(14)} | {3 * 2**j for j in range(12)}
    return sorted(c for c in counts if c <= 8192)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--eager-calls", type=int, default=10)
    parser.add_argument("--kernels", nargs="+", default=["rbf", "mls"])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    points = jnp.asarray(rng.random((args.n, 3)), jnp.float32)
    values = jnp.sum(points**2, 1)
    print(f"jax {jax.__version__}, {jax.default_backend()}, n = {args.n}")
    for kernel in args.kernels:
        model = kdeqx.Interpolator(kdeqx.KDTree(points), values, k=16, kernel=kernel)

        def value(m, x):
            return m(x)

        def gradient(m, x):
            return jax.grad(lambda x: m(x).sum())(x)

        cases = {
            "value jit": jax.jit(value),
            "grad jit": jax.jit(gradient),
            "value eager": value,
            "grad eager": gradient,
        }
        for q in query_counts():
            x = jnp.asarray(rng.random((q, 3)), jnp.float32)
            slowest = {}
            for name, fn in cases.items():
                times = []
                calls = args.eager_calls if "eager" in name else args.calls
                for _ in range(calls):
                    start = time.perf_counter()
                    result = jax.block_until_ready(fn(model, x))
                    times.append(time.perf_counter() - start)
                assert bool(jnp.all(jnp.isfinite(result))), (kernel, name, q)
                slowest[name] = max(times[1:]) if len(times) > 1 else times[0]
            row = "  ".join(f"{name} {t:.3f}s" for name, t in slowest.items())
            print(f"{kernel:3} Q = {q:5}  {row}", flush=True)
            jax.clear_caches()
            eqx.clear_caches()
    print("every case finished")


if __name__ == "__main__":
    main()
