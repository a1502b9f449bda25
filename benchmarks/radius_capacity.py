"""Radius collection against its capacity, beside scipy's `query_ball_point`.

    python benchmarks/radius_capacity.py [--n 1e4] [--d 4] [--dtype float64]

One query whose ball holds every point (n = 1e4, 4-D by default), collected with
`max_neighbors` from 256 to beyond n, steady time, best of `--repeats`, beside scipy
returning the same ball (sorted, `workers=1`), in one process.
"""

import argparse

import equinox as eqx
import jax
import numpy as np
from _timing import best_of
from scipy.spatial import cKDTree

import kdeqx


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1e4)
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--capacity", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", args.dtype == "float64")
    rng = np.random.default_rng(0)
    points = rng.random((int(args.n), args.d)).astype(args.dtype)
    x = np.full((1, args.d), 0.5, args.dtype)
    r = float(np.sqrt(args.d))  # every point of the unit cube
    tree = kdeqx.KDTree(points)
    collect = eqx.filter_jit(lambda t, x, m: t.query_ball_point(x, r, m))
    reference = cKDTree(points)
    scipy_time = best_of(
        lambda: reference.query_ball_point(x, r, return_sorted=True), args.repeats
    )
    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{args.dtype}; n = "
        f"{len(points):,}, d = {args.d}, one query, r covers every point; scipy "
        f"query_ball_point {scipy_time:.4f}s"
    )
    first = None
    for capacity in [*args.capacity, len(points)]:
        jax.block_until_ready(collect(tree, x, capacity))
        seconds = best_of(lambda: collect(tree, x, capacity), args.repeats)
        first = first or seconds
        _, indices, counts = collect(tree, x, capacity)
        print(
            f"max_neighbors {capacity:>6}: {seconds:8.4f}s ({seconds / first:6.1f}x "
            f"the first, {seconds / scipy_time:7.1f}x scipy) count {int(counts[0])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
