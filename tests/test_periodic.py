import jax
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx

from .helpers import DTYPES


BOXES = {"cube": 1.0, "mixed": np.array([1.0, 2.0, 0.0])}


def _data(rng, box, n):
    lengths = np.broadcast_to(np.asarray(box, float), (3,))
    extent = np.where(lengths > 0, lengths, 1.0)
    return rng.random((n, 3)) * extent, np.where(lengths > 0, lengths, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("box", list(BOXES))
def test_knn_matches_scipy_boxsize(box, dtype):
    rng = np.random.default_rng(0)
    points, scipy_box = _data(rng, BOXES[box], 600)
    x, _ = _data(rng, BOXES[box], 80)
    points, x = points.astype(dtype), x.astype(dtype)
    distances, indices = kdeqx.KDTree(points, box=BOXES[box]).query(x, 6)
    ref_d, ref_i = cKDTree(points, boxsize=scipy_box).query(x, 6)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(distances, ref_d, rtol=rtol, atol=1e-6)
    if dtype == np.float64:
        np.testing.assert_array_equal(indices, ref_i)


@pytest.mark.parametrize("box", list(BOXES))
def test_radius_matches_scipy_boxsize(box):
    rng = np.random.default_rng(1)
    points, scipy_box = _data(rng, BOXES[box], 600)
    x, _ = _data(rng, BOXES[box], 80)
    r = rng.random(80) * 0.3
    tree = kdeqx.KDTree(points, box=BOXES[box])
    reference = cKDTree(points, boxsize=scipy_box)
    np.testing.assert_array_equal(
        tree.count_ball_point(x, r),
        reference.query_ball_point(x, r, return_length=True),
    )
    _, indices, counts = tree.query_ball_point(x, r, 600)
    for q, expected in enumerate(reference.query_ball_point(x, r)):
        assert sorted(np.asarray(indices[q, : counts[q]]).tolist()) == sorted(expected)


@pytest.mark.x64
def test_wrap_around_neighbours_and_round_off_outside_the_box():
    points = np.array([[0.01, 0.5], [0.5, 0.5], [1.0 + 1e-12, 0.5], [-1e-12, 0.2]])
    tree = kdeqx.KDTree(points, box=1.0)
    distances, indices = tree.query(np.array([0.99, 0.5]), 2)
    np.testing.assert_array_equal(indices, [2, 0])  # across the boundary
    np.testing.assert_allclose(distances, [0.01, 0.02], atol=1e-9)


@pytest.mark.x64
def test_periodic_gradients_are_finite_and_match_finite_differences():
    rng = np.random.default_rng(2)
    points = rng.random((50, 2))
    x = np.array([[0.999, 0.001], [0.5, 0.5]])
    tree = kdeqx.KDTree(points, box=1.0)

    def loss(x):
        return tree.query(x, 3)[0].sum()

    grad = jax.grad(loss)(x)
    assert np.isfinite(grad).all()
    eps = 1e-7
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = eps
        numeric = (loss(x + step) - loss(x - step)) / (2 * eps)
        np.testing.assert_allclose(grad[i], numeric, rtol=1e-5)


def test_bad_box_shape():
    with pytest.raises(ValueError, match="`box` must be a scalar or have shape"):
        kdeqx.KDTree(np.zeros((4, 3)), box=np.ones(2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_boxes_near_the_largest_number(dtype):
    # A box longer than `2**126` (float32): XLA divides by it through its reciprocal,
    # a subnormal flushed to zero, so no distance took the periodic image.
    rng = np.random.default_rng(3)
    box = np.finfo(dtype).max / 2
    points = (rng.random((60, 2)) * box).astype(dtype)
    x = (rng.random((7, 2)) * box).astype(dtype)
    # A minimum image is a difference of numbers up to the box: rounding relative
    # to the box.
    rtol = 32 * np.finfo(dtype).eps
    tree = kdeqx.KDTree(points, box=box)
    # scipy fails this far out: it searches the data scaled by a power of two.
    unit = 2.0 ** np.frexp(box)[1]
    reference = cKDTree(points / unit, boxsize=float(box) / unit)
    expected, expected_indices = reference.query(x / unit, 3)
    expected = expected * unit

    @jax.jit
    def nearest(x):  # the tree is a constant here, its box too
        return tree.query(x, 3)

    for distances, indices in (tree.query(x, 3), nearest(x)):
        np.testing.assert_array_equal(indices, expected_indices)
        np.testing.assert_allclose(distances, expected, rtol=rtol)
    r = float(0.2 * box)
    queries = kdeqx.KDTree(x, box=box)
    found, count = queries.sparse_distance_matrix(tree, r, 7 * 60)
    expected_matrix = cKDTree(x / unit, boxsize=float(box) / unit)
    expected_matrix = expected_matrix.sparse_distance_matrix(reference, r / unit)
    expected_matrix = expected_matrix.toarray() * unit
    assert int(count) == np.count_nonzero(expected_matrix)
    np.testing.assert_allclose(found.todense(), expected_matrix, rtol=rtol)
