"""Property tests (hypothesis) against brute force: hostile data of every kind.

Shapes come from small fixed menus so compiled programs are reused across examples.
`KDEQX_HYPOTHESIS_PROFILE=long` runs many more examples than CI does.
"""

import functools as ft

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given

import kdeqx

from .helpers import assert_knn_correct


# Drawn data sets are float32 or float64: x64 on, as for float64 tests.
pytestmark = pytest.mark.x64


KINDS = ["uniform", "duplicates", "lattice", "line", "plane", "identical"]
# Every property holds on either engine: each example searches with one of them.
ENGINES = st.sampled_from(["walk", "blocks"])
SCALES = ["unit", "tiny", "huge", "offset"]
Q = 12


def _make_points(rng, kind, n, d):
    if kind == "uniform":
        return rng.random((n, d))
    if kind == "duplicates":
        distinct = rng.random((max(1, n // 4), d))
        return distinct[rng.integers(0, len(distinct), n)]
    if kind == "lattice":
        return rng.integers(0, 4, (n, d)).astype(float)
    if kind == "line":
        return rng.random((n, 1)) * rng.standard_normal(d) + 0.5
    if kind == "plane":
        basis = rng.standard_normal((2, d))
        return rng.random((n, 2)) @ basis + 0.5
    return np.broadcast_to(rng.random(d), (n, d)).copy()  # identical


def _rescale(points, scale):
    """Extreme but representable coordinates (the tree scales internally)."""
    return {
        "unit": points,
        "tiny": points * 1e-30,
        "huge": points * 1e30,
        "offset": points * 0.01 + 1e6,
    }[scale]


@st.composite
def problems(draw, sizes=(1, 5, 40, 150), dims=(1, 2, 3), scales=tuple(SCALES)):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = draw(st.sampled_from(sizes))
    d = draw(st.sampled_from(dims))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    kind = draw(st.sampled_from(KINDS))
    scale = draw(st.sampled_from(scales))
    points = _make_points(rng, kind, n, d)
    span = np.ptp(points, axis=0) + 0.5
    x = points.min(0) - 0.25 + rng.random((Q, d)) * span
    on_data = rng.integers(0, n, Q // 3)
    x[: len(on_data)] = points[on_data]  # queries exactly on data points
    points = _rescale(points, scale).astype(dtype)
    x = _rescale(x, scale).astype(dtype)
    return points, x, kind, scale


def _exact_ties_expected(points, kind, scale):
    """When all squared distances are computed exactly, indices must match exactly."""
    if scale != "unit":
        return False
    if points.dtype == np.float64:
        return True
    return kind in ("lattice", "identical")


@eqx.filter_jit
def _query(tree, x, k, bound):
    return tree.query(x, k, distance_upper_bound=bound)


@given(problems(), st.sampled_from([1, 3, 10]), st.booleans(), ENGINES)
def test_knn_agrees_with_brute_force(problem, k, bounded, engine):
    points, x, kind, scale = problem
    tree = kdeqx.KDTree(points, engine=engine)
    d = np.linalg.norm(x[:, None].astype(float) - points[None].astype(float), axis=-1)
    # The search squares differences in the tree's scaled coordinates: below about
    # `sqrt(tiny)` there (documented), they count as 0. Data of no extent at the
    # origin with tiny queries reach that.
    resolution = np.sqrt(np.finfo(points.dtype).tiny) / float(tree.scale)
    assume(not np.any((d > 0) & (d < 4 * resolution)))
    bound = np.inf
    if bounded:
        bound = float(np.median(d))
        assume(bound > 0)
        relative_gap = np.abs(d / bound - 1)
        assume(relative_gap.min() > 1e-4)  # no distance on the bound itself
    distances, indices = _query(tree, x, k, np.asarray(bound, points.dtype))
    exact = _exact_ties_expected(points, kind, scale)
    assert_knn_correct(points, x, k, distances, indices, exact_ties=exact, ub=bound)


def _radii_between_distances(d):
    """Per query, a radius halfway between two consecutive distinct distances near the
    30% quantile, so that no point lies on the sphere, where float32 and float64 could
    disagree on its side. (The quantile itself lands on a point for most duplicate,
    lattice and identical data: examples were then mostly thrown away.)"""
    radii = []
    for row in d:
        levels = np.unique(row)
        j = int(0.3 * (len(levels) - 1))
        upper = levels[j + 1] if j + 1 < len(levels) else 2 * levels[j]
        radii.append((levels[j] + upper) / 2 if upper > 0 else 1.0)
    return np.array(radii)


@given(problems(), ENGINES)
def test_radius_count_agrees_with_brute_force(problem, engine):
    points, x, _, _ = problem
    d = np.linalg.norm(x[:, None].astype(float) - points[None].astype(float), axis=-1)
    r = _radii_between_distances(d)
    with np.errstate(over="ignore"):  # a tiny r makes huge relative gaps: fine
        gaps = np.abs(d - r[:, None]) / np.maximum(r[:, None], np.finfo(float).tiny)
    assume(gaps.min() > 1e-4)
    tree = kdeqx.KDTree(points, engine=engine)
    counts = tree.count_ball_point(x, r.astype(points.dtype))
    np.testing.assert_array_equal(counts, (d <= r[:, None]).sum(1))


@given(problems(scales=("unit",)), st.sampled_from([1, 4]), ENGINES)
def test_periodic_knn_agrees_with_minimum_image_brute_force(problem, k, engine):
    points, x, _, _ = problem
    lengths = np.ptp(points, axis=0).astype(float) + 1.0
    box = lengths.astype(points.dtype)
    distances, _ = kdeqx.KDTree(points, box=box, engine=engine).query(x, k)
    diff = x[:, None].astype(float) - points[None].astype(float)
    diff -= lengths * np.round(diff / lengths)
    reference = np.sort(np.linalg.norm(diff, axis=-1), axis=1)[:, :k]
    reference = np.pad(
        reference,
        ((0, 0), (0, k - reference.shape[1])),
        "constant",
        constant_values=np.inf,
    )
    rtol = 1e-5 if points.dtype == np.float32 else 1e-10
    np.testing.assert_allclose(distances, reference, rtol=rtol, atol=1e-6)


@given(problems(), st.sampled_from([1, 4]), ENGINES)
def test_permuting_points_permutes_indices(problem, k, engine):
    points, x, _, _ = problem
    perm = np.random.default_rng(len(points)).permutation(len(points))
    tree = kdeqx.KDTree(points, engine=engine)
    distances, indices = _query(tree, x, k, np.inf)
    permuted = kdeqx.KDTree(points[perm], engine=engine)
    distances_p, indices_p = _query(permuted, x, k, np.inf)
    np.testing.assert_array_equal(distances, distances_p)
    n = len(points)
    mapped = np.where(np.asarray(indices_p) < n, perm[np.minimum(indices_p, n - 1)], n)
    # Where a distance (nearly) ties with another point's, lower-index order may differ
    # (near-ties included: float32 rounding may order them either way).
    exact = np.linalg.norm(
        x[:, None].astype(float) - points[None].astype(float), axis=-1
    )
    rtol = 1e-5 if points.dtype == np.float32 else 1e-12
    for row in range(len(x)):
        for j in range(k):
            if indices[row, j] >= n:
                continue
            mine = exact[row, indices[row, j]]
            close = np.abs(exact[row] - mine) <= rtol * max(mine, np.finfo(float).tiny)
            if close.sum() == 1:
                assert mapped[row, j] == indices[row, j]


@ft.partial(jax.jit, static_argnames=("box", "engine"))
def _gradients(points, x, values, box=None, engine="walk"):
    def loss(points, x, values):
        tree = kdeqx.KDTree(points, box=box, engine=engine)
        distances, _ = tree.query(x, 3)
        counts_free = tree.interpolate(x, values, k=3)
        # A length scale of the data's size: the tree's `scale` brings the
        # coordinates near one.
        length = 0.3 / jax.lax.stop_gradient(tree.scale)
        smooth = tree.interpolate(
            x, values, k=3, kernel="gaussian", length_scale=length
        )
        fit = tree.interpolate(x, values, k=6, kernel="mls")
        finite = jnp.where(jnp.isfinite(distances), distances, 0)
        return finite.sum() + counts_free.sum() + smooth.sum() + fit.sum()

    return jax.grad(loss, argnums=(0, 1, 2))(points, x, values)


# One size and dimension: every example reuses the same eight compiled gradients.
@given(problems(sizes=(40,), dims=(2,)), ENGINES)
def test_no_nan_gradients_anywhere(problem, engine):
    points, x, kind, scale = problem
    values = np.linspace(-1, 1, len(points)).astype(points.dtype)
    # A periodic box of side one holds the data at unit scale.
    for box in (None, 1.0) if scale == "unit" else (None,):
        for g in _gradients(points, x, values, box=box, engine=engine):
            assert np.isfinite(g).all(), (kind, scale, box)


def _minkowski(diff, p):
    diff = np.abs(diff)
    return diff.max(-1) if p == np.inf else (diff**p).sum(-1) ** (1 / p)


@eqx.filter_jit
def _pairs_and_counts(tree, other, r, p):
    radii = jnp.stack([r / 2, r])
    return tree.query_pairs(r, 800, p=p), tree.count_neighbors(other, radii, p=p)


@given(problems(sizes=(40,), dims=(3,)), st.sampled_from([1.0, np.inf]), ENGINES)
def test_pairs_and_pair_counts_agree_with_brute_force(problem, p, engine):
    points, x, _, _ = problem
    within = _minkowski(points[:, None].astype(float) - points[None].astype(float), p)
    between = _minkowski(points[:, None].astype(float) - x[None].astype(float), p)
    r = _radii_between_distances(within.reshape(1, -1))[0]
    every = np.concatenate([within.ravel(), between.ravel()])
    for radius in (r / 2, r):
        gaps = np.abs(every - radius) / max(radius, np.finfo(float).tiny)
        assume(gaps.min() > 1e-4)  # no distance on a sphere: float32 may disagree
    trees = (kdeqx.KDTree(a, engine=engine) for a in (points, x))
    (pairs, _, count), counts = _pairs_and_counts(
        *trees, np.asarray(r, points.dtype), p
    )
    i, j = np.nonzero(np.triu(within <= r, k=1))
    assert kdeqx.pair_set(pairs, count) == set(zip(i.tolist(), j.tolist()))
    np.testing.assert_array_equal(
        counts, [(between <= r / 2).sum(), (between <= r).sum()]
    )


@eqx.filter_jit
def _graphs(points, r, batch, cell, engine):
    directed = kdeqx.radius_graph(points, r, 1600, batch=batch, engine=engine)
    half = kdeqx.radius_graph(
        points, r, 800, half=True, cell=cell, images=1, engine=engine
    )
    return directed, half


@given(problems(sizes=(40,), dims=(3,)), ENGINES)
def test_radius_graphs_agree_with_brute_force(problem, engine):
    """Directed graphs of segments in free space, and half lists in a periodic box
    around the data (cutoff below half its side, so one image a pair)."""
    points, x, _, _ = problem
    diff = points[:, None].astype(float) - points[None].astype(float)
    within = _minkowski(diff, 2.0)
    r = _radii_between_distances(within.reshape(1, -1))[0]
    side = 2.5 * max(np.ptp(points.astype(float)), r, np.finfo(points.dtype).tiny)
    offsets = np.round(diff / side)  # minimum images
    periodic = _minkowski(diff - side * offsets, 2.0)
    for distances in (within, periodic):
        gaps = np.abs(distances - r) / max(r, np.finfo(float).tiny)
        assume(gaps.min() > 1e-4)  # no distance on the sphere: float32 may disagree
    batch = np.random.default_rng(int(points.size)).integers(0, 3, 40)
    cell = np.full(3, side, points.dtype)
    directed, half = _graphs(points, np.asarray(r, points.dtype), batch, cell, engine)
    i, j = np.nonzero((within <= r) & (batch[:, None] == batch[None]))
    keep = i != j
    expected = list(zip(i[keep].tolist(), j[keep].tolist()))
    real = np.asarray(directed.senders) < 40
    got = list(
        zip(
            *(
                np.asarray(a)[real].tolist()
                for a in (directed.senders, directed.receivers)
            )
        )
    )
    assert got == expected and int(directed.count) == len(expected)
    i, j = np.nonzero(np.triu(periodic <= r, k=1))
    # x_j - x_i + S * side is the minimum image: S = -round((x_j - x_i) / side).
    shifts = (-offsets[j, i]).astype(int)
    expected = sorted(zip(i.tolist(), j.tolist(), map(tuple, shifts.tolist())))
    real = np.asarray(half.senders) < 40
    got = list(
        zip(
            np.asarray(half.senders)[real].tolist(),
            np.asarray(half.receivers)[real].tolist(),
            map(tuple, np.asarray(half.shifts)[real].tolist()),
        )
    )
    assert got == expected


@eqx.filter_jit
def _knn_graph(points, k, batch, engine):
    return kdeqx.knn_graph(points, k, batch=batch, engine=engine)


@given(problems(sizes=(5, 40), dims=(3,)), st.sampled_from([1, 3]), ENGINES)
def test_knn_graphs_agree_with_brute_force(problem, k, engine):
    """Each point's `k` nearest others of its segment (fewer in a small segment),
    over a tree of one leaf (5 points) and of several (40)."""
    points, _, kind, scale = problem
    n = len(points)
    batch = np.random.default_rng(n).integers(0, 2, n)
    graph = _knn_graph(points, k, batch, engine)
    senders, receivers, distances = (
        np.asarray(a) for a in (graph.senders, graph.receivers, graph.distances)
    )
    p = points.astype(float)
    others = (batch[:, None] == batch[None]) & ~np.eye(n, dtype=bool)
    d = np.where(others, np.linalg.norm(p[:, None] - p[None], axis=-1), np.inf)
    rtol = 2e-5 if points.dtype == np.float32 else 1e-12
    exact = _exact_ties_expected(points, kind, scale)
    for i in range(n):
        mine = senders == i
        nearest = np.lexsort((np.arange(n), d[i]))[: min(k, others[i].sum())]
        assert mine.sum() == len(nearest)
        assert len(set(receivers[mine].tolist())) == len(nearest)  # none twice
        np.testing.assert_allclose(np.sort(distances[mine]), d[i, nearest], rtol=rtol)
        np.testing.assert_allclose(distances[mine], d[i, receivers[mine]], rtol=rtol)
        if exact:
            assert set(receivers[mine].tolist()) == set(nearest.tolist())
