"""Build, radius count and IDW interpolation beside the native trees, cores matched.

    python benchmarks/matched.py [--n 1e6] [--queries 1e5] [--cpu-devices 2]

kdeqx against scipy's cKDTree (`workers=1` and `workers=-1`) and pykdtree (if
installed) on the same uniform 3-D float32 data in one process, best of `--repeats`,
with every core and then with the process pinned to core 0. The build is one program
(no split); counts and IDW are split over `--cpu-devices` CPU devices, timed as
called (they are jitted inside), or with `--in-jit` inside the caller's own `jit`.
IDW for the peers is their k-nearest query plus numpy weights; pykdtree has no
radius count.
"""

import argparse

import equinox as eqx
import jax
import numpy as np
from _timing import print_matched
from interpolate import K, POWER, radius_for_mean_count, scipy_idw
from scipy.spatial import cKDTree

import kdeqx


def idw_from(distances, indices, values):
    weights = distances**-POWER
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.sum(weights * values[indices], axis=-1)


def tasks(points, x, values, r, in_jit=False):
    """`name -> {implementation -> fn}` for every task."""
    build = eqx.filter_jit(kdeqx.KDTree)
    tree = build(points)
    # Queries as called (jitted inside); `--in-jit`: inside the caller's own `jit`.
    count = lambda t, x: t.count_ball_point(x, r)  # noqa: E731
    idw = lambda t, x, v: t.interpolate(x, v, k=K, power=POWER)  # noqa: E731
    if in_jit:
        count, idw = eqx.filter_jit(count), eqx.filter_jit(idw)
    reference = cKDTree(points)
    table = {
        "build": {
            "kdeqx": lambda: build(points),
            "scipy": lambda: cKDTree(points),
        },
        "count": {
            "kdeqx": lambda: count(tree, x),
            "scipy w=1": lambda: reference.query_ball_point(
                x, r, return_length=True, workers=1
            ),
            "scipy w=-1": lambda: reference.query_ball_point(
                x, r, return_length=True, workers=-1
            ),
        },
        "IDW k=8": {
            "kdeqx": lambda: idw(tree, x, values),
            "scipy w=1": lambda: scipy_idw(reference, x, values),
            "scipy w=-1": lambda: idw_from(*reference.query(x, K, workers=-1), values),
        },
    }
    try:
        from pykdtree.kdtree import KDTree as PyKDTree
    except ImportError:
        return table
    pykd = PyKDTree(points)
    table["build"]["pykdtree"] = lambda: PyKDTree(points)
    table["IDW k=8"]["pykdtree"] = lambda: idw_from(*pykd.query(x, k=K), values)
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--queries", type=float, default=1e5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=1)
    parser.add_argument("--in-jit", action="store_true")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    rng = np.random.default_rng(0)
    n, q = int(args.n), int(args.queries)
    points = rng.random((n, 3)).astype(np.float32)
    x = rng.random((q, 3)).astype(np.float32)
    values = rng.standard_normal(n).astype(np.float32)
    r = radius_for_mean_count(n, 3, 8)
    print(
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax "
        f"{jax.__version__}; n = {n:,}, Q = {q:,}, float32 uniform, "
        f"count radius {r:.4f}" + (", inside the caller's jit" if args.in_jit else "")
    )
    for name, implementations in tasks(points, x, values, r, args.in_jit).items():
        for fn in implementations.values():
            jax.block_until_ready(fn())  # compiled, warm
        print_matched(
            f"{name:<8}",
            implementations,
            args.repeats,
            task=f"{name}, n={n:.0e}, Q={q:.0e}",
        )


if __name__ == "__main__":
    main()
