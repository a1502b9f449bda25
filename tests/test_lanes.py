"""Batches larger than one set of lanes: lanes that finish take the next query.

Below `LANES` queries every query has its own lane; above it, the engine hands queries
out along a Morton curve and writes each answer back to its row. These tests use
`LANES + LANES // 2 + 7` queries, so lanes are refilled, go idle at different times,
and the last set of queries is partial.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx
from kdeqx import _backend
from kdeqx._backend import CPU_LANES as LANES
from kdeqx._engine import _traverse
from kdeqx._engine._metric import Minkowski

from .helpers import assert_knn_correct, clustered, DTYPES, lattice, lattice_queries


Q = LANES + LANES // 2 + 7


@eqx.filter_jit
def _all_kinds(tree, x, bound, r, k):
    return (
        tree.query(x, k, distance_upper_bound=bound),
        tree.count_ball_point(x, r),
        tree.query_ball_point(x, r, max_neighbors=4 * k, raise_on_overflow=False),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_queries_match_references(dtype):
    rng = np.random.default_rng(0)
    points = clustered(rng, 3000, 3).astype(dtype)
    # Queries in and far outside the clusters, in no spatial order.
    x = rng.uniform(-0.5, 1.5, (Q, 3)).astype(dtype)
    x[::5] = points[: len(x[::5])]
    # Per-query bounds: none, tight, and zero (a query that visits no leaf at all).
    bound = rng.choice([np.inf, 0.05, 0.0], Q).astype(dtype)
    r = rng.uniform(0, 0.05, Q).astype(dtype)
    k = 5
    (distances, indices), counts, (_, ball, ball_counts) = _all_kinds(
        kdeqx.KDTree(points), x, bound, r, k
    )
    for ub in np.unique(bound):
        rows = bound == ub
        assert_knn_correct(
            points,
            x[rows],
            k,
            distances[rows],
            indices[rows],
            exact_ties=dtype == np.float64,
            ub=float(ub),
        )
    reference = cKDTree(points.astype(np.float64))
    x64, r64 = x.astype(np.float64), r.astype(np.float64)
    expected = reference.query_ball_point(x64, r64, return_length=True)
    # float32 rounding may move a point across the sphere: compare where it cannot.
    if dtype == np.float64:
        np.testing.assert_array_equal(counts, expected)
        np.testing.assert_array_equal(ball_counts, expected)
        lists = reference.query_ball_point(x64, r64, return_sorted=True)
        for row, want in zip(np.asarray(ball), lists):
            if len(want) <= 4 * k:  # not truncated
                assert set(row[row < len(points)]) == set(want)
    else:
        # A count may differ only by points within float32 rounding of the sphere.
        inner = reference.query_ball_point(x64, r64 * (1 - 1e-5), return_length=True)
        outer = reference.query_ball_point(x64, r64 * (1 + 1e-5), return_length=True)
        for found in (np.asarray(counts), np.asarray(ball_counts)):
            assert ((inner <= found) & (found <= outer)).all()
        assert np.mean(np.asarray(counts) == expected) > 0.99


def test_many_queries_on_a_lattice_order_ties_by_index():
    rng = np.random.default_rng(1)
    points = lattice(rng, 2000, 3).astype(np.float32)
    x = lattice_queries(rng, Q, 3).astype(np.float32)
    distances, indices = kdeqx.KDTree(points).query(x, 12)
    assert_knn_correct(points, x, 12, distances, indices, exact_ties=True)


@pytest.mark.x64
def test_many_queries_in_a_periodic_box():
    rng = np.random.default_rng(2)
    points = rng.random((2000, 2))
    x = rng.uniform(-1, 2, (Q, 2))
    distances, indices = kdeqx.KDTree(points, box=1.0).query(x, 4)
    ref_d, ref_i = cKDTree(points, boxsize=1.0).query(np.mod(x, 1.0), 4)
    np.testing.assert_allclose(distances, ref_d, rtol=1e-12)
    np.testing.assert_array_equal(indices, ref_i)


def test_many_queries_over_a_batch_of_trees():
    rng = np.random.default_rng(3)
    points = rng.random((2, 500, 3)).astype(np.float32)
    x = rng.random((2, Q, 3)).astype(np.float32)
    trees = jax.vmap(kdeqx.KDTree)(points)
    distances, indices = jax.vmap(lambda t, xi: t.query(xi, 3))(trees, x)
    for b in range(2):
        ref_d, _ = cKDTree(points[b]).query(x[b], 3)
        np.testing.assert_allclose(distances[b], ref_d, rtol=1e-5)


def test_many_queries_with_gradients():
    rng = np.random.default_rng(4)
    points = jnp.asarray(rng.random((800, 3)))
    x = jnp.asarray(rng.random((Q, 3)))
    tree = kdeqx.KDTree(points)

    def loss(x):
        return jnp.sum(tree.query(x, 2)[0])

    grad = jax.grad(loss)(x)
    _, indices = tree.query(x, 2)
    diff = x[:, None, :] - points[indices]
    expected = jnp.sum(diff / jnp.linalg.norm(diff, axis=-1, keepdims=True), axis=1)
    np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cap", [1, 3])
def test_answers_do_not_depend_on_the_step_cap(monkeypatch, cap):
    """A cap of one or a few steps between leaf visits leaves lanes short of their next
    leaf at most visits, which they then skip: the same answers, reached later."""
    rng = np.random.default_rng(5)
    points = clustered(rng, 2000, 3).astype(np.float32)
    x = rng.uniform(-0.5, 1.5, (Q, 3)).astype(np.float32)
    bound = rng.choice([np.inf, 0.05], Q).astype(np.float32)
    r = rng.uniform(0, 0.05, Q).astype(np.float32)
    tree = kdeqx.KDTree(points)
    expected = _all_kinds(tree, x, bound, r, 5)
    assert _backend.step_cap() == _backend.CPU_STEPS  # the suite runs on the CPU
    monkeypatch.setattr(_backend._lanes, "CPU_STEPS", cap)  # read when a walk is traced
    eqx.clear_caches()
    jax.clear_caches()
    try:
        got = _all_kinds(tree, x, bound, r, 5)
    finally:  # no later test may reuse a program traced with the changed cap
        eqx.clear_caches()
        jax.clear_caches()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)


class _CountPoints(_traverse.AbstractVisitor):
    """Counts how often each point is visited; prunes nothing."""

    n: int = eqx.field(static=True)

    def init(self):
        return jnp.zeros(self.n + 1, jnp.int32)

    def should_visit(self, state, box_d2, min_index):
        return jnp.ones((), bool)

    def visit_leaf(self, state, d2, indices):
        return state.at[indices].add(1)


@pytest.mark.parametrize("n", [1, 32, 33, 1000])
@pytest.mark.parametrize("queries", [5, Q])
@pytest.mark.parametrize("d", [2, 8])
@pytest.mark.parametrize("away", [0.0, 50.0])
def test_walks_visit_every_point_once(n, queries, d, away):
    """A walk that prunes nothing visits every point exactly once, whichever leaf
    it starts at: it misses no subtree and repeats none (with one set of lanes and
    with refilled lanes, in trees of one leaf, of padded leaves and of several
    levels; among the points and far from them)."""
    rng = np.random.default_rng(n + d)
    points = clustered(rng, n, d).astype(np.float32)
    x = rng.uniform(-0.5, 1.5, (queries, d)).astype(np.float32) + away
    tree = kdeqx.KDTree(points)
    counts, _ = eqx.filter_jit(_traverse.walk_many)(
        tree, x, _CountPoints(n), Minkowski(2.0), None
    )
    np.testing.assert_array_equal(counts[:, :n], 1)
