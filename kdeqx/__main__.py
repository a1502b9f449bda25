"""The demo: `python -m kdeqx` builds a tree, queries it, and compares with scipy."""

import argparse
import sys
import time

import equinox as eqx
import jax
import numpy as np

from ._backend import use_every_core
from ._tree._tree import KDTree


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m kdeqx",
        description="Build a kdeqx.KDTree over random 3-D points, query it, and time "
        "it beside scipy's cKDTree in the same run.",
    )
    parser.add_argument("--n", type=float, default=1e6, help="points (default 1e6)")
    parser.add_argument(
        "--queries", type=float, default=1e5, help="queries (default 1e5)"
    )
    parser.add_argument("--k", type=int, default=8, help="neighbours (default 8)")
    parser.add_argument("--d", type=int, default=3, help="dimension (default 3)")
    parser.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="dtype"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _timed(label, fn):
    print(f"  {label} ...", end="", flush=True)
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    print(f" {seconds:.3f} s", flush=True)
    return out, seconds


def _one_cpu_device_per_core() -> None:
    """One CPU device per core, before JAX starts its backend: a `KDTree` then splits
    large query batches over them, each walked by its own lanes (faster than one
    device's intra-op threads: `benchmarks/sharded.py`). A script sets this, not a
    library."""
    try:
        use_every_core()
    except RuntimeError:  # JAX already started (the demo called from Python)
        pass


def main(argv=None) -> int:
    args = _parse(argv)
    _one_cpu_device_per_core()
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    n, q, k, d = int(args.n), int(args.queries), args.k, args.d
    rng = np.random.default_rng(args.seed)
    points = rng.random((n, d)).astype(args.dtype)
    x = rng.random((q, d)).astype(args.dtype)
    print(f"kdeqx demo: n={n:,} points, {q:,} queries, k={k}, d={d}, {args.dtype}")
    print(
        f"  on {jax.device_count()} x {jax.devices()[0].device_kind} "
        f"({jax.default_backend()})"
    )

    build = eqx.filter_jit(KDTree)
    query = eqx.filter_jit(lambda tree, x: tree.query(x, k))
    tree, build_first = _timed(
        "kdeqx build, first call (compile + run)", lambda: build(points)
    )
    tree, build_time = _timed("kdeqx build, steady", lambda: build(points))
    (_, _), query_first = _timed(
        "kdeqx query, first call (compile + run)", lambda: query(tree, x)
    )
    (distances, indices), query_time = _timed(
        "kdeqx query, steady", lambda: query(tree, x)
    )

    try:
        from scipy.spatial import cKDTree  # pyright: ignore
    except ImportError:
        print("scipy is not installed: `pip install scipy` to compare.")
        return 0
    reference, scipy_build = _timed("scipy cKDTree build", lambda: cKDTree(points))
    (ref_d, ref_i), scipy_query = _timed(
        "scipy query (workers=-1, every core)",
        lambda: reference.query(x, k, workers=-1),
    )
    ref_d = ref_d.reshape(q, k)
    same_distances = np.allclose(
        distances, ref_d, rtol=1e-5 if args.dtype == "float32" else 1e-9
    )
    same_indices = np.mean(np.asarray(indices) == np.asarray(ref_i).reshape(q, k))

    rows = [
        ("build", build_time, scipy_build),
        ("query", query_time, scipy_query),
    ]
    print()
    print(f"{'step':<8}{'kdeqx (s)':>12}{'scipy (s)':>12}{'kdeqx/scipy':>14}")
    for name, ours, theirs in rows:
        print(f"{name:<8}{ours:>12.3f}{theirs:>12.3f}{ours / theirs:>13.1f}x")
    print(f"{'compile':<8}{query_first - query_time:>12.3f}{'-':>12}{'-':>14}")
    print(
        f"exact: distances match scipy: {same_distances}; "
        f"indices equal to scipy's: {100 * same_indices:.3f}% "
        "(float32 near-ties may swap; ties are ordered by lower index)"
    )
    return 0 if same_distances else 1


if __name__ == "__main__":
    sys.exit(main())
