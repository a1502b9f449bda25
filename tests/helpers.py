"""Data sets and independent references (numpy brute force, scipy) for the tests."""

import importlib
import os

import equinox as eqx
import jax
import jax.extend.core as jex
import numpy as np

from kdeqx._backend import QUICK_START_OPTIONS


DTYPES = [np.float32, np.float64]

# Compiling is most of the suite's time. Unless `XLA_FLAGS` is already set, the tests
# compile with XLA:CPU's older loop emitters and LLVM at -O0 (`conftest.py` sets them):
# the same programs, compiled in less time and run more slowly, which suits a suite of
# small problems (`docs/design-decisions.md`, "The test suite"). Two examples
# (`test_examples.py`) run with XLA's defaults, as users run them.
SUITE_XLA_FLAGS = " ".join(
    f"--{name}={str(value).lower()}"
    for name, value in {
        **QUICK_START_OPTIONS,
        "xla_backend_optimization_level": 0,
    }.items()
)


def environment_with_xla_defaults(**extra: str) -> dict[str, str]:
    """This process's environment for a script run as users run it: without the
    suite's `SUITE_XLA_FLAGS` (other `XLA_FLAGS` are kept), with `extra` added."""
    env = {**os.environ, **extra}
    if env.get("XLA_FLAGS") == SUITE_XLA_FLAGS:
        del env["XLA_FLAGS"]
    return env


def uniform(rng, n, d):
    return rng.random((n, d))


def clustered(rng, n, d):
    centres = rng.random((5, d))
    return centres[rng.integers(0, 5, n)] + 0.01 * rng.standard_normal((n, d))


def duplicates(rng, n, d):
    """Only a handful of distinct points, each repeated many times."""
    distinct = rng.random((max(1, n // 20), d))
    return distinct[rng.integers(0, len(distinct), n)]


def lattice(rng, n, d):
    """Integer lattice points (exact in float32), shuffled: many exact distance ties."""
    side = int(np.ceil(n ** (1 / d))) + 1
    grid = np.stack(np.meshgrid(*[np.arange(side)] * d, indexing="ij"), -1)
    grid = grid.reshape(-1, d)[:n]
    return grid[rng.permutation(len(grid))]


def line(rng, n, d):
    """All points on one line through the space (degenerate in d - 1 directions)."""
    direction = rng.standard_normal(d)
    return rng.random((n, 1)) * direction[None, :] + 0.3


DATASETS = {
    "uniform": uniform,
    "clustered": clustered,
    "duplicates": duplicates,
    "lattice": lattice,
    "line": line,
}


def lattice_queries(rng, q, d, side=4):
    """Queries on the lattice and on half-integer offsets: ties everywhere."""
    return rng.integers(0, side, (q, d)) + 0.5 * rng.integers(0, 2, (q, d))


def brute_force_knn(points, x, k, distance_upper_bound=np.inf):
    """Exact kNN by sorting all squared distances, ties by lower index (float64)."""
    points = np.asarray(points, np.float64)
    x = np.asarray(x, np.float64)
    n = len(points)
    d2 = np.sum((x[:, None, :] - points[None, :, :]) ** 2, axis=-1)
    order = np.lexsort((np.broadcast_to(np.arange(n), d2.shape), d2), axis=-1)[:, :k]
    distances = np.sqrt(np.take_along_axis(d2, order, axis=-1))
    indices = order
    missing = distances >= distance_upper_bound
    pad = max(0, k - n)
    distances = np.concatenate(
        [np.where(missing, np.inf, distances), np.full((len(x), pad), np.inf)], -1
    )
    indices = np.concatenate(
        [np.where(missing, n, indices), np.full((len(x), pad), n)], -1
    )
    return distances, indices


@eqx.filter_jit
def jit_query(tree, x, k, distance_upper_bound=np.inf):
    return tree.query(x, k, distance_upper_bound=distance_upper_bound)


def tolerance(dtype):
    return dict(rtol=2e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12)


def assert_knn_correct(points, x, k, distances, indices, *, exact_ties, ub=np.inf):
    """Checks a kNN answer against brute force.

    With `exact_ties` (float64, or data whose distances are exact in the working
    dtype) indices must equal the lexicographic (distance, index) reference. Otherwise
    near-ties may legitimately swap under rounding, so the check is that distances
    match and every returned index really lies at its returned distance.
    """
    dtype = np.asarray(distances).dtype
    points = np.asarray(points, np.float64)
    distances = np.asarray(distances, np.float64).reshape(len(x), k)
    indices = np.asarray(indices).reshape(len(x), k)
    ref_d, ref_i = brute_force_knn(points, x, k, ub)
    np.testing.assert_allclose(distances, ref_d, **tolerance(dtype))
    if exact_ties:
        np.testing.assert_array_equal(indices, ref_i)
        return
    n = len(points)
    found = indices < n
    assert np.array_equal(found, np.isfinite(distances))
    true = np.linalg.norm(points[np.minimum(indices, n - 1)] - x[:, None, :], axis=-1)
    np.testing.assert_allclose(
        np.where(found, true, np.inf), distances, **tolerance(dtype)
    )
    for row in indices:
        real = row[row < n]
        assert len(np.unique(real)) == len(real), "a neighbour was returned twice"


def central_difference(f, x, eps=1e-6):
    """The gradient of a scalar function by central differences, in float64."""
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = eps
        grad[i] = (f(x + step) - f(x - step)) / (2 * eps)
    return grad


def count_equations(jaxpr) -> int:
    """Equations in a jaxpr, including those of every nested jaxpr (loops, conds)."""
    total = 0
    for equation in jaxpr.eqns:
        total += 1
        for param in equation.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                if isinstance(sub, jex.ClosedJaxpr):
                    total += count_equations(sub.jaxpr)
                elif isinstance(sub, jex.Jaxpr):
                    total += count_equations(sub)
    return total


def x64(enabled: bool):
    """`jax.enable_x64(enabled)`, or its older names before JAX 0.8."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(enabled)
    experimental = importlib.import_module("jax.experimental")
    return experimental.enable_x64() if enabled else experimental.disable_x64()


def x64_off():
    return x64(False)


def queries_around(rng, points, dataset, m, dtype):
    """`m` queries in and around the points' box (lattice queries for the lattice),
    the first eight exactly at data points."""
    if dataset == "lattice":
        return lattice_queries(rng, m, points.shape[1]).astype(dtype)
    span = points.max(0) - points.min(0) + 0.1
    x = (points.min(0) - 0.05 + span * rng.random((m, points.shape[1]))).astype(dtype)
    x[:8] = points[:8]  # queries exactly at data points: zero distances
    return x


def ulp(dtype) -> float:
    """The spacing of floats at 1 in `dtype`."""
    return float(np.finfo(dtype).eps)
