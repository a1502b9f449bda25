"""kNN side by side: kdeqx against scipy's cKDTree (workers=1) and JAX brute force.

    python benchmarks/knn.py [--n 1e5 1e6] [--queries 1e5] [--data uniform clustered]

Prints, per configuration, build and steady query times, the query's compile time
(trace, lower and compile, best of the repeats) and its first call's extra time over a
steady call, and ratios to scipy, all from the same run. Absolute times mean little
on a shared CPU; the ratios are the result.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import best_of, compile_time
from scipy.spatial import cKDTree

import kdeqx


def uniform(rng, n, d):
    return rng.random((n, d))


def clustered(rng, n, d):
    centres = rng.random((20, d))
    return centres[rng.integers(0, 20, n)] + 0.02 * rng.standard_normal((n, d))


DATA = {"uniform": uniform, "clustered": clustered}


@eqx.filter_jit
def brute_force(points, x, k):
    def chunk(xc):
        d2 = jnp.sum((xc[:, None, :] - points[None]) ** 2, axis=-1)
        return jax.lax.top_k(-d2, k)[1]

    return jax.lax.map(chunk, x.reshape(-1, 100, x.shape[-1])).reshape(-1, k)


def run(n, q, k, d, data, dtype, repeats):
    rng = np.random.default_rng(0)
    points = DATA[data](rng, n, d).astype(dtype)
    x = DATA[data](rng, q, d).astype(dtype)
    build = eqx.filter_jit(kdeqx.KDTree)
    query = eqx.filter_jit(lambda t, x: t.query(x, k))

    tree = jax.block_until_ready(build(points))
    build_time = best_of(lambda: build(points), repeats)
    start = time.perf_counter()
    jax.block_until_ready(query(tree, x))
    first = time.perf_counter() - start
    query_time = best_of(lambda: query(tree, x), repeats)
    compile_seconds = min(
        compile_time(lambda: eqx.filter_jit(lambda t, x: t.query(x, k)), tree, x)
        for _ in range(repeats)
    )
    _, indices = query(tree, x)

    scipy_build = best_of(lambda: cKDTree(points), repeats)
    reference = cKDTree(points)
    scipy_query = best_of(lambda: reference.query(x, k, workers=1), repeats)
    ref_d, _ = reference.query(x, k, workers=1)
    ours_d, _ = query(tree, x)
    exact = np.allclose(ours_d, ref_d, rtol=1e-5)

    row = (
        f"{data:<10}{n:>10,}{q:>9,}{k:>3} | build {build_time:7.3f}s "
        f"({build_time / scipy_build:5.1f}x scipy) | query {query_time:7.3f}s "
        f"({query_time / scipy_query:5.1f}x scipy {scipy_query:.3f}s) | "
        f"compile {compile_seconds:4.2f}s (first call +{first - query_time:4.2f}s) | "
        f"exact {exact}"
    )
    if n * q <= 2e9:
        brute_time = best_of(lambda: brute_force(points, x, k), 1)
        row += f" | brute {brute_time:.3f}s ({brute_time / scipy_query:.1f}x)"
    print(row, flush=True)
    return query_time, scipy_query


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, nargs="+", default=[1e4, 1e5, 1e6])
    parser.add_argument("--queries", type=float, default=1e5)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--data", nargs="+", default=["uniform", "clustered"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", help="save query time against n to this PNG")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    times = {}
    for data in args.data:
        for n in args.n:
            times[data, int(n)] = run(
                int(n),
                int(args.queries),
                args.k,
                args.d,
                data,
                args.dtype,
                args.repeats,
            )
    if args.plot:
        plot(times, args)


def plot(times, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for data in args.data:
        ns = [int(n) for n in args.n]
        ax.plot(ns, [times[data, n][0] for n in ns], "o-", label=f"kdeqx, {data}")
        ax.plot(ns, [times[data, n][1] for n in ns], "s--", label=f"scipy, {data}")
    ax.set(xscale="log", yscale="log", xlabel="points n", ylabel="query time [s]")
    ax.set_title(f"{int(args.queries):,} queries, k = {args.k}, CPU", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"saved {args.plot}")


if __name__ == "__main__":
    main()
