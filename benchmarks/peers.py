"""kdeqx beside the pure-JAX peers (jaxkd, jaxknn) and scipy, in one run.

    python benchmarks/peers.py [--n 1e6] [--queries 1e5] [--data uniform clustered]

Each library is timed steady (best of `--repeats`, after a first call that compiles)
on the same data: uniform or clustered 3-D float32, k = 8. jaxknn builds and queries
in one call, so every library's build + query is timed too. jaxknn needs Python >= 3.12
(`pip install -e ".[bench]"`); a peer that is not installed is skipped. Answers are
compared with scipy's distances.
"""

import argparse
import importlib.metadata
import time

import equinox as eqx
import jax
import numpy as np
from _timing import best_of
from scipy.spatial import cKDTree

import kdeqx


try:
    import jaxkd
except ImportError:
    jaxkd = None
try:
    import jaxknn
except (ImportError, SyntaxError):  # jaxknn uses Python 3.12 syntax
    jaxknn = None


def uniform(rng, n):
    return rng.random((n, 3)).astype(np.float32)


def clustered(rng, n):
    centres = np.random.default_rng(1).random((20, 3))
    blobs = centres[rng.integers(0, 20, n)] + 0.02 * rng.standard_normal((n, 3))
    return blobs.astype(np.float32)


def first_and_steady(fn, repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - start
    return first, best_of(fn, repeats), out


def kdeqx_runs(k):
    build = eqx.filter_jit(kdeqx.KDTree)
    query = eqx.filter_jit(lambda tree, x: tree.query(x, k))
    both = eqx.filter_jit(lambda p, x: kdeqx.KDTree(p).query(x, k))
    return build, query, lambda p, x: both(p, x)[0]


def jaxkd_runs(k):
    build = jax.jit(jaxkd.build_tree)
    query = jax.jit(lambda tree, x: jaxkd.query_neighbors(tree, x, k=k))

    def both(p, x):
        neighbours, distances = query(build(p), x)
        return distances

    return build, query, both


def jaxknn_both(k):
    run = jax.jit(lambda p, x: jaxknn.knn(p, k, queries=x))
    return lambda p, x: run(p, x)[1]


def row(name, build, query, total, compile_, ref, exact):
    cells = [f"{name:<8}"]
    for value, reference in ((build, ref[0]), (query, ref[1]), (total, ref[2])):
        cells.append(
            "        -      "
            if value is None
            else f"{value:6.3f}s {value / reference:5.2f}x"
        )
    cells.append("   -  " if compile_ is None else f"{compile_:5.1f}s")
    cells.append(str(exact))
    return " | ".join(cells)


def run(n, q, k, data, repeats):
    rng = np.random.default_rng(0)
    points = {"uniform": uniform, "clustered": clustered}[data](rng, n)
    x = {"uniform": uniform, "clustered": clustered}[data](rng, q)
    print(f"\n{data}, n = {n:,}, Q = {q:,}, k = {k}, float32 (ratios to scipy)")
    header = ["library ", " build         ", " query         ", " build + query "]
    print(" | ".join(header + ["compile", "exact"]))

    def scipy_both():
        return cKDTree(points).query(x, k, workers=1)[0]

    sb = best_of(lambda: cKDTree(points), repeats)
    tree = cKDTree(points)
    sq = best_of(lambda: tree.query(x, k, workers=1), repeats)
    st = best_of(scipy_both, repeats)
    reference = tree.query(x, k, workers=1)[0]
    ref = (sb, sq, st)
    print(row("scipy", sb, sq, st, None, ref, True), flush=True)

    def same(distances):
        return bool(np.allclose(np.asarray(distances), reference, rtol=1e-5))

    build, query, both = kdeqx_runs(k)
    ours = jax.block_until_ready(build(points))
    b = best_of(lambda: build(points), repeats)
    first, steady, out = first_and_steady(lambda: query(ours, x), repeats)
    t = best_of(lambda: both(points, x), repeats)
    print(row("kdeqx", b, steady, t, first - steady, ref, same(out[0])), flush=True)

    if jaxkd is not None:
        build, query, both = jaxkd_runs(k)
        theirs = jax.block_until_ready(build(points))
        b = best_of(lambda: build(points), repeats)
        first, steady, out = first_and_steady(lambda: query(theirs, x), repeats)
        t = best_of(lambda: both(points, x), 1)
        print(row("jaxkd", b, steady, t, first - steady, ref, same(out[1])), flush=True)
    else:
        print("jaxkd    | not installed")

    if jaxknn is not None:
        both = jaxknn_both(k)
        first, steady, out = first_and_steady(lambda: both(points, x), repeats)
        print(
            row("jaxknn", None, None, steady, first - steady, ref, same(out)),
            flush=True,
        )
    else:
        print("jaxknn   | not installed (needs Python >= 3.12)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--queries", type=float, default=1e5)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--data", nargs="+", default=["uniform", "clustered"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    versions = [f"kdeqx {kdeqx.__version__}"]
    versions += [
        f"{m.__name__} {importlib.metadata.version(m.__name__)}"
        for m in (jaxkd, jaxknn)
        if m
    ]
    print(", ".join(versions))
    for data in args.data:
        run(int(args.n), int(args.queries), args.k, data, args.repeats)


if __name__ == "__main__":
    main()
