"""Interpolation and radius counting: kdeqx against scipy, one run.

    python benchmarks/interpolate.py [--n 1e6] [--queries 1e5] [--repeats 3]
        [--local-queries 1e5] [--cpu-devices 1]

Part 3 ("local fits") compares, at k = 32 on the same n points, kdeqx's
`kernel="rbf"` (thin-plate spline, degree 1), `kernel="mls"` (degree 1) and IDW with
scipy's `RBFInterpolator(neighbors=32)` (single-threaded: scipy has no `workers`
there), with kdeqx on all cores and pinned to one: time and RMSE against a smooth
field. Part 4 measures accuracy on real scattered data: 10 % of matplotlib's
Jacksboro fault elevation grid (344 x 403, sample data shipped with matplotlib),
evaluated at 20,000 held-out grid points, against scipy's local RBF, global
LinearNDInterpolator and NearestNDInterpolator.

Inverse-distance weighting with k = 8, power = 2: kdeqx's jitted `KDTree.interpolate`
against `cKDTree.query(workers=1)` plus numpy weights. Then `count_ball_point` against
`cKDTree.query_ball_point(return_length=True, workers=1)` at a radius that holds about
8 points on average. Prints steady times (best of `--repeats`, after a warm-up), the
first-call (trace + compile) overhead, ratios to scipy and the largest difference
between the two results. Absolute times mean little on a shared CPU; the ratios,
measured side by side in the same process, are the result. `--cpu-devices N` gives
JAX N CPU devices, over which kdeqx splits the queries.
"""

import argparse
import math
import os
import time

import equinox as eqx
import jax
import numpy as np
from _timing import best_of, core_settings, cores
from scipy.interpolate import (
    LinearNDInterpolator,
    NearestNDInterpolator,
    RBFInterpolator,
)
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
    parser.add_argument("--local-queries", type=float, default=1e5)
    parser.add_argument("--cpu-devices", type=int, default=1)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    n, q, d = int(args.n), int(args.queries), args.d

    load = ", ".join(f"{avg:.1f}" for avg in os.getloadavg())
    print(
        f"device: {jax.device_count()} x {jax.devices()[0].device_kind}, jax "
        f"{jax.__version__}, "
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

    local_fits(points.astype(np.float64), rng, int(args.local_queries), args.repeats)
    terrain_accuracy()


LOCAL_K = 32


def smooth_field(p):
    return np.sin(2 * np.pi * p[:, 0]) * np.cos(np.pi * p[:, 1]) + p[:, 2] ** 2


def kdeqx_kernels(k):
    """The kdeqx kernels compared, as jitted `(tree, x, values) -> estimate`."""
    options = {
        f"IDW k={min(k, 8)}": dict(k=min(k, 8)),
        f"IDW k={k}": dict(k=k),
        f"rbf k={k} (tps)": dict(k=k, kernel="rbf"),
        f"mls k={k} (deg 1)": dict(k=k, kernel="mls"),
        f"mls k={k} (deg 2)": dict(k=k, kernel="mls", degree=2),
    }
    return {
        name: eqx.filter_jit(
            lambda tree, x, values, o=o: tree.interpolate(x, values, **o)
        )
        for name, o in options.items()
    }


def rmse(estimate, truth):
    return float(np.sqrt(np.mean((np.asarray(estimate, np.float64) - truth) ** 2)))


def local_fits(points, rng, q, repeats):
    n = len(points)
    print(
        f"\nlocal fits: n = {n:,}, {q:,} queries, k = {LOCAL_K}, field "
        "sin(2 pi x) cos(pi y) + z^2; kdeqx float32, scipy float64 (its only dtype)"
    )
    x = rng.random((q, 3))
    values = smooth_field(points)
    truth = smooth_field(x)
    scipy_rbf = RBFInterpolator(points, values, neighbors=LOCAL_K)
    scipy_estimate = scipy_rbf(x)
    scipy_time = best_of(lambda: scipy_rbf(x), repeats)
    print(
        f"{'scipy RBF k=32 tps':<20} {scipy_time:8.3f}s (1 core)   "
        f"RMSE {rmse(scipy_estimate, truth):.2e}"
    )
    tree = kdeqx.KDTree(points.astype(np.float32))
    x32, values32 = x.astype(np.float32), values.astype(np.float32)
    for name, fn in kdeqx_kernels(LOCAL_K).items():
        estimate, first = first_call(lambda: fn(tree, x32, values32))
        timings = []
        for label, which in core_settings():
            with cores(which):
                timings.append(
                    (label, best_of(lambda: fn(tree, x32, values32), repeats))
                )
        row = "   ".join(
            f"{label} {t:7.3f}s ({scipy_time / t:5.1f}x faster than scipy)"
            for label, t in timings
        )
        print(
            f"{name:<20} {row}   RMSE {rmse(estimate, truth):.2e}   first call "
            f"{first:.1f}s",
            flush=True,
        )


def terrain_accuracy(fraction=0.1, held_out=20_000):
    import matplotlib.cbook

    with matplotlib.cbook.get_sample_data("jacksboro_fault_dem.npz") as dem:
        elevation = np.asarray(dem["elevation"], np.float64)
    rows, cols = elevation.shape
    grid = np.stack(
        np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"), -1
    ).reshape(-1, 2)
    z = elevation.reshape(-1)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(z))
    train = order[: int(fraction * len(z))]
    test = order[int(fraction * len(z)) :][:held_out]
    # Jitter the samples off the grid: scattered data, no exact collinear rows.
    points = grid[train] + rng.uniform(-0.3, 0.3, (len(train), 2))
    x, truth = grid[test].astype(np.float64), z[test]
    print(
        f"\nterrain: {len(train):,} scattered samples of a {rows} x {cols} DEM "
        f"(elevation {z.min():.0f}-{z.max():.0f} m), {len(test):,} held-out points"
    )
    values = elevation.reshape(-1)[train]
    nearest = NearestNDInterpolator(points, values)(x)
    linear = LinearNDInterpolator(points, values)(x)
    results = {
        "scipy NearestND": nearest,
        # Outside the samples' convex hull (a few border points): the nearest value.
        "scipy LinearND": np.where(np.isnan(linear), nearest, linear),
        "scipy RBF k=32 tps": RBFInterpolator(points, values, neighbors=32)(x),
    }
    tree = kdeqx.KDTree(points.astype(np.float32))
    x32, values32 = x.astype(np.float32), values.astype(np.float32)
    for name, fn in kdeqx_kernels(32).items():
        results[f"kdeqx {name}"] = fn(tree, x32, values32)
    for name, estimate in results.items():
        print(f"{name:<28} RMSE {rmse(estimate, truth):6.2f} m")


if __name__ == "__main__":
    main()
