"""The GPU check: the seed user's size on one accelerator, against brute force there.

    python benchmarks/gpu.py [--n 1.4e7] [--queries 1e6] [--k 8] [--small-n 1e6]
        [--series-n 1024] [--pairs-n 1e6] [--local-n 1e6] [--local-queries 1e5]

Builds a tree over n uniform 3-D float32 points, answers Q queries, and times both
beside a chunked brute-force kNN (distance matrix + `lax.top_k`) on the same device,
checking that both agree; the same query with step caps of 8, 16 and 32 (the steps a
lane moves between two leaf visits, chosen per backend, so far measured on the CPU
only). Then, at `--small-n` points and Q / 10 queries: kNN at d = 8
and kNN with k = 128, each against brute force on a subset. Prints the lane count the
backend chose. Last, `kdeqx.OperatorSeries` in float64 with a driven Hamiltonian
H0 + cos(t) H1: the factored path against the general one at n = 64, K = 20, then
n = `--series-n` (1024), K = 40 against K commutators with the constant H0 on the
device. Then `query_pairs` at `--pairs-n` points, about 10 neighbours each, its count
checked against `count_neighbors`, and the local fits of `interpolate.py` (k = 32:
`rbf`, `mls`, IDW) beside scipy's `RBFInterpolator` on the host. Run it once per
device session and paste the output into `benchmarks/RESULTS.md`. (jaxkd is compared
only where it is installed.)
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from scipy.interpolate import RBFInterpolator

import kdeqx


def timed(fn, repeats=3):
    out = jax.block_until_ready(fn())  # first call: compile + run
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return out, best


@eqx.filter_jit
def brute_force(points, x, k, chunk):
    def one_chunk(xc):
        # Differences, not |x|^2 - 2 x.p + |p|^2: that expansion loses the small
        # distances of a dense cloud to cancellation (and to TF32 products on a GPU).
        d2 = jnp.sum((xc[:, None, :] - points[None, :, :]) ** 2, -1)
        return jax.lax.top_k(-d2, k)

    distances2, indices = jax.lax.map(one_chunk, x.reshape(-1, chunk, x.shape[-1]))
    return jnp.sqrt(jnp.maximum(-distances2, 0)).reshape(-1, k), indices.reshape(-1, k)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1.4e7)
    parser.add_argument("--queries", type=float, default=1e6)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--brute-queries", type=float, default=1e4)
    parser.add_argument("--small-n", type=float, default=1e6)
    parser.add_argument("--series-n", type=int, default=1024)
    parser.add_argument("--pairs-n", type=float, default=1e6)
    parser.add_argument("--local-n", type=float, default=1e6)
    parser.add_argument("--local-queries", type=float, default=1e5)
    args = parser.parse_args()
    n, q, k = int(args.n), int(args.queries), args.k
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    print(f"n={n:,} points, Q={q:,} queries, k={k}, float32, 3-D uniform")

    key_points, key_queries = jax.random.split(jax.random.key(0))
    points = jax.random.uniform(key_points, (n, 3), jnp.float32)
    x = jax.random.uniform(key_queries, (q, 3), jnp.float32)

    build = eqx.filter_jit(kdeqx.KDTree)
    start = time.perf_counter()
    tree = jax.block_until_ready(build(points))
    print(f"build, first call: {time.perf_counter() - start:.3f} s")
    tree, build_time = timed(lambda: build(points), repeats=1)
    print(f"build, steady:     {build_time:.3f} s")

    query = eqx.filter_jit(lambda tree, x: tree.query(x, k))
    start = time.perf_counter()
    jax.block_until_ready(query(tree, x))
    first = time.perf_counter() - start
    (distances, indices), query_time = timed(lambda: query(tree, x))
    print(f"query, first call: {first:.3f} s; steady: {query_time:.4f} s")

    # Brute force over a subset of the queries (it is O(Q n)), scaled to Q.
    qb = int(args.brute_queries)
    xb = x[:qb]
    # Chunks of 100 queries: a (100, n) distance block is 5.6 GB at n = 1.4e7.
    (bd, _), brute_time = timed(lambda: brute_force(points, xb, k, 100), repeats=1)
    scaled = brute_time * q / qb
    print(f"brute force: {brute_time:.3f} s for {qb:,} queries -> {scaled:.2f} s for Q")
    print(f"kdeqx / brute force (per query): {query_time / scaled:.4f}")
    agree = np.allclose(
        np.asarray(distances[:qb]), np.asarray(bd), rtol=1e-3, atol=1e-4
    )
    print(f"distances agree with brute force: {agree}")
    step_caps(tree, x, k, indices)

    small_n, small_q = int(args.small_n), max(1000, q // 10)
    for d, kk in ((8, k), (3, 128)):
        against_brute_force(small_n, small_q, d, kk, qb)

    try:
        import jaxkd  # noqa: F401
    except ImportError:
        print("jaxkd: not installed, not compared")

    pairs_on_device(int(args.pairs_n))
    local_fits(int(args.local_n), int(args.local_queries))
    operator_series(args.series_n)


def pairs_on_device(n):
    """`query_pairs` at about 10 neighbours per point (the leaf-by-leaf walk), its
    count checked against `count_neighbors` of the tree with itself, which counts
    every ordered pair and each point with itself: `2 * pairs + n`."""
    points = jax.random.uniform(jax.random.key(17), (n, 3), jnp.float32)
    r = float((10 / (n * 4 / 3 * np.pi)) ** (1 / 3))
    tree = eqx.filter_jit(kdeqx.KDTree)(points)
    capacity = int(6 * n)
    pairs = eqx.filter_jit(lambda tree: tree.query_pairs(r, capacity))
    start = time.perf_counter()
    jax.block_until_ready(pairs(tree))
    first = time.perf_counter() - start
    (_, _, count), steady = timed(lambda: pairs(tree))
    ordered = eqx.filter_jit(lambda tree: tree.count_neighbors(tree, r))(tree)
    print(
        f"query_pairs n={n:,} r={r:.4f}: first call {first:.3f} s, steady "
        f"{steady:.4f} s, {int(count):,} pairs; count_neighbors agrees: "
        f"{2 * int(count) + n == int(ordered)}"
    )


def local_fits(n, q, budgets=(2**24, 2**27, 2**30)):
    """Local fits at k = 32 (`benchmarks/interpolate.py` part 3) on the device:
    kdeqx's `rbf` (thin-plate spline, degree 1), `mls` and IDW in float32, beside
    scipy's `RBFInterpolator(neighbors=32)` in float64 on this machine's CPU (one
    thread: it has no `workers`), timed once. RMSE against the smooth field; the
    `rbf` agrees when its RMSE is within 5 % of scipy's. Then `rbf` with other
    memory budgets for the queries fitted at once (`kdeqx._backend.fit_chunk`; the
    CPU always fits 2,048)."""
    from interpolate import kdeqx_kernels, LOCAL_K, rmse, smooth_field

    from kdeqx._backend import _lanes as _backend

    rng = np.random.default_rng(0)
    points, x = rng.random((n, 3)), rng.random((q, 3))
    values, truth = smooth_field(points), smooth_field(x)
    scipy_rbf = RBFInterpolator(points, values, neighbors=LOCAL_K)
    start = time.perf_counter()
    scipy_estimate = scipy_rbf(x)
    scipy_time = time.perf_counter() - start
    scipy_rmse = rmse(scipy_estimate, truth)
    print(
        f"local fits n={n:,} Q={q:,} k={LOCAL_K}: scipy RBF (CPU, 1 thread) "
        f"{scipy_time:.2f} s, RMSE {scipy_rmse:.2e}"
    )
    tree = eqx.filter_jit(kdeqx.KDTree)(points.astype(np.float32))
    x32, values32 = jnp.asarray(x, jnp.float32), jnp.asarray(values, jnp.float32)
    for name, fn in kdeqx_kernels(LOCAL_K).items():
        start = time.perf_counter()
        estimate = jax.block_until_ready(fn(tree, x32, values32))
        first = time.perf_counter() - start
        _, seconds = timed(lambda: fn(tree, x32, values32))
        error = rmse(estimate, truth)
        line = (
            f"  {name:<18} first call {first:.2f} s, steady {seconds:.4f} s "
            f"({scipy_time / seconds:.0f}x scipy), RMSE {error:.2e}"
        )
        if name.startswith("rbf"):
            line += f"; rbf agrees with scipy: {error <= 1.05 * scipy_rmse}"
        print(line)
    chosen, times, chunks = _backend._ACCELERATOR_FIT_BYTES, [], set()
    rbf = dict(k=LOCAL_K, kernel="rbf")
    system = (LOCAL_K + 4) ** 2 * 4  # thin-plate spline, degree 1, 3-D, float32
    for budget in budgets:
        _backend._ACCELERATOR_FIT_BYTES = budget  # read when traced: trace afresh
        chunk = _backend.fit_chunk(system)
        if chunk in chunks:  # the same program (always, on the CPU)
            continue
        chunks.add(chunk)
        fit = eqx.filter_jit(lambda tree, x, v: tree.interpolate(x, v, **rbf))
        _, seconds = timed(lambda: fit(tree, x32, values32))
        times.append(f"{chunk}: {seconds:.4f} s")
    _backend._ACCELERATOR_FIT_BYTES = chosen
    print(
        f"  rbf by queries fitted at once (chosen: {_backend.fit_chunk(system)}): "
        f"{', '.join(times)}"
    )


def step_caps(tree, x, k, expected, caps=(8, 16, 32)):
    """The same query with other step caps (steps between two leaf visits, chosen
    per backend: `kdeqx._backend.step_cap`): steady times, and the same answers."""
    from kdeqx._backend import _lanes as _backend

    name = "CPU_STEPS" if jax.default_backend() == "cpu" else "ACCELERATOR_STEPS"
    chosen = getattr(_backend, name)
    times, same = [], True
    for cap in caps:
        setattr(_backend, name, cap)  # read when the walk is traced: trace afresh
        eqx.clear_caches()
        jax.clear_caches()
        query = eqx.filter_jit(lambda tree, x: tree.query(x, k))
        (_, indices), seconds = timed(lambda: query(tree, x))
        times.append(f"{cap}: {seconds:.4f} s")
        same &= bool(np.array_equal(np.asarray(indices), np.asarray(expected)))
    setattr(_backend, name, chosen)
    eqx.clear_caches()
    jax.clear_caches()
    print(f"step caps (chosen: {chosen}): {', '.join(times)}; answers agree: {same}")


def against_brute_force(n, q, d, k, brute_queries):
    """kNN at another size, dimension or k: steady query time, beside brute force."""
    from kdeqx._backend import lane_count

    key_points, key_queries = jax.random.split(jax.random.key(d * 1000 + k))
    points = jax.random.uniform(key_points, (n, d), jnp.float32)
    x = jax.random.uniform(key_queries, (q, d), jnp.float32)
    tree = eqx.filter_jit(kdeqx.KDTree)(points)
    query = eqx.filter_jit(lambda tree, x: tree.query(x, k))
    (distances, _), query_time = timed(lambda: query(tree, x))
    qb = min(q, brute_queries)
    (bd, _), brute_time = timed(lambda: brute_force(points, x[:qb], k, 100), repeats=1)
    agree = np.allclose(
        np.asarray(distances[:qb]), np.asarray(bd), rtol=1e-3, atol=1e-4
    )
    print(
        f"n={n:,} Q={q:,} d={d} k={k} ({lane_count(8 * k)} lanes): query "
        f"{query_time:.4f} s; brute force {brute_time * q / qb:.2f} s for Q; "
        f"agree: {agree}"
    )


def operator_series(n, order=40):
    """The driven Hamiltonian of `benchmarks/operator_series.py` section 5, float64."""
    jax.config.update("jax_enable_x64", True)
    # The same problem and bound as on the CPU (imported here: it enables float64).
    from operator_series import commutators, driven_problem, driven_series

    t = jnp.float64(0.3)
    small = driven_problem(64)
    fast = np.asarray(driven_series(small, 20).normalised(t))
    general = np.asarray(driven_series(small, 20, factored=False).normalised(t))
    error = np.max(np.abs(fast - general), axis=(1, 2)) / np.max(
        np.abs(general), axis=(1, 2)
    )
    print(f"series n=64 K=20: factored against general, max rel diff {error.max():.1e}")
    problem = driven_problem(n)
    big = driven_series(problem, order)
    start = time.perf_counter()
    jax.block_until_ready(big.normalised(t))
    first = time.perf_counter() - start
    _, run = timed(lambda: big.normalised(t))
    bound = jax.jit(commutators, static_argnums=2)
    _, bound_run = timed(lambda: bound(problem[0], problem[2], order))
    print(
        f"series n={n} K={order} (terms {big.factored_terms()}): first call "
        f"{first:.2f} s, steady {run:.3f} s; {order} commutators {bound_run:.3f} s "
        f"(ratio {run / bound_run:.1f})"
    )


if __name__ == "__main__":
    main()
