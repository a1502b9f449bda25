"""The rest of scipy's cKDTree API beside scipy itself, cores matched.

    python benchmarks/scipy_api.py [--cpu-devices 2] [--repeats 3] [--tasks ...]

Every task times kdeqx and the peers on the same float32 uniform 3-D data in one
process, best of `--repeats`, with every core and then with the process pinned to core
0 (`_timing.cores`, as `taskset -c 0`). scipy runs with `workers=-1` where it has
`workers` (`query`) and as it is elsewhere (`count_neighbors` and `query_pairs` are
single-threaded in scipy); pykdtree joins where it has the option (`eps`).

- `count_neighbors`: two trees of 1e5 points, 20 radii (logspace from 1e-3 to
    `--rmax`), unweighted; the counts are compared with scipy's.
- `query_pairs`: n = 1e5, the radius that gives about 10 pairs `i < j` per point
    (20 neighbours each; until 2026-12-02 it was 10 neighbours); kdeqx's sorted
    pairs against scipy's `output_type="ndarray"` (its fastest, unsorted), the same
    sorted by numpy (kdeqx's output) and its default set; `query_pairs unsorted`:
    the same with kdeqx's `sort=False` (the walk's order, like scipy's ndarray).
- `self_matrix`: `sparse_distance_matrix` of that tree with itself (scipy's idiom for
    one set's sparse matrix), against scipy's `coo_matrix` and `ndarray` outputs.
- `query p=1`, `query p=inf`: n = 1e6, Q = 1e5, k = 8.
- `query eps=0.5`: the same, Euclidean, approximate.
"""

import argparse

import equinox as eqx
import jax
import numpy as np
from _timing import print_matched
from scipy.spatial import cKDTree

import kdeqx


K = 8


def count_neighbors_task(rng, rmax):
    n = 100_000
    a, b = (rng.random((n, 3)).astype(np.float32) for _ in range(2))
    radii = np.logspace(-3, np.log10(rmax), 20).astype(np.float32)
    trees = kdeqx.KDTree(a), kdeqx.KDTree(b)
    references = cKDTree(a), cKDTree(b)
    count = eqx.filter_jit(lambda a, b: a.count_neighbors(b, radii))
    ours, theirs = (
        np.asarray(count(*trees)),
        references[0].count_neighbors(references[1], radii),
    )
    # float32 distances near a radius may round to the other side of it.
    note = f" | max |kdeqx - scipy| = {np.abs(ours - theirs).max()} of {theirs[-1]}"
    return {
        "kdeqx": lambda: count(*trees),
        "scipy": lambda: references[0].count_neighbors(references[1], radii),
    }, note


def _ten_pairs_per_point(rng):
    """1e5 uniform points, the radius that gives about 10 pairs `i < j` per point
    (20 neighbours each), and both trees."""
    n = 100_000
    points = rng.random((n, 3)).astype(np.float32)
    r = float((20 / (n * 4 / 3 * np.pi)) ** (1 / 3))
    return kdeqx.KDTree(points), cKDTree(points), r


def query_pairs_task(rng, sort=True):
    tree, reference, r = _ten_pairs_per_point(rng)
    expected = reference.query_pairs(r, output_type="ndarray")
    capacity = int(1.2 * len(expected))
    pairs = eqx.filter_jit(lambda t: t.query_pairs(r, capacity, sort=sort))
    found, _, count = pairs(tree)
    same = kdeqx.pair_set(found, count) == reference.query_pairs(r)
    note = f" | {len(expected):,} pairs, r = {r:.4f}, same set as scipy: {same}"
    return {
        "kdeqx": lambda: pairs(tree),
        "scipy ndarray": lambda: reference.query_pairs(r, output_type="ndarray"),
        "scipy ndarray sorted": lambda: _sorted_pairs(reference, r),
        "scipy set": lambda: reference.query_pairs(r),
    }, note


def self_matrix_task(rng):
    tree, reference, r = _ten_pairs_per_point(rng)
    expected = reference.sparse_distance_matrix(reference, r, output_type="coo_matrix")
    capacity = int(1.2 * expected.nnz)
    matrix = eqx.filter_jit(lambda t: t.sparse_distance_matrix(t, r, capacity))
    ours, count = matrix(tree)
    ours = kdeqx.to_scipy_sparse(ours, count).tocsr()
    expected = expected.tocsr()
    same = int(count) == expected.nnz and ((ours != 0) != (expected != 0)).nnz == 0
    # (ours has explicit zeros on the diagonal, as scipy; `!= 0` drops both alike.)
    gap = abs(ours - expected).max()
    note = (
        f" | {expected.nnz:,} entries, r = {r:.4f}, same entries as scipy: {same}, "
        f"max |kdeqx - scipy| {gap:.1e}"
    )
    return {
        "kdeqx": lambda: matrix(tree),
        "scipy coo": lambda: reference.sparse_distance_matrix(
            reference, r, output_type="coo_matrix"
        ),
        "scipy ndarray": lambda: reference.sparse_distance_matrix(
            reference, r, output_type="ndarray"
        ),
    }, note


def _sorted_pairs(reference, r):
    """scipy's pairs in kdeqx's order (by `i`, then `j`): numpy's sort of packed
    keys, its fastest."""
    pairs = reference.query_pairs(r, output_type="ndarray").astype(np.int64)
    keys = np.sort(pairs[:, 0] << 32 | pairs[:, 1])
    return np.stack([keys >> 32, keys & 0xFFFFFFFF], axis=1)


def query_task(rng, *, p=2.0, eps=0.0):
    n, q = 1_000_000, 100_000
    points = rng.random((n, 3)).astype(np.float32)
    x = rng.random((q, 3)).astype(np.float32)
    tree, reference = kdeqx.KDTree(points), cKDTree(points)
    query = eqx.filter_jit(lambda t, x: t.query(x, K, p=p, eps=eps))
    ours = np.asarray(query(tree, x)[0], np.float64)
    theirs = reference.query(x, K, p=p, eps=eps, workers=-1)[0]
    exact, _ = reference.query(x, K, p=p, workers=-1)
    note = (
        f" | k-th within (1 + eps) of exact: "
        f"{bool(np.all(ours <= (1 + eps) * exact * (1 + 1e-6)))}"
        f", max |kdeqx - scipy| {np.abs(ours - theirs).max():.1e}"
    )
    implementations = {
        "kdeqx": lambda: query(tree, x),
        "scipy w=-1": lambda: reference.query(x, K, p=p, eps=eps, workers=-1),
    }
    if p == 2.0:
        try:
            from pykdtree.kdtree import KDTree as PyKDTree
        except ImportError:
            return implementations, note
        pykd = PyKDTree(points)
        implementations["pykdtree"] = lambda: pykd.query(x, k=K, eps=eps)
    return implementations, note


TASKS = {
    "count_neighbors": lambda rng, args: count_neighbors_task(rng, args.rmax),
    "query_pairs": lambda rng, args: query_pairs_task(rng),
    "query_pairs unsorted": lambda rng, args: query_pairs_task(rng, sort=False),
    "self_matrix": lambda rng, args: self_matrix_task(rng),
    "query p=1": lambda rng, args: query_task(rng, p=1.0),
    "query p=inf": lambda rng, args: query_task(rng, p=np.inf),
    "query eps=0.5": lambda rng, args: query_task(rng, eps=0.5),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=1)
    parser.add_argument("--rmax", type=float, default=0.05)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    print(
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax "
        f"{jax.__version__}; float32, uniform, 3-D"
    )
    for name in args.tasks:
        implementations, note = TASKS[name](np.random.default_rng(0), args)
        for fn in implementations.values():
            jax.block_until_ready(fn())  # compiled, warm
        print_matched(f"{name:<15}", implementations, args.repeats, note)


if __name__ == "__main__":
    main()
