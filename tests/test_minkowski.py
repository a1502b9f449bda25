"""Minkowski p-norms, approximate search (`eps`), ranks as a sequence and any
`leaf_size`, against scipy's cKDTree and numpy brute force."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx


P_VALUES = [1.0, 1.5, 2.0, 3.0, np.inf]
# Every norm in float64 (exact ties), the fast paths' two extremes in float32 (p = 2 in
# float32 is the rest of the suite).
NORMS_AND_DTYPES = [(p, np.float64) for p in P_VALUES] + [
    (1.0, np.float32),
    (np.inf, np.float32),
]
N, Q, K = 400, 64, 6


def minkowski(diff, p):
    diff = np.abs(diff)
    if p == np.inf:
        return diff.max(-1)
    return (diff**p).sum(-1) ** (1 / p)


def brute_force(points, x, k, p, box=None, bound=np.inf):
    """kNN in the p-norm by sorting every distance, ties by lower index (float64)."""
    points, x = np.asarray(points, np.float64), np.asarray(x, np.float64)
    diff = x[:, None, :] - points[None, :, :]
    if box is not None:
        diff = diff - box * np.round(diff / box)
    distances = minkowski(diff, p)
    n = len(points)
    order = np.lexsort((np.broadcast_to(np.arange(n), distances.shape), distances))
    order = order[:, :k]
    found = np.take_along_axis(distances, order, -1)
    missing = found >= bound
    pad = ((0, 0), (0, k - order.shape[1]))
    return (
        np.pad(np.where(missing, np.inf, found), pad, constant_values=np.inf),
        np.pad(np.where(missing, n, order), pad, constant_values=n),
    )


@eqx.filter_jit
def queried(tree, x, k, p, eps=0.0, bound=np.inf):
    return tree.query(x, k, p=p, eps=eps, distance_upper_bound=bound)


def data(dtype, d=3, seed=0, lattice=False):
    rng = np.random.default_rng(seed)
    if lattice:  # exact distances in every dtype: ties decided by index alone
        points = rng.integers(0, 6, (N, d))
        x = rng.integers(0, 6, (Q, d)) + 0.5 * rng.integers(0, 2, (Q, d))
    else:
        points, x = rng.random((N, d)), rng.random((Q, d))
    return points.astype(dtype), x.astype(dtype)


def check_knn(points, x, answer, p, **reference):
    distances, indices = (np.asarray(a) for a in answer)
    ref_d, ref_i = brute_force(points, x, distances.shape[-1], p, **reference)
    if distances.dtype == np.float64:
        np.testing.assert_allclose(distances, ref_d, rtol=1e-12)
        np.testing.assert_array_equal(indices, ref_i)
        return
    np.testing.assert_allclose(distances, ref_d, rtol=2e-5, atol=1e-6)
    # Near-ties may swap in float32: each index must lie at its distance.
    n = len(points)
    rows = np.asarray(points, np.float64)[np.minimum(indices, n - 1)]
    diff = x[:, None, :].astype(np.float64) - rows
    if "box" in reference and reference["box"] is not None:
        diff = diff - reference["box"] * np.round(diff / reference["box"])
    true = np.where(indices < n, minkowski(diff, p), np.inf)
    np.testing.assert_allclose(true, distances, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("p, dtype", NORMS_AND_DTYPES)
def test_knn_in_every_norm(p, dtype):
    points, x = data(dtype)
    tree = kdeqx.KDTree(points)
    check_knn(points, x, queried(tree, x, K, p), p)
    bound = 0.1
    check_knn(points, x, queried(tree, x, K, p, bound=bound), p, bound=bound)
    scipy_d, scipy_i = cKDTree(points).query(x, K, p=p)
    np.testing.assert_allclose(
        np.asarray(queried(tree, x, K, p)[0]), scipy_d, rtol=2e-5
    )


@pytest.mark.parametrize("p", P_VALUES)
def test_ties_broken_by_index_in_every_norm(p):
    points, x = data(np.float32, lattice=True)
    check_knn(
        points, x, queried(kdeqx.KDTree(points), x, K, p), p
    )  # float32, but exact


@pytest.mark.parametrize(
    "p, dtype", [(1.0, np.float64), (3.0, np.float64), (np.inf, np.float32)]
)
def test_periodic_knn_in_every_norm(p, dtype):
    points, x = data(dtype)
    box = np.array([1.0, 1.0, 0.0])  # the last axis is not periodic
    tree = kdeqx.KDTree(points, box=box)
    reference_box = np.array([1.0, 1.0, 10.0])  # 10: never wraps
    check_knn(points, x, queried(tree, x, K, p), p, box=reference_box)
    scipy_d, _ = cKDTree(points, boxsize=[1.0, 1.0, 10.0]).query(x, K, p=p)
    np.testing.assert_allclose(np.asarray(queried(tree, x, K, p)[0]), scipy_d, 2e-5)


@pytest.mark.parametrize("p, dtype", NORMS_AND_DTYPES)
def test_radius_queries_in_every_norm(p, dtype):
    points, x = data(dtype)
    tree, reference = kdeqx.KDTree(points), cKDTree(points)
    r = 0.15
    counts = tree.count_ball_point(x, r, p=p)
    expected = reference.query_ball_point(x, r, p=p, return_length=True)
    np.testing.assert_array_equal(counts, expected)
    distances, indices, found = tree.query_ball_point(x, r, 64, p=p)
    np.testing.assert_array_equal(found, expected)
    for row, expected_row in zip(
        np.asarray(indices), reference.query_ball_point(x, r, p=p), strict=True
    ):
        assert set(row[row < N]) == set(expected_row)


@pytest.mark.parametrize("p", [1.0, 2.0, np.inf])
@pytest.mark.parametrize("eps", [0.1, 1.0])
def test_approximate_knn_within_one_plus_eps(eps, p):
    rng = np.random.default_rng(1)
    points, x = rng.random((3000, 3)), rng.random((Q, 3))
    points, x = points.astype(np.float32), x.astype(np.float32)
    tree = kdeqx.KDTree(points)
    distances, indices = (np.asarray(a) for a in queried(tree, x, K, p, eps))
    exact, _ = brute_force(points, x, K, p)
    assert np.all(distances <= (1 + eps) * exact * (1 + 1e-6))
    assert np.all(distances >= exact * (1 - 1e-6))
    # Every returned index lies at its distance, and none twice.
    true = minkowski(x[:, None, :] - points[indices].astype(np.float64), p)
    np.testing.assert_allclose(true, distances, rtol=2e-5)
    assert all(len(set(row)) == K for row in indices)


@pytest.mark.parametrize("eps", [0.1, 1.0])
def test_approximate_radius_queries_as_scipy_documents(eps):
    rng = np.random.default_rng(2)
    points, x = rng.random((3000, 3)), rng.random((Q, 3))
    tree, reference = kdeqx.KDTree(points), cKDTree(points)
    r = 0.1
    counts = np.asarray(tree.count_ball_point(x, r, eps=eps))
    inner = reference.query_ball_point(x, r / (1 + eps), return_length=True)
    # scipy's contract: nothing beyond r (1 + eps).
    outer = reference.query_ball_point(x, r * (1 + eps), return_length=True)
    assert np.all((inner <= counts) & (counts <= outer))
    _, indices, found = tree.query_ball_point(x, r, 200, eps=eps)
    for row, count, must, may in zip(
        np.asarray(indices),
        np.asarray(found),
        reference.query_ball_point(x, r / (1 + eps)),
        reference.query_ball_point(x, r * (1 + eps)),
        strict=True,
    ):
        kept = set(row[row < len(points)])
        assert len(kept) == count and set(must) <= kept <= set(may)


def test_eps_under_jit_is_one_program():
    points, x = data(np.float32)
    tree = kdeqx.KDTree(points)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def approximate(tree, x, eps):
        return tree.query(x, 3, eps=eps)

    for eps in (0.0, 0.5, 2.0):
        approximate(tree, x, jnp.asarray(eps))
    with pytest.raises(eqx.EquinoxRuntimeError, match="eps"):
        jax.block_until_ready(approximate(tree, x, jnp.asarray(-1.0)))


@pytest.mark.x64
def test_ranks_as_a_sequence():
    points, x = data(np.float64)
    tree = kdeqx.KDTree(points)
    ranks = [1, 3, 8]
    distances, indices = tree.query(x, ranks, p=1)
    ref_d, ref_i = brute_force(points, x, 8, 1.0)
    np.testing.assert_allclose(distances, ref_d[:, [0, 2, 7]], rtol=1e-12)
    np.testing.assert_array_equal(indices, ref_i[:, [0, 2, 7]])
    scipy_d, scipy_i = cKDTree(points).query(x, ranks, p=1)
    np.testing.assert_allclose(distances, scipy_d, rtol=1e-12)
    # Ranks beyond n are sentinels, as in scipy.
    far_d, far_i = kdeqx.KDTree(points[:2]).query(x[0], [2, 5])
    scipy_d, scipy_i = cKDTree(points[:2]).query(x[0], [2, 5])
    np.testing.assert_array_equal(far_i, scipy_i)
    np.testing.assert_allclose(far_d, scipy_d, rtol=1e-12)


@pytest.mark.x64
def test_interpolation_in_a_norm():
    points, x = data(np.float64)
    values = np.sin(points.sum(-1))
    for p in (1.0, np.inf):
        got = kdeqx.KDTree(points).interpolate(x, values, k=5, p=p)
        distances, indices = brute_force(points, x, 5, p)
        weights = 1 / distances**2
        expected = (weights * values[indices]).sum(-1) / weights.sum(-1)
        np.testing.assert_allclose(got, expected, rtol=1e-10)
        interpolator = kdeqx.Interpolator(kdeqx.KDTree(points), values, k=5, p=p)
        np.testing.assert_allclose(interpolator(x), expected, rtol=1e-10)


@pytest.mark.x64
@pytest.mark.parametrize("p", [1.0, 3.0, np.inf])
def test_gradients_in_every_norm(p):
    points, x = data(np.float64)
    tree = kdeqx.KDTree(points)

    def total(x):
        return jnp.sum(tree.query(x, 3, p=p)[0])

    grad = jax.grad(total)(x[:8])
    step = 1e-6
    for i, j in [(0, 0), (3, 1), (7, 2)]:
        e = np.zeros_like(x[:8])
        e[i, j] = step
        numeric = (total(x[:8] + e) - total(x[:8] - e)) / (2 * step)
        np.testing.assert_allclose(grad[i, j], numeric, rtol=1e-5, atol=1e-8)
    # At a data point: finite, not NaN.
    assert np.all(np.isfinite(jax.grad(total)(points[:4])))


def test_far_queries_in_every_norm():
    points, _ = data(np.float32)
    far = np.array([[3e20, 0.0, 0.0], [0.5, 0.5, 0.5]], np.float32)
    for p in (1.0, 3.0, np.inf):
        distances, indices = kdeqx.KDTree(points).query(far, 2, p=p)
        assert np.all(np.isfinite(distances))
        ref_d, _ = brute_force(points, far, 2, p)
        np.testing.assert_allclose(distances, ref_d, rtol=1e-6)


@pytest.mark.parametrize("leaf_size", [1, 10, 40])
def test_small_trees_with_any_leaf_size(leaf_size):
    rng = np.random.default_rng(leaf_size)
    points = rng.random((70, 2)).astype(np.float32)
    x = rng.random((16, 2)).astype(np.float32)
    sizes = {0, 1, 2, leaf_size - 1, leaf_size, leaf_size + 1, 2 * leaf_size + 1, 70}
    for n in sorted(s for s in sizes if 0 <= s <= 70):
        tree = kdeqx.KDTree(points[:n], leaf_size=leaf_size)
        # Every point in exactly one slot, inside its leaf's box.
        slots = np.asarray(tree.leaf_indices)
        assert len(slots) % leaf_size == 0 and len(slots) >= n
        assert sorted(slots[slots < n].tolist()) == list(range(n))
        assert np.all(slots[slots >= n] == n)
        leaf = np.arange(len(slots)) // leaf_size + tree.num_leaves - 1
        inside = (tree.node_lo[:, leaf].T <= tree.leaf_points) & (
            tree.leaf_points <= tree.node_hi[:, leaf].T
        )
        assert np.all(inside[slots < n])
    for n in (leaf_size + 1, 70):
        tree = kdeqx.KDTree(points[:n], leaf_size=leaf_size)
        ref_d, _ = brute_force(points[:n], x, 4, 2.0)
        np.testing.assert_allclose(queried(tree, x, 4, 2.0)[0], ref_d, rtol=2e-6)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(p=0.5), ValueError, "`p` must be >= 1"),
        (dict(p=float("nan")), ValueError, "`p` must be >= 1"),
        # (The test run's type checker catches this one at the signature.)
        (dict(p=jnp.asarray(2.0)), TypeError, "`p` must be a Python number|'p'"),
        (dict(eps=-0.1), ValueError, "`eps` must be finite and >= 0"),
        (dict(eps=float("inf")), ValueError, "`eps` must be finite and >= 0"),
        (dict(eps=np.ones(2)), ValueError, "`eps` must be a real scalar"),
    ],
)
def test_bad_norm_arguments(kwargs, error, match):
    tree = kdeqx.KDTree(np.zeros((4, 2)))
    with pytest.raises(error, match=match):
        tree.query(np.zeros(2), 2, **kwargs)
    with pytest.raises(error, match=match):
        tree.count_ball_point(np.zeros(2), 1.0, **kwargs)


def test_bad_ranks():
    tree = kdeqx.KDTree(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="at least one rank"):
        tree.query(np.zeros(2), [])
    with pytest.raises(ValueError, match="`k` must be >= 1"):
        tree.query(np.zeros(2), [1, 0])
