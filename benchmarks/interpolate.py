"""IDW interpolation and radius counting: kdeqx against scipy's cKDTree, one run.

    python benchmarks/interpolate.py [--n 1e6] [--queries 1e5] [--repeats 3]

Inverse-distance weighting with k = 8, power = 2: kdeqx's jitted `KDTree.interpolate`
against `cKDTree.query(workers=1)` plus numpy weights. Then `count_ball_point` against
`cKDTree.query_ball_point(return_length=True, workers=1)` at a radius that holds about
8 points on average. Prints steady times (best of `--repeats`, after a warm-up), the
first-call (trace + compile) overhead, ratios to scipy and the largest difference
between the two results. Absolute times mean little on a shared CPU; the ratios,
measured side by side in the same process, are the result.
"""

import argparse
import math
import os
import time

import equinox as eqx
import jax
import numpy as np
from _timing import best_of
from scipy.spatial import cKDTree

import kdeqx


K = 8
POWER = 2.0
MEAN_NEIGHBOURS = 8


def first_call(fn):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return result, time.perf_counter() - start


@eqx.filter_jit
def kdeqx_idw(tree, x, values):
    return tree.interpolate(x, values, k=K, power=POWER)


@eqx.filter_jit
def kdeqx_count(tree, x, r):
    return tree.count_ball_point(x, r)


def scipy_idw(tree, x, values):
    distances, indices = tree.query(x, K, workers=1)
    # Uniform random data never puts a query exactly on a point, so no 1/0 here.
    weights = distances**-POWER
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.sum(weights * values[indices], axis=-1)


def radius_for_mean_count(n, d, mean_count):
    """Radius whose ball holds `mean_count` of `n` uniform points in the unit cube."""
    unit_ball = math.pi ** (d / 2) / math.gamma(d / 2 + 1)
    return (mean_count / (n * unit_ball)) ** (1 / d)


def report(name, ours, first, theirs):
    print(
        f"{name:<18} kdeqx {ours:8.3f}s   scipy {theirs:8.3f}s   "
        f"kdeqx/scipy {ours / theirs:5.2f}x   first call {first:7.2f}s "
        f"(compile ~{first - ours:.2f}s)",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--queries", type=float, default=1e5)
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n, q, d = int(args.n), int(args.queries), args.d

    load = ", ".join(f"{avg:.1f}" for avg in os.getloadavg())
    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{os.cpu_count()} CPU cores, load average {load} at start (a shared "
        "machine: compare ratios, not absolute times; XLA may use every core, scipy "
        "uses one)"
    )
    print(
        f"n = {n:,} points, {q:,} queries, d = {d}, float32 uniform in the unit cube; "
        f"IDW k = {K}, power = {POWER}; best of {args.repeats}; scipy workers=1"
    )

    rng = np.random.default_rng(0)
    points = rng.random((n, d), dtype=np.float32)
    x = rng.random((q, d), dtype=np.float32)
    values = np.sin(2 * np.pi * points).sum(axis=-1).astype(np.float32)

    tree, first = first_call(lambda: kdeqx.KDTree(points))
    build = best_of(lambda: kdeqx.KDTree(points), 1)
    scipy_build = best_of(lambda: cKDTree(points), 1)
    reference = cKDTree(points)
    report("build (one call)", build, first, scipy_build)

    ours, first = first_call(lambda: kdeqx_idw(tree, x, values))
    ours_time = best_of(lambda: kdeqx_idw(tree, x, values), args.repeats)
    theirs = scipy_idw(reference, x, values)
    theirs_time = best_of(lambda: scipy_idw(reference, x, values), args.repeats)
    report(f"IDW k={K}", ours_time, first, theirs_time)
    difference = np.max(np.abs(np.asarray(ours, np.float64) - theirs))
    print(f"{'':<18} max |kdeqx - scipy| = {difference:.2e} (values in [-3, 3])")

    r = radius_for_mean_count(n, d, MEAN_NEIGHBOURS)
    ours, first = first_call(lambda: kdeqx_count(tree, x, r))
    ours_time = best_of(lambda: kdeqx_count(tree, x, r), args.repeats)

    def scipy_count():
        return reference.query_ball_point(x, r, return_length=True, workers=1)

    theirs = scipy_count()
    theirs_time = best_of(scipy_count, args.repeats)
    report(f"count r={r:.2e}", ours_time, first, theirs_time)
    mismatches = int(np.sum(np.asarray(ours) != theirs))
    print(
        f"{'':<18} mean count {np.mean(theirs):.2f}; {mismatches} of {q:,} counts "
        "differ (any would be points on the sphere's edge: float32 vs float64)"
    )


if __name__ == "__main__":
    main()
