"""kdeqx's block engine on an accelerator, beside exact brute force and jaxkd on the
same chip and scipy's `cKDTree` (`workers=-1`) on the same machine's host cores.

    python benchmarks/accelerator.py [--n 1e6] [--queries 1e5] [--k 8]
        [--brute-queries 1e4] [--shapes] [--compile-report] [--compile-parts]
        [--compile-kernels] [--profile] [--tile-k] [--local-solvers]
        [--skip-jaxkd] [--walk]
        [--part2] [--part2-tasks ...] [--local-queries 1e5] [--liquid 1e5]
        [--series-n 256 1024] [--seed-n 1.4e7] [--seed-queries 1e6]

For n uniform 3-D float32 points and then 64 tight blobs (sigma 0.01; the queries
uniform in both): the build; kNN (first call: trace, compile and run; then the best
of three), its answers checked against scipy's; `count_ball_point` at about 32
neighbours against scipy's `return_length=True`; `query_ball_point` with capacity 64
against scipy's list query; IDW with k = 8. Each program is compiled on the uniform
points; the blobs, arrays of the same shapes, reuse it (their "first" call is a
call of a compiled program). Brute force (distance tiles and
`lax.top_k`) is timed on `--brute-queries` queries and scaled to Q. `--shapes` also
times kNN for a few block shapes (`kdeqx._backend.BlockShape`); `--compile-report`
compiles the build and kNN again, apart, and counts the sorts in them;
`--compile-parts` compiles kNN with its later stages cut away;
`--compile-kernels` compiles the kernels of a kNN tile alone, each beside the way
it was written before (a reduction with two operands and a comparator against two
plain ones, rounds unrolled against a loop, 64-bit keys against 32-bit pairs);
`--profile` prints the operations where a kNN call (with `--part2`: `query_pairs`,
`knn_graph`, `radius_graph` and the series) spends its device time;
`--tile-k` times kNN at k from 16 to 128 with a tile's k best by rounds of minima
and by a sort; `--local-solvers` times the local RBF's systems solved along the
lanes and by XLA's batched LU. `--part2` times, on the uniform points after the
build and in place of part 1's queries, what part 2 moves onto the blocks:
`count_neighbors` of the queries' tree (three radii) against scipy's, `query_pairs`
at about 10 pairs a point against scipy's `output_type="ndarray"`, `knn_graph` (k =
16) over every point against scipy's `query(k=17)`, and the `rbf` and `mls` fits at
k = 32 on `--local-queries` queries against scipy's `RBFInterpolator(neighbors=32)`,
with their RMSE; `radius_graph` and `NeighborList.update` over a periodic liquid of
`--liquid` points against scipy's periodic `query_pairs`; and `OperatorSeries` in
complex64 (a driven H0 + cos(t) H1, K = 40) at each of `--series-n` against 40
commutators with H0 at the same precision; and the seed's size (`--seed-n` points,
`--seed-queries` queries: build, kNN and IDW beside scipy, with the chip's peak
memory, as `benchmarks/large.py`). `--part2-tasks` picks some of these.

With `KDEQX_RECORD=benchmarks/results.jsonl` (and `KDEQX_COMMIT`, where the chip's
copy of the repository has no history), the build, kNN, `count_ball_point` and
`query_ball_point` rows are recorded for `benchmarks/table.py`.
"""

import argparse
import functools as ft
import os
import sys
import threading
import time

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from _timing import record
from large import seed_size
from scipy.spatial import cKDTree

import kdeqx
from kdeqx._backend import _lanes


# JAX's durations of tracing, lowering and compiling, by its monitoring events.
_STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_stage_seconds: list[tuple[str, float]] = []


def _on_duration(event: str, duration_secs: float, **_):
    if event in _STAGES:
        _stage_seconds.append((_STAGES[event], duration_secs))


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def first_and_best(fn, repeats=3):
    """Seconds of the first call, the best of `repeats` more, and the answer. A
    first call that compiled for more than a second also prints where its time
    went: tracing, lowering, and compiling (how many programs, the longest)."""
    _stage_seconds.clear()
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - start
    stages = {name: 0.0 for name in _STAGES.values()}
    for name, seconds in _stage_seconds:
        stages[name] += seconds
    compiles = [seconds for name, seconds in _stage_seconds if name == "compile"]
    if stages["compile"] > 1:
        print(
            f"  (first call {first:.2f} s: trace {stages['trace']:.2f} s, lower "
            f"{stages['lower']:.2f} s, compile {stages['compile']:.2f} s; programs "
            f"compiled {len(compiles)}, the longest {max(compiles):.2f} s)"
        )
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return first, best, out


def host_best(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


@jax.jit
def brute_knn8(points, x):
    """Exact 8 nearest by distance tiles (differences, not the expanded square)."""

    def one_chunk(xc):
        d2 = sum((xc[:, None, j] - points[None, :, j]) ** 2 for j in range(3))
        return jax.lax.top_k(-d2, 8)

    d2, indices = jax.lax.map(one_chunk, x.reshape(-1, 200, 3))
    return jnp.sqrt(-d2).reshape(-1, 8), indices.reshape(-1, 8)


def blobs(rng, n, centres=64, sigma=0.01):
    c = rng.random((centres, 3))
    return (c[rng.integers(0, centres, n)] + sigma * rng.normal(size=(n, 3))).astype(
        np.float32
    )


def check(name, d, i, sd, si):
    d, i = np.asarray(d), np.asarray(i)
    equal = np.mean(i == si)
    kth = np.max(np.abs(d[:, -1] - sd[:, -1]))
    print(f"  check {name}: indices equal {equal:.6f}, k-th distance off <= {kth:.2e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--queries", type=float, default=1e5)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--brute-queries", type=float, default=1e4)
    parser.add_argument("--shapes", action="store_true")
    parser.add_argument(
        "--compile-report",
        action="store_true",
        help="after the first calls, compile the build and kNN again, apart: trace "
        "and lower, compile, and the sorts in the compiled program",
    )
    parser.add_argument(
        "--compile-parts",
        action="store_true",
        help="compile kNN with the block engine's stages cut away one by one: the "
        "first pass alone, with the main stage, and whole",
    )
    parser.add_argument(
        "--compile-kernels",
        action="store_true",
        help="compile the kernels of a kNN tile alone, each beside its former way",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the first calls, trace three kNN calls and print the device's "
        "costliest operations",
    )
    parser.add_argument(
        "--tile-k",
        action="store_true",
        help="kNN at k from 16 to 128 with a tile's k best by rounds of minima and "
        "by a sort (kdeqx._engine._merge.ROUNDS_MAX_K)",
    )
    parser.add_argument(
        "--local-solvers",
        action="store_true",
        help="the local RBF's systems (k = 32, 36 unknowns) solved by elimination "
        "along the lanes and by XLA's batched LU: the solves alone, and the fit",
    )
    parser.add_argument("--skip-jaxkd", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the build, kNN and count_ball_point, on both point sets: a check "
        "of the engine in a few minutes (no brute force, jaxkd, lists or IDW)",
    )
    parser.add_argument(
        "--walk", action="store_true", help="also time kNN with the walk engine"
    )
    parser.add_argument(
        "--part2",
        action="store_true",
        help="instead of part 1's queries (after the build), those that part 2 "
        "moves onto the blocks: count_neighbors, query_pairs, knn_graph, the local "
        "fits (rbf, mls) at k = 32, radius_graph and NeighborList over a periodic "
        "liquid of --liquid points, and the operator series",
    )
    parser.add_argument(
        "--part2-tasks",
        nargs="+",
        choices=PART2_TASKS,
        default=PART2_TASKS,
        help="with --part2, only these: count_neighbors, query_pairs, knn_graph, the "
        "local fits, the liquid's graph and neighbour list, the operator series, "
        "and build, kNN and IDW at the seed's size (--seed-n, --seed-queries)",
    )
    parser.add_argument("--local-queries", type=float, default=1e5)
    parser.add_argument("--seed-n", type=float, default=1.4e7)
    parser.add_argument("--seed-queries", type=float, default=1e6)
    parser.add_argument("--liquid", type=float, default=1e5)
    parser.add_argument("--series-n", type=int, nargs="+", default=[256, 1024])
    parser.add_argument(
        "--series-paths",
        action="store_true",
        help="also time the series with its Cauchy product taken the other way "
        "(at points or directly) than the backend's default",
    )
    args = parser.parse_args()
    n, q, k = int(args.n), int(args.queries), args.k
    print(
        f"device {jax.devices()[0].device_kind}, host cores {os.cpu_count()}, "
        f"jax {jax.__version__}; n={n}, Q={q}, k={k}"
    )
    rng = np.random.default_rng(0)
    queries = rng.random((q, 3)).astype(np.float32)
    r = float((32 * 3 / (4 * np.pi * n)) ** (1 / 3))
    # Compiled once, for the uniform points: the blobs (arrays of the same shapes)
    # reuse the programs, as a second data set of the same size would.
    build = jax.jit(lambda p: kdeqx.KDTree(p, engine="blocks"))
    knn = jax.jit(lambda t, x: t.query(x, k=k))
    ball = jax.jit(lambda t, x: t.query_ball_point(x, r, max_neighbors=64))
    idw = jax.jit(lambda m, x: m(x))
    started = time.perf_counter()
    jaxkd_runs = []
    for name, pts in [
        ("uniform", rng.random((n, 3)).astype(np.float32)),
        ("blobs", blobs(rng, n)),
    ]:
        print(f"\n== {name} == ({time.perf_counter() - started:.0f} s into the run)")
        t_build, ref = host_best(lambda: cKDTree(pts), repeats=1)
        t_scipy, (sd, si) = host_best(lambda: ref.query(queries, k=k, workers=-1))
        print(f"scipy host: build {t_build:.3f} s, kNN {t_scipy:.4f} s")
        p_dev, x_dev = jnp.asarray(pts), jnp.asarray(queries)
        b_first, b_best, tree = first_and_best(lambda: build(p_dev))
        print(
            f"kdeqx build: first {b_first:.2f} s, steady {b_best:.4f} s "
            f"({b_best / t_build:.2f}x scipy's build)"
        )
        task = f"{name}, n={n:.0e}, Q={q:.0e}, blocks engine"
        host = f"scipy workers=-1, {os.cpu_count()} host cores"
        record(f"build {task}", b_best, f"{host}, build", t_build)
        if args.part2:  # on the uniform points only: part 2's targets are there
            tasks = set(args.part2_tasks)
            part2(
                tree, ref, pts, queries, r, int(args.local_queries), args.profile, tasks
            )
            if "liquid" in tasks:
                liquid(int(args.liquid), args.profile)
            if "series" in tasks:
                operator_series(args.series_n, args.profile, args.series_paths)
            if "seed" in tasks:
                into = time.perf_counter() - started
                print(f"\n== the seed's size == ({into:.0f} s into the run)")
                seed_size(int(args.seed_n), int(args.seed_queries), k, [], 32)
            break
        first, best, (d, i) = first_and_best(lambda: knn(tree, x_dev))
        print(
            f"kdeqx kNN: first {first:.2f} s, steady {best:.4f} s = "
            f"{best / t_scipy:.2f}x scipy workers=-1"
        )
        check("kdeqx", d, i, sd, si)
        record(f"kNN k={k} {task}", best, host, t_scipy)
        if args.compile_report:
            compile_report("build", lambda p: kdeqx.KDTree(p, engine="blocks"), p_dev)
            compile_report("kNN", lambda t, x: t.query(x, k=k), tree, x_dev)
        if args.compile_parts:
            compile_parts(tree, x_dev, k)
        if args.compile_kernels and name == "uniform":
            compile_kernels(tree, x_dev)
        if args.local_solvers and name == "uniform":
            local_solvers(tree, pts, x_dev)
        if args.profile:
            profile("kNN", lambda: knn(tree, x_dev))
        if args.walk:
            walk_tree = kdeqx.KDTree(p_dev, engine="walk")
            wf, wb, _ = first_and_best(lambda: knn(walk_tree, x_dev))
            print(
                f"kdeqx kNN, walk engine: first {wf:.2f} s, steady {wb:.4f} s = "
                f"{wb / t_scipy:.2f}x scipy; blocks/walk {best / wb:.2f}"
            )
        if args.shapes:
            shapes(tree, x_dev, k, t_scipy, sd, si)
        if args.tile_k:
            tile_k(tree, x_dev, ref, queries)
        if args.quick:
            count_ball_point(tree, ref, queries, x_dev, r, task, host)
            continue
        if k == 8:
            bq = int(args.brute_queries)
            bf, bb, (bd, bi) = first_and_best(lambda: brute_knn8(p_dev, x_dev[:bq]), 1)
            brute = bb * q / bq
            print(
                f"brute force on chip: {brute:.3f} s for Q (scaled from {bq}), "
                f"kdeqx {brute / best:.1f}x faster"
            )
            check("brute", bd, bi, sd[:bq], si[:bq])
        if not args.skip_jaxkd:
            # Last, after both point sets: its walk's time on the chip is the least
            # predictable part of the run.
            jaxkd_runs.append((name, p_dev, x_dev, k, best, sd, si))
        count_ball_point(tree, ref, queries, x_dev, r, task, host)
        t_lists, _ = host_best(lambda: ref.query_ball_point(queries, r, workers=-1))
        first, best_b, _ = first_and_best(lambda: ball(tree, x_dev))
        print(
            f"query_ball_point cap 64: first {first:.2f} s, steady {best_b:.4f} s "
            f"= {best_b / t_lists:.2f}x scipy lists ({t_lists:.4f} s)"
        )
        record(f"query_ball_point cap 64 {task}", best_b, f"{host}, lists", t_lists)
        values = jnp.asarray(np.sin(pts[:, 0] * 6))
        model = kdeqx.Interpolator(tree, values, k=8, kernel="idw")
        first, best_i, _ = first_and_best(lambda: idw(model, x_dev))
        print(f"IDW k=8 Q={q}: first {first:.2f} s, steady {best_i:.4f} s")

    stuck = False
    for name, *run in jaxkd_runs:
        elapsed = time.perf_counter() - started
        print(f"\n== jaxkd, {name} == ({elapsed:.0f} s into the run)")
        stuck = not jaxkd_knn(*run, limit=JAXKD_LIMIT)
        if stuck:
            break
    print(f"\nthe run took {time.perf_counter() - started:.0f} s")
    if stuck:
        # A call on the chip cannot be cancelled: leave without waiting for it.
        sys.stdout.flush()
        os._exit(0)


# Seconds jaxkd's first kNN call may take before it is reported as a lower bound; on
# the blobs one call on a few queries runs for minutes, past the run's 9 minutes.
JAXKD_LIMIT = 60.0


def within(fn, limit):
    """`fn()`'s answer (or its exception, raised), or `None` where it has not
    returned after `limit` seconds (it runs on in a daemon thread)."""
    box = []

    def run():
        try:
            box.append((True, fn()))
        except Exception as error:  # noqa: BLE001
            box.append((False, error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if not box:
        return None
    returned, value = box[0]
    if not returned:
        raise value
    return value


@ft.cache
def _counter(r):
    """One jitted `count_ball_point` at radius `r`, for both point sets."""
    return jax.jit(lambda t, x: t.count_ball_point(x, r))


def count_ball_point(tree, ref, queries, x_dev, r, task, host):
    """`count_ball_point` on the chip beside scipy's `return_length=True`."""
    t_count, sc = host_best(
        lambda: ref.query_ball_point(queries, r, workers=-1, return_length=True)
    )
    count = _counter(r)
    first, best_c, c = first_and_best(lambda: count(tree, x_dev))
    print(
        f"count_ball_point r={r:.4f} (mean {sc.mean():.1f}): first {first:.2f} s, "
        f"steady {best_c:.4f} s = {best_c / t_count:.2f}x scipy "
        f"({t_count:.4f} s); equal {np.mean(np.asarray(c) == sc):.6f}"
    )
    record(f"count_ball_point {task}", best_c, host, t_count)


PART2_TASKS = ["neighbors", "pairs", "knn_graph", "fits", "liquid", "series", "seed"]


def part2(tree, ref, pts, queries, r, local_q, profiled=False, tasks=None):
    """count_neighbors, query_pairs, knn_graph and the local fits on the blocks,
    beside scipy on the host cores (with `profiled`, where the pairs' and the
    graph's device time goes); of those, only the `tasks` named (default all)."""
    tasks = set(PART2_TASKS if tasks is None else tasks)
    if "neighbors" in tasks:
        count_neighbors(tree, ref, pts, queries, r)
    if "pairs" in tasks:
        query_pairs(tree, ref, pts, profiled)
    if "knn_graph" in tasks:
        knn_graph(ref, pts, profiled)
    if "fits" in tasks:
        local_fits(tree, pts, queries[:local_q])


def count_neighbors(tree, ref, pts, queries, r):
    other = cKDTree(queries)
    radii = np.array([r / 2, r, 2 * r])
    t_pairs, want = host_best(lambda: ref.count_neighbors(other, radii), repeats=1)
    x_tree = kdeqx.KDTree(jnp.asarray(queries), engine="blocks")
    pairs = jax.jit(lambda a, b: a.count_neighbors(b, radii))
    first, best, got = first_and_best(lambda: pairs(tree, x_tree))
    print(
        f"count_neighbors, 3 radii: first {first:.2f} s, steady {best:.4f} s = "
        f"{best / t_pairs:.2f}x scipy ({t_pairs:.4f} s); got {np.asarray(got)}, "
        f"scipy {want}"
    )
    n = len(pts)
    host = f"scipy, {os.cpu_count()} host cores"
    record(
        f"count_neighbors 3 radii, n={n:.0e}, Q={len(queries):.0e}", best, host, t_pairs
    )


def query_pairs(tree, ref, pts, profiled):
    n = len(pts)
    host = f"scipy, {os.cpu_count()} host cores"
    # About 10 pairs a point: n (4/3) pi r^3 / 2 = 10.
    r_pairs = float((15 / (np.pi * len(pts))) ** (1 / 3))
    t_list, expected = host_best(
        lambda: ref.query_pairs(r_pairs, output_type="ndarray"), repeats=1
    )
    capacity = int(1.05 * len(expected)) + 1024
    self_pairs = jax.jit(lambda t: t.query_pairs(r_pairs, max_pairs=capacity))
    first, best, (found, _, count) = first_and_best(lambda: self_pairs(tree), 1)
    found = np.asarray(found)[: int(count)]
    order = np.lexsort(expected.T[::-1])
    print(
        f"query_pairs r={r_pairs:.4f} ({len(expected) / len(pts):.1f} a point): first "
        f"{first:.2f} s, steady {best:.4f} s = {best / t_list:.2f}x scipy's ndarray "
        f"({t_list:.4f} s); equal {np.array_equal(found, expected[order])}"
    )
    record(f"query_pairs 10 a point, n={n:.0e}", best, f"{host}, ndarray", t_list)
    if profiled:
        profile("query_pairs", lambda: self_pairs(tree), calls=1)


def knn_graph(ref, pts, profiled):
    n = len(pts)
    p_dev = jnp.asarray(pts)
    t_graph, _ = host_best(lambda: ref.query(pts, k=17, workers=-1), repeats=1)
    graph = jax.jit(lambda p: kdeqx.knn_graph(p, 16, engine="blocks"))
    first, best, _ = first_and_best(lambda: graph(p_dev), repeats=1)
    print(
        f"knn_graph k=16 over every point: first {first:.2f} s, steady {best:.4f} s "
        f"= {best / t_graph:.2f}x scipy's query(k=17) ({t_graph:.4f} s)"
    )
    workers = f"scipy workers=-1, {os.cpu_count()} host cores, query(k=17)"
    record(f"knn_graph k=16, n={n:.0e}", best, workers, t_graph)
    if profiled:
        profile("knn_graph", lambda: graph(p_dev), calls=1)


def local_fits(tree, pts, x):
    from scipy.interpolate import RBFInterpolator

    n = len(pts)
    values = np.sin(6 * pts[:, 0]) * np.cos(4 * pts[:, 1])
    truth = np.sin(6 * x[:, 0]) * np.cos(4 * x[:, 1])
    scipy_rbf = RBFInterpolator(pts.astype(np.float64), values, neighbors=32)
    t_rbf, want = host_best(lambda: scipy_rbf(x.astype(np.float64)), repeats=1)
    for kernel in ("rbf", "mls"):
        model = kdeqx.Interpolator(
            tree, jnp.asarray(values, jnp.float32), k=32, kernel=kernel
        )
        fit = jax.jit(lambda m, x: m(x))
        first, best, got = first_and_best(lambda: fit(model, jnp.asarray(x)), 1)
        rmse = float(np.sqrt(np.mean((np.asarray(got) - truth) ** 2)))
        print(
            f"{kernel} k=32 Q={len(x)}: first {first:.2f} s, steady {best:.4f} s = "
            f"{best / t_rbf:.2f}x scipy RBFInterpolator(neighbors=32) "
            f"({t_rbf:.3f} s); RMSE {rmse:.2e} (scipy's "
            f"{float(np.sqrt(np.mean((want - truth) ** 2))):.2e})"
        )
        peer = f"scipy RBFInterpolator(neighbors=32), {os.cpu_count()} host cores"
        record(f"{kernel} k=32, n={n:.0e}, Q={len(x):.0e}", best, peer, t_rbf)


def local_solvers(tree, pts, x):
    """The local RBF's saddle-point systems solved by elimination along the lanes
    (`kdeqx._interpolation._dense._eliminate_in_lanes`) and by XLA's batched LU: the
    solves of `len(x)` random systems alone, then the whole fit at k = 32."""
    from kdeqx._interpolation import _dense

    rng = np.random.default_rng(2)
    size, m = len(x), 36
    a = rng.standard_normal((size, m, m)).astype(np.float32)
    a = a + a.transpose(0, 2, 1)
    a[:, 32:, 32:] = 0
    rhs = rng.standard_normal((size, m, 1)).astype(np.float32)
    matrix, vector = jnp.asarray(a), jnp.asarray(rhs)
    values = jnp.asarray(np.sin(6 * pts[:, 0]) * np.cos(4 * pts[:, 1]), jnp.float32)
    truth = np.sin(6 * np.asarray(x[:, 0])) * np.cos(4 * np.asarray(x[:, 1]))
    lanes = _dense._eliminate_in_lanes
    try:
        for name, solver in [("lanes", lanes), ("XLA's LU", _dense._lu_solve)]:
            solve = jax.jit(solver)
            first, best, (solution, _) = first_and_best(lambda: solve(matrix, vector))
            product = np.einsum("bij,bjk->bik", a[:1000], np.asarray(solution[:1000]))
            print(
                f"  {size} systems of {m} by {name}: first {first:.2f} s, steady "
                f"{best * 1e3:.1f} ms; largest residual of 1000 "
                f"{np.max(np.abs(product - rhs[:1000])):.1e}"
            )
            _dense._eliminate_in_lanes = solver  # the TPU's solver, in the fit
            jax.clear_caches()
            model = kdeqx.Interpolator(tree, values, k=32, kernel="rbf")
            fit = jax.jit(lambda m, x: m(x))
            first, best, got = first_and_best(lambda: fit(model, x), 1)
            rmse = float(np.sqrt(np.mean((np.asarray(got) - truth) ** 2)))
            print(
                f"  rbf k=32 by {name}: first {first:.2f} s, steady {best:.4f} s, "
                f"RMSE {rmse:.2e}"
            )
    finally:
        _dense._eliminate_in_lanes = lanes


def liquid(n, profiled=False, density=0.8, r=2.285):
    """`radius_graph` and `NeighborList.update` on the blocks over a periodic liquid
    (about 50 neighbours each), beside scipy's periodic `query_pairs`."""
    rng = np.random.default_rng(1)
    side = (n / density) ** (1 / 3)
    x = (rng.random((n, 3)) * side).astype(np.float32)
    periodic = cKDTree(x.astype(np.float64), boxsize=side)
    t_pairs, pairs = host_best(
        lambda: periodic.query_pairs(r, output_type="ndarray"), repeats=1
    )
    cell = np.full(3, side, np.float32)
    capacity = int(2.1 * len(pairs)) + 1024
    x_dev = jnp.asarray(x)
    graph = jax.jit(
        lambda x: kdeqx.radius_graph(x, r, capacity, cell=cell, engine="blocks")
    )
    first, best, found = first_and_best(lambda: graph(x_dev), 1)
    print(
        f"radius_graph, periodic liquid n={n}, r={r}: first {first:.2f} s, steady "
        f"{best:.4f} s = {best / t_pairs:.2f}x scipy's periodic query_pairs "
        f"({t_pairs:.4f} s); {int(found.count)} edges, scipy {2 * len(pairs)}"
    )
    peer = f"scipy periodic query_pairs, {os.cpu_count()} host cores"
    record(
        f"radius_graph periodic liquid, n={n:.0e}, blocks engine", best, peer, t_pairs
    )
    if profiled:
        profile("radius_graph", lambda: graph(x_dev), calls=1)
    start = time.perf_counter()
    nl = kdeqx.NeighborList.allocate(x, r, skin=0.3, cell=cell, engine="blocks")
    allocated = time.perf_counter() - start
    update = jax.jit(lambda nl, x: nl.update(x))
    first, best, _ = first_and_best(lambda: update(nl, x_dev))
    print(
        f"NeighborList on blocks: allocate {allocated:.2f} s; update without a "
        f"rebuild: first {first:.2f} s, steady {best:.4f} s"
    )


def tile_k(tree, x, ref, queries):
    """kNN for k beyond 16, a tile's k best taken by rounds of minima against by a
    sort, each checked against scipy."""
    from kdeqx._engine import _merge

    default = _merge.ROUNDS_MAX_K
    for k in (16, 17, 32, 64, 128):
        _, want = ref.query(queries, k=k, workers=-1)
        times = []
        for rounds_max in (k, k - 1):  # rounds, then the sort
            _merge.ROUNDS_MAX_K = rounds_max
            jax.clear_caches()  # the constant is read when the query is traced
            knn = jax.jit(lambda t, x: t.query(x, k=k))
            first, best, (_, i) = first_and_best(lambda: knn(tree, x))
            times.append((first, best, np.mean(np.asarray(i) == want)))
        (rf, rb, re), (sf, sb, se) = times
        print(
            f"kNN k={k}: rounds first {rf:.2f} s, steady {rb:.4f} s (equal {re:.6f}); "
            f"sort first {sf:.2f} s, steady {sb:.4f} s (equal {se:.6f})"
        )
    _merge.ROUNDS_MAX_K = default
    jax.clear_caches()


def operator_series(sizes, profiled=False, both_paths=False, order=40):
    """`OperatorSeries` in complex64 on the chip: first call and steady time against
    `order` commutators with the constant part of the generator, at the precision
    the series multiplies with (`HIGHEST`) and at the chip's default; with
    `profiled`, where the largest size spends its device time; with `both_paths`,
    the series again with its Cauchy product taken the other way (at points or
    directly, `kdeqx.series._recursion.POINTS_FROM_WORK`)."""
    import equinox as eqx

    from kdeqx._backend import FULL_PRECISION
    from kdeqx.series import _recursion

    def commutators(h, x, precision):
        def step(x, _):
            hx = jnp.matmul(h, x, precision=precision)
            xh = jnp.matmul(x, h, precision=precision)
            return 1j * (hx - xh), None

        return lax.scan(step, x, None, length=order)[0]

    def hermitian(key, n):
        a, b = jax.random.normal(key, (2, n, n), jnp.float32)
        m = (a + 1j * b) / np.sqrt(2 * n)
        return ((m + m.conj().T) / 2).astype(jnp.complex64)

    t = jnp.float32(0.3)
    for n in sizes:
        k0, k1, k2 = jax.random.split(jax.random.key(n), 3)
        h0, h1 = hermitian(k0, n), hermitian(k1, n)
        x0 = jnp.diag(jax.random.normal(k2, (n,))).astype(jnp.complex64)
        series = kdeqx.OperatorSeries(lambda t: h0 + jnp.cos(t) * h1, x0, order)
        run = eqx.filter_jit(lambda s, t: s.normalised(t))
        first, best, out = first_and_best(lambda: run(series, t), repeats=5)
        bounds = []
        for precision in (FULL_PRECISION, None):
            bound = jax.jit(lambda h, x, p=precision: commutators(h, x, p))
            bounds.append(first_and_best(lambda: bound(h0, x0), repeats=5)[1])
        print(
            f"OperatorSeries complex64 n={n} K={order}: first {first:.2f} s, steady "
            f"{best * 1e3:.2f} ms = {best / bounds[0]:.2f}x {order} commutators at "
            f"HIGHEST ({bounds[0] * 1e3:.2f} ms; default precision "
            f"{bounds[1] * 1e3:.2f} ms); finite {bool(jnp.all(jnp.isfinite(out)))}"
        )
        record(
            f"OperatorSeries complex64 n={n} K={order}",
            best,
            f"{order} commutators, HIGHEST, same chip",
            bounds[0],
        )
        if profiled and n == max(sizes):
            profile(f"OperatorSeries n={n}", lambda: run(series, t))
        if both_paths:
            h = _recursion.FactoredTerms.of(jnp.ones((1, 3)), h0[None], order + 2)
            at_points = _recursion._at_points_pays(h, n, order)
            names = [f"POINTS_FROM_WORK{end}" for end in ("", "_SMALL", "_TPU")]
            thresholds = {name: getattr(_recursion, name) for name in names}
            forced = 2**80 if at_points else 0
            for name in names:
                setattr(_recursion, name, forced)
            jax.clear_caches()  # the thresholds are read when the series is traced
            run = eqx.filter_jit(lambda s, t: s.normalised(t))
            other_first, other, other_out = first_and_best(lambda: run(series, t), 5)
            for name, value in thresholds.items():
                setattr(_recursion, name, value)
            jax.clear_caches()
            difference = float(jnp.max(jnp.abs(other_out - out)))
            print(
                f"  the product {'directly' if at_points else 'at points'} instead: "
                f"first {other_first:.2f} s, steady {other * 1e3:.2f} ms = "
                f"{other / bounds[0]:.2f}x; max difference {difference:.1e}"
            )


def compile_report(name, fn, *args):
    """Seconds to trace and lower `fn`, then to compile it, afresh, and how many
    sorts its compiled program holds (a TPU compiles each for seconds)."""
    jax.clear_caches()
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    traced = time.perf_counter() - start
    compiled = lowered.compile()
    compiling = time.perf_counter() - start - traced
    sorts = (compiled.as_text() or "").count(" sort(")
    print(
        f"  {name} compiled apart: trace and lower {traced:.2f} s, compile "
        f"{compiling:.2f} s, {sorts} sorts"
    )


def compile_parts(tree, x, k):
    """kNN compiled afresh with the block engine's later stages cut away (their
    answers are then incomplete): the first pass alone; with the main stage; and
    whole, with the search of overflowed blocks' queries alone. Where the compile
    time goes, stage by stage."""
    from kdeqx._engine import _blocks

    stage, alone = _blocks._stage, _blocks._alone

    def no_stage(steps, xb, vb, visitor_axis, init, own_reach, *args, **kwargs):
        # States that read the first pass's reach, which would otherwise go unused.
        unreached = jnp.any(own_reach < 0)
        states = jax.tree.map(lambda s: jnp.where(unreached, 0, s), init)
        return states, jnp.zeros(own_reach.shape[0], bool), kwargs.get("sink")

    def no_alone(steps, x, visitors, visitor_axis, init, reach, states, *args):
        return states, args[-1]

    parts = [
        ("first pass only", no_stage, no_alone),
        ("first pass and main stage", stage, no_alone),
        ("whole", stage, alone),
    ]
    try:
        for label, staged, alone_ in parts:
            _blocks._stage, _blocks._alone = staged, alone_
            compile_report(f"kNN, {label},", lambda t, x: t.query(x, k=k), tree, x)
    finally:
        _blocks._stage, _blocks._alone = stage, alone


def compile_kernels(tree, x, k=8, size=16):
    """The kernels of a kNN tile (the block engine's queries in blocks of `size`
    against 16 leaves each), compiled and run alone: its distances (also from the
    points' table and the queries laid out axis by axis beforehand), the k best of
    it, their merge into the k best so far, and the whole fold; each beside the way
    it was written before. Seconds to compile, and to run once compiled."""
    from kdeqx._engine import _blocks, _merge
    from kdeqx._engine._metric import Minkowski
    from kdeqx._engine._traverse import _Steps
    from kdeqx._query._knn import _KNearest

    blocks = x.shape[0] // size
    xb = x[: blocks * size].reshape(blocks, size, -1)
    halves = tree._halves_as_leaves()
    rng = np.random.default_rng(1)
    leaves = jnp.asarray(rng.integers(0, halves.num_leaves, (blocks, 16)), jnp.int32)

    def tiles(tree=halves, queries=xb):
        # Called with the tree and queries as arguments of the jitted kernel: as
        # constants, XLA would fold their layouts into the compile.
        return _blocks._Tiles(_Steps(tree, Minkowski(2.0)), queries)

    def per_query(f):
        return jax.vmap(jax.vmap(f, (0, None)), (0, 0))

    def lexicographic_reduction(d2, i):
        def least(a, b):
            first = (a[0] < b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
            return lax.select(first, a[0], b[0]), lax.select(first, a[1], b[1])

        big = jnp.asarray(jnp.iinfo(i.dtype).max, i.dtype)
        return lax.reduce((d2, i), (jnp.asarray(jnp.inf, d2.dtype), big), least, (0,))

    def unrolled_rounds(d2, i):
        d2, found = lax.optimization_barrier(d2), []
        for _ in range(k):
            least, index = lexicographic_reduction(d2, i)
            d2 = jnp.where(i == index, jnp.inf, d2)
            found.append((least, index))
        return tuple(jnp.stack(f) for f in zip(*found, strict=True))

    d2, indices = jax.jit(lambda: tiles().measure(leaves))()
    best = _merge.best_of_pairs(
        jnp.full((blocks, size, k), jnp.inf), jnp.full((blocks, size, k), -1)
    )
    tile_best = jax.jit(per_query(lambda d, i: _merge.smallest_pairs(d, i, k)))(
        d2, indices
    )
    visitor = _KNearest(k, jnp.asarray(jnp.inf, x.dtype), jnp.int32)
    init = _blocks._states_at_init(visitor, None, (blocks, size))
    # The tile's distances from inputs already laid out axis by axis (the points'
    # table transposed once, outside; the queries too): what the layouts cost.
    by_axis = halves.leaf_points.T.reshape(halves.d, -1, halves.leaf_size)
    queries_by_axis = jnp.moveaxis(xb, -1, 0)

    def distances_from_axes(by_axis, queries, queries_last: bool):
        d2 = 0
        for j in range(halves.d):
            axis = _gather_rows(by_axis[j], leaves).reshape(blocks, 1, -1)
            query = queries[:, :, j, None] if queries_last else queries[j][..., None]
            d2 = d2 + (axis - query) ** 2
        return d2

    kernels = [
        ("distances of a tile", lambda t, x: tiles(t, x).measure(leaves), (halves, xb)),
        (
            "distances: points' table given by axis",
            lambda t, x: distances_from_axes(t, x, True),
            (by_axis, xb),
        ),
        (
            "distances: points and queries by axis",
            lambda t, x: distances_from_axes(t, x, False),
            (by_axis, queries_by_axis),
        ),
        (
            "least pair: one two-operand reduction",
            per_query(lexicographic_reduction),
            (d2, indices),
        ),
        (
            "least pair: two plain reductions",
            per_query(_merge._lexicographic_min),
            (d2, indices),
        ),
        (
            "k best: rounds unrolled, two-operand",
            per_query(unrolled_rounds),
            (d2, indices),
        ),
        (
            "k best: smallest_pairs",
            per_query(lambda d, i: _merge.smallest_pairs(d, i, k)),
            (d2, indices),
        ),
        (
            "merge: packed 64-bit keys",
            jax.vmap(jax.vmap(_merge.merge_into_best)),
            (best, *tile_best),
        ),
        (
            "merge: 32-bit pairs",
            jax.vmap(jax.vmap(_merge.merge_sorted_into_best)),
            (best, *tile_best),
        ),
        (
            "fold: the whole tile",
            lambda t, x: tiles(t, x).fold(visitor, None, init, leaves)[0],
            (halves, xb),
        ),
    ]
    print(f"  kernels of a kNN tile, {blocks} blocks of {size} queries x 16 leaves:")
    for label, fn, args in kernels:
        jax.clear_caches()
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        compiling = time.perf_counter() - start
        jax.block_until_ready(compiled(*args))
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        print(
            f"    {label:40s} compile {compiling:6.2f} s, "
            f"run {1e3 * (time.perf_counter() - start):8.3f} ms"
        )


def _gather_rows(table, rows):
    from kdeqx._backend import gather_clamped

    return gather_clamped(table, rows)


def profile(name, fn, calls=3, top=15):
    """The operations that took the most device time over `calls` calls of `fn`
    (a loop's time includes its body's), from a `jax.profiler` trace: the
    accelerator's "XLA Ops", or every host thread's on a CPU."""
    import glob
    import tempfile
    from collections import Counter

    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(calls):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    device = [p for p in data.planes if p.name.startswith("/device:")]
    totals, counts = Counter(), Counter()
    for plane in device or [p for p in data.planes if p.name.startswith("/host:")]:
        for line in plane.lines:
            if device and line.name != "XLA Ops":
                continue
            for event in line.events:
                totals[event.name] += event.duration_ns
                counts[event.name] += 1
    print(f"  {name} profile, per call (a loop includes its body):")
    for op, ns in totals.most_common(top):
        print(f"    {ns / calls / 1e6:9.3f} ms  x{counts[op] // calls:<6d} {op[:100]}")


def shapes(tree, x, k, t_scipy, sd, si):
    default = _lanes._BLOCK_SHAPE
    for block in (8, 16, 32):
        for nearest, budget, chunk in ((32, 128, 16), (16, 128, 16), (32, 256, 32)):
            _lanes._BLOCK_SHAPE = _lanes.BlockShape(block, nearest, budget, chunk)
            jax.clear_caches()  # else the query's cached trace keeps the old shape
            knn = jax.jit(lambda t, x: t.query(x, k=k))
            first, best, (d, i) = first_and_best(lambda: knn(tree, x), 2)
            equal = np.mean(np.asarray(i) == si)
            print(
                f"  shape block={block} budget={budget} chunk={chunk}: first "
                f"{first:.2f} s, steady {best:.4f} s = {best / t_scipy:.2f}x scipy; "
                f"equal {equal:.6f}; blocks overflowed {overflowed(tree, x, k)}"
            )
    _lanes._BLOCK_SHAPE = default
    jax.clear_caches()


def overflowed(tree, x, k):
    """How many query blocks outgrew the frontier budget (answered by the slow,
    exact path)."""
    from kdeqx._engine._blocks import walk_blocks
    from kdeqx._engine._metric import Minkowski
    from kdeqx._query._knn import _KNearest

    @jax.jit
    def run(tree, x):
        halves = tree._halves_as_leaves()
        visitor = _KNearest(k, jnp.asarray(jnp.inf, x.dtype), jnp.int32)
        return walk_blocks(halves, x, visitor, Minkowski(2.0), None, count=True)[1]

    return int(run(tree, x))


def jaxkd_knn(p_dev, x_dev, k, best, sd, si, limit):
    """jaxkd's build and kNN on the chip; `False` where a call ran past `limit`
    seconds (and runs on)."""
    try:
        import jaxkd
    except ImportError:
        print("jaxkd not installed")
        return True
    q = x_dev.shape[0]
    # jaxkd's query vmaps a walk whose temporaries grow with the queries times the
    # points (about 480 bytes a point for each query, from its out-of-memory
    # reports): as many queries as a few GB of temporaries hold.
    part = int(min(q, max(1, 4e9 // (480 * p_dev.shape[0]))))
    try:
        start = time.perf_counter()
        tree = within(lambda: jax.block_until_ready(jaxkd.build_tree(p_dev)), limit)
        built = time.perf_counter() - start
        if tree is None:
            print(f"jaxkd on chip: build still running after {limit:.0f} s; stopped")
            return False
        query = lambda: jaxkd.query_neighbors(tree, x_dev[:part], k=k)  # noqa: E731
        start = time.perf_counter()
        out = within(lambda: jax.block_until_ready(query()), limit)
        first = time.perf_counter() - start
        if out is None:
            print(
                f"jaxkd on chip: build first {built:.2f} s; kNN on {part} queries "
                f"still running after {limit:.0f} s, so more than "
                f"{limit * q / part:.0f} s for Q: kdeqx more than "
                f"{limit * q / part / best:.0f}x faster"
            )
            return False
        ji, jd = out
        # A second call only where the first was short.
        jbest = first_and_best(query, 0)[0] if first < 30 else first
    except Exception as error:  # noqa: BLE001
        print(f"jaxkd on chip, {part} queries: {type(error).__name__}: {error}"[:300])
        return True
    jbest *= q / part
    print(
        f"jaxkd on chip: build first {built:.2f} s, kNN first {first:.2f} s, "
        f"steady {jbest:.4f} s for Q (scaled from {part}); kdeqx "
        f"{jbest / best:.1f}x faster"
    )
    check("jaxkd", jd, ji, sd[:part], si[:part])
    return True


if __name__ == "__main__":
    main()
