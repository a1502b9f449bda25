"""The seed user's size: 14 million 3-D points, 1e5 queries, kNN and interpolation.

    /usr/bin/time -v python benchmarks/large.py [--n 1.4e7] [--queries 1e5]
        [--local-kernels mls rbf] [--local-k 32]

Prints build, query and interpolation times beside scipy's (IDW with k = `--k`, and
the local fits `--local-kernels` with `--local-k` neighbours, with their RMSE against
the sampled field), this process's peak resident memory (run under
`/usr/bin/time -v` for the same figure from outside) and, on an accelerator, the
device's peak memory. scipy runs with `--workers` (default -1, all host cores).
"""

import argparse
import resource
import time

import equinox as eqx
import jax
import numpy as np
from _timing import record
from scipy.spatial import cKDTree

import kdeqx


def peak_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def device_peak() -> str:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return ""
    return f", device peak {stats['peak_bytes_in_use'] / 2**30:5.2f} GiB"


def timed(label, fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    print(
        f"{label:<40}{seconds:9.2f} s   peak RSS so far {peak_gib():5.2f} GiB"
        f"{device_peak()}",
        flush=True,
    )
    return out, seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1.4e7)
    parser.add_argument("--queries", type=float, default=1e5)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--local-kernels", nargs="*", default=["mls"])
    parser.add_argument("--local-k", type=int, default=32)
    parser.add_argument("--skip-scipy", action="store_true")
    parser.add_argument("--workers", type=int, default=-1)
    args = parser.parse_args()
    seed_size(
        int(args.n),
        int(args.queries),
        args.k,
        args.local_kernels,
        args.local_k,
        args.skip_scipy,
        args.workers,
    )


def seed_size(n, q, k, local_kernels, local_k, skip_scipy=False, workers=-1):
    """Build, kNN and IDW (and the local fits `local_kernels`) at `n` points and `q`
    queries, beside scipy with `workers` (also run by `accelerator.py --part2`)."""
    rng = np.random.default_rng(0)
    points = rng.random((n, 3), dtype=np.float32)
    values = np.sin(10 * points[:, 0]).astype(np.float32)
    x = rng.random((q, 3), dtype=np.float32)
    print(f"n={n:,}, Q={q:,}, k={k}, float32 (points {points.nbytes / 2**30:.2f} GiB)")

    build = eqx.filter_jit(kdeqx.KDTree)
    query = eqx.filter_jit(lambda t, x: t.query(x, k))
    idw = eqx.filter_jit(lambda t, x, v: t.interpolate(x, v, k=k))
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    on_device = jax.device_put(points)  # the build's time, not the transfer's
    tree, _ = timed("kdeqx build (first call, with compile)", lambda: build(on_device))
    tree, build_time = timed("kdeqx build (steady)", lambda: build(on_device))
    (distances, _), _ = timed("kdeqx query (first call)", lambda: query(tree, x))
    _, query_time = timed("kdeqx query (steady)", lambda: query(tree, x))
    _, _ = timed("kdeqx IDW (first call)", lambda: idw(tree, x, values))
    field, idw_time = timed("kdeqx IDW (steady)", lambda: idw(tree, x, values))
    truth = np.sin(10 * x[:, 0])
    print(f"{'IDW RMSE against the field':<40}{_rmse(field, truth):9.2e}")
    for kernel in local_kernels:
        local = eqx.filter_jit(
            lambda t, x, v, kernel=kernel: t.interpolate(x, v, k=local_k, kernel=kernel)
        )
        label = f"kdeqx {kernel} k={local_k}"
        timed(f"{label} (first call)", lambda: local(tree, x, values))
        fitted, _ = timed(f"{label} (steady)", lambda: local(tree, x, values))
        print(f"{label + ' RMSE against the field':<40}{_rmse(fitted, truth):9.2e}")
    if skip_scipy:
        return
    reference, scipy_build = timed("scipy build", lambda: cKDTree(points))
    (ref_d, ref_i), scipy_query = timed(
        f"scipy query (workers={workers})",
        lambda: reference.query(x, k, workers=workers),
    )
    start = time.perf_counter()
    w = 1 / np.maximum(ref_d, 1e-30) ** 2
    ref_field = (w * values[ref_i]).sum(1) / w.sum(1)
    scipy_idw = scipy_query + time.perf_counter() - start
    print(f"{'scipy IDW (query + numpy weights)':<40}{scipy_idw:9.2f} s")
    print(
        f"ratios kdeqx/scipy: build {build_time / scipy_build:.2f}x, "
        f"query {query_time / scipy_query:.2f}x, IDW {idw_time / scipy_idw:.2f}x"
    )
    task = f"n={n:.1e}, Q={q:.0e}, {jax.default_backend()}"
    host = f"scipy workers={workers}"
    record(f"build, seed's size, {task}", build_time, host, scipy_build)
    record(f"kNN k={k}, seed's size, {task}", query_time, host, scipy_query)
    record(f"IDW k={k}, seed's size, {task}", idw_time, host, scipy_idw)
    print(f"distances match scipy: {np.allclose(distances, ref_d, rtol=1e-5)}")
    print(f"IDW max |difference|: {np.abs(np.asarray(field) - ref_field).max():.2e}")


def _rmse(field, truth) -> float:
    return float(np.sqrt(np.mean((np.asarray(field, np.float64) - truth) ** 2)))


if __name__ == "__main__":
    main()
