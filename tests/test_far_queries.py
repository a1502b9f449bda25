"""Queries far from the data, and radii or bounds far larger than it.

Squared distances of float32 differences beyond ~1e19 overflow. The search clamps
far queries (from there every point is at the same float distance) and reports their
true distance; radii whose square overflows must still exclude the leaf padding. The
reference is scipy's cKDTree in float64 on the same (rounded) coordinates.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx

from .helpers import DTYPES


N = 100
# Along the first axis from the data (which lies in [0, 1]^3 times `spread`): far in
# every dtype, beyond the float32 clamp, near, and on the data.
OFFSETS = [1e20, 3e19, 1e10, 2.0, 0.5]


def _problem(dtype, spread):
    rng = np.random.default_rng(0)
    points = (rng.random((N, 3)) * spread).astype(dtype)
    x = np.zeros((len(OFFSETS) + 2, 3))
    x[: len(OFFSETS), 0] = OFFSETS
    x[: len(OFFSETS), 1] = 0.3 * spread
    x[-2] = [-3e38, 0, 0]  # as far as float32 goes
    x[-1] = points[7]  # on a data point
    return points, x.astype(dtype)


def _reference(points, x):
    return cKDTree(points.astype(float)), x.astype(float)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [1.0, 1e-30, 1e30])
def test_far_queries_find_real_neighbours_at_their_distance(dtype, spread):
    points, x = _problem(dtype, spread)
    distances, indices = kdeqx.KDTree(points).query(x, 4)
    reference, xr = _reference(points, x)
    expected, _ = reference.query(xr, 4)
    assert np.all(np.asarray(indices) < N)  # never the "missing" sentinel
    rtol = 4 * np.finfo(dtype).eps
    np.testing.assert_allclose(distances, expected, rtol=rtol)
    # The distances reported are those of the rows returned.
    rows = points.astype(float)[np.asarray(indices)]
    own = np.linalg.norm(xr[:, None] - rows, axis=-1)
    np.testing.assert_allclose(distances, own, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [1.0, 1e-30])
def test_bounds_and_radii_apply_to_far_queries(dtype, spread):
    points, x = _problem(dtype, spread)
    tree = kdeqx.KDTree(points)
    reference, xr = _reference(points, x)
    nearest, _ = reference.query(xr, 1)
    for factor in (0.5, 2.0):  # each query's bound or radius: half or twice its nearest
        limit = np.minimum(nearest * factor, np.finfo(dtype).max).astype(dtype)
        limit[-1] = 1.0  # the query on a data point
        counts = tree.count_ball_point(x, limit)
        expected = reference.query_ball_point(
            xr, limit.astype(float), return_length=True
        )
        np.testing.assert_array_equal(counts, expected)
        _, indices, ball_counts = tree.query_ball_point(x, limit, 4)
        np.testing.assert_array_equal(ball_counts, expected)
        np.testing.assert_array_equal(
            np.asarray(indices) < N, np.arange(4) < expected[:, None]
        )
        _, indices = tree.query(x, 2, distance_upper_bound=limit)
        two_nearest, _ = reference.query(xr, 2)
        found = two_nearest < limit[:, None]
        np.testing.assert_array_equal(np.asarray(indices) < N, found)


@pytest.mark.parametrize("dtype", DTYPES)
def test_radii_whose_square_overflows_count_no_padding(dtype):
    # Scaled squares of these radii overflow: the leaf padding must stay outside.
    points, x = _problem(dtype, 1.0)
    x = np.concatenate([x[2:5], x[-1:]])  # within 1e10 of the data: all points inside
    tree = kdeqx.KDTree(points)
    for r in (1e20, 1e30, float(np.finfo(dtype).max)):
        counts = tree.count_ball_point(x, r)
        np.testing.assert_array_equal(counts, np.full(len(x), N))
        distances, indices, ball_counts = tree.query_ball_point(x, r, N + 5)
        np.testing.assert_array_equal(ball_counts, np.full(len(x), N))
        np.testing.assert_array_equal(
            np.sort(indices[:, :N], axis=1), np.tile(np.arange(N), (len(x), 1))
        )
        assert np.all(np.asarray(indices[:, N:]) == N)
        assert np.all(np.isinf(distances[:, N:]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_of_far_queries_are_unit_vectors(dtype):
    points, x = _problem(dtype, 1.0)
    tree = kdeqx.KDTree(points)
    grad = jax.grad(lambda x: tree.query(x, 1)[0].sum())(jnp.asarray(x[:2]))
    np.testing.assert_allclose(grad, [[1, 0, 0], [1, 0, 0]], atol=1e-6)
    field = jax.grad(lambda x: tree.interpolate(x, points[:, 0], k=4).sum())(
        jnp.asarray(x[:2])
    )
    assert np.all(np.isfinite(field))


def _near_the_largest_number(dtype, box=None):
    """Points and queries up to half the dtype's largest number (beyond
    `2**126` in float32, where the exact search scale would be subnormal)."""
    rng = np.random.default_rng(1)
    spread = np.finfo(dtype).max / 2
    points = (rng.random((N, 3)) * spread).astype(dtype)
    x = (rng.random((9, 3)) * spread).astype(dtype)
    return points, x, spread


@pytest.mark.parametrize("dtype", DTYPES)
def test_coordinates_near_the_largest_number(dtype):
    points, x, spread = _near_the_largest_number(dtype)
    tree = kdeqx.KDTree(points)
    # scipy's squared float64 distances overflow here too: it searches the data
    # scaled by an exact power of two.
    unit = 2.0 ** np.frexp(spread)[1]
    reference, xr = _reference(points / unit, x / unit)
    distances, indices = tree.query(x, 4)
    expected, expected_indices = reference.query(xr, 4)
    np.testing.assert_array_equal(indices, expected_indices)
    rtol = 4 * np.finfo(dtype).eps
    np.testing.assert_allclose(distances, expected * unit, rtol=rtol)
    r = dtype(0.3 * spread)
    expected_counts = reference.query_ball_point(xr, r / unit, return_length=True)
    np.testing.assert_array_equal(tree.count_ball_point(x, r), expected_counts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_radii_the_compiler_knows(dtype):
    # A radius given as a constant inside `jit`: XLA squared `r * scale` as
    # `r**2 * scale**2`, `inf * 0` once `r**2` overflowed, and found nothing.
    spread = 1e20 if dtype == np.float32 else 1e200
    points, x = _problem(dtype, spread)
    tree = kdeqx.KDTree(points)
    r = 0.3 * spread

    @jax.jit
    def searches(tree, x):
        counts = tree.count_ball_point(x, r)
        _, bounded = tree.query(x, 3, distance_upper_bound=r)
        return counts, bounded, tree.query_pairs(r, N * N)[2]

    unit = 2.0 ** np.frexp(spread)[1]  # scipy's squares of 1e200 overflow
    reference, xr = _reference(points / unit, x / unit)
    expected = reference.query_ball_point(xr, r / unit, return_length=True)
    counts, bounded, pairs = searches(tree, jnp.asarray(x))
    np.testing.assert_array_equal(counts, expected)
    np.testing.assert_array_equal(
        np.sum(np.asarray(bounded) < N, axis=1), np.minimum(expected, 3)
    )
    assert int(pairs) == len(reference.query_pairs(r / unit))
