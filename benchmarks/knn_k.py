"""kNN against k, side by side with the native trees, cores matched.

    python benchmarks/knn_k.py [--n 1e5] [--queries 1e4] [--k 8 32 128 512]
        [--data uniform clustered clustered-inside surface line] [--cpu-devices 2]
        [--peers pykdtree] [--leaf-size 32] [--in-jit]

For each k: kdeqx, scipy's cKDTree with workers=1 and workers=-1, and pykdtree (if
installed, `pip install -e ".[bench]"`), on the same data in one process, best of
`--repeats`, first with every core and then with the whole process pinned to core 0
(as `taskset -c 0`). Ratios are to the best native tree in the same setting;
`--peers` names the ones to time (scipy `workers=-1` checks the answers either way).
Data: uniform; 64 tight blobs with queries uniform in the cube (mostly between the
blobs) or drawn from the blobs; a curved sheet and a thin curve, queries uniform in
the cube (far from most points: the walk's worst case). `--cpu-devices N` gives JAX
N CPU devices, over which kdeqx splits the queries (the default: one, as JAX starts).
kdeqx's query is timed as called (it is jitted inside), or with `--in-jit` inside the
caller's own `jit`.
"""

import argparse
import functools as ft

import equinox as eqx
import jax
import numpy as np
from _timing import print_matched
from scipy.spatial import cKDTree

import kdeqx


def native_trees(points):
    """The native peers as `name -> query(x, k)`."""
    reference = cKDTree(points)
    peers = {
        "scipy w=1": lambda x, k: reference.query(x, k, workers=1),
        "scipy w=-1": lambda x, k: reference.query(x, k, workers=-1),
    }
    try:
        from pykdtree.kdtree import KDTree as PyKDTree
    except ImportError:
        return peers
    pykd = PyKDTree(points)
    peers["pykdtree"] = lambda x, k: pykd.query(x, k=k)
    return peers


def uniform(rng, n, d):
    return rng.random((n, d))


def clustered(rng, n, d):
    """64 tight blobs (the queries, uniform, fall mostly between them)."""
    centres = rng.random((64, d))
    return centres[rng.integers(0, 64, n)] + 0.01 * rng.standard_normal((n, d))


def surface(rng, n, d):
    """A curved sheet: the last coordinate a smooth function of the first two."""
    points = rng.random((n, d))
    points[:, -1] = 0.5 + 0.3 * np.sin(6 * points[:, 0]) * np.cos(4 * points[:, 1])
    return points


def line(rng, n, d):
    """A curve through the cube, thickened by 1e-4."""
    s = rng.random(n)
    points = np.full((n, d), 0.5)
    points[:, 0], points[:, 1] = s, 0.5 + 0.2 * np.sin(5 * s)
    return points + 1e-4 * rng.standard_normal((n, d))


# name -> (points, where the queries are: uniform in the unit cube, or drawn from the
# points' own distribution, as fresh samples).
DATA = {
    "uniform": (uniform, "cube"),
    "clustered": (clustered, "cube"),
    "clustered-inside": (clustered, "points"),
    "surface": (surface, "cube"),
    "line": (line, "cube"),
}


def points_and_queries(data, n, q, d):
    rng = np.random.default_rng(0)
    make, queries_from = DATA[data]
    if queries_from == "cube":
        return make(rng, n, d), rng.random((q, d))
    both = make(rng, n + q, d)  # one draw, so that blobs' centres are shared
    return both[:n], both[n:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1e5)
    parser.add_argument("--queries", type=float, default=1e4)
    parser.add_argument("--k", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", nargs="+", default=["uniform"], choices=list(DATA))
    parser.add_argument("--cpu-devices", type=int, default=1)
    parser.add_argument("--leaf-size", type=int, default=None)
    # By default the query is timed as called (it is jitted inside); inside a caller's
    # own `jit`, the caller's compiler options apply (`docs/scaling.md`).
    parser.add_argument("--in-jit", action="store_true")
    # scipy takes minutes for queries far from a sheet or a curve; leave it out there.
    parser.add_argument(
        "--peers", nargs="+", default=["scipy w=1", "scipy w=-1", "pykdtree"]
    )
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    for data in args.data:
        run(args, data)


def run(args, data):
    points, x = points_and_queries(data, int(args.n), int(args.queries), args.d)
    points, x = points.astype(np.float32), x.astype(np.float32)
    print(
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax "
        f"{jax.__version__}; n = {len(points):,}, Q = {len(x):,}, d = {args.d}, "
        f"float32 {data}, leaf size {args.leaf_size or 'default'}"
        + (", inside the caller's jit" if args.in_jit else "")
    )
    leaf = {} if args.leaf_size is None else dict(leaf_size=args.leaf_size)
    tree = kdeqx.KDTree(points, **leaf)
    query = lambda t, x, k: t.query(x, k)  # noqa: E731
    if args.in_jit:
        query = eqx.filter_jit(query)
    peers = native_trees(points)
    for k in args.k:
        distances, _ = jax.block_until_ready(query(tree, x, k))  # compiled here
        exact = np.allclose(distances, peers["scipy w=-1"](x, k)[0], rtol=1e-5)
        implementations = {"kdeqx": lambda: query(tree, x, k)}
        implementations.update(
            {
                name: ft.partial(q, x, k)
                for name, q in peers.items()
                if name in args.peers
            }
        )
        print_matched(
            f"k={k:<4}",
            implementations,
            args.repeats,
            f" | exact {exact}",
            task=f"kNN k={k}, n={len(points):.0e}, Q={len(x):.0e}, {data}",
        )


if __name__ == "__main__":
    main()
