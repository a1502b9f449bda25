"""Eager calls pad to size buckets: nearby sizes compile once, and the padding never
shows in the answers."""

import contextlib

import jax
import jax.monitoring
import numpy as np
import pytest
import scipy.spatial

import kdeqx
from kdeqx._backend._buckets import bucket


_COMPILES: list[str] = []


def _count_compiles(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


@contextlib.contextmanager
def _compiles():
    """The number of XLA compiles in the block, as a one-element list."""
    before = len(_COMPILES)
    counted = [0]
    yield counted
    counted[0] = len(_COMPILES) - before


def test_buckets_are_few_for_small_sizes_and_tight_for_large_ones():
    assert [bucket(s) for s in range(14)] == [
        0,
        1,
        2,
        3,
        4,
        6,
        6,
        8,
        8,
        12,
        12,
        12,
        12,
        16,
    ]
    for size in range(1, 70_000, 7):
        rows = bucket(size)
        significant = rows >> ((rows & -rows).bit_length() - 1)  # odd part
        if size <= 4096:
            assert rows - size <= rows // 3 and significant in (1, 3)
        elif size <= 65536:
            assert rows - size <= rows // 8 and significant < 16
        else:
            assert rows == size
    assert bucket(100_000) == 100_000


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    points = rng.random((3000, 3)).astype(np.float32)
    return kdeqx.KDTree(points), points, rng


def _queries(rng, q):
    return rng.random((q, 3)).astype(np.float32)


_LOCAL_FITS = (
    lambda tree, x, v: tree.interpolate(x, v, k=8, kernel="rbf"),
    lambda tree, x, v: tree.interpolate(x, v, k=8, kernel="mls"),
)
# The local fits solve in float32, whose rounding depends on the batch's shape.
_LOCAL_FIT_RTOL = 1e-3


@pytest.mark.parametrize(
    "call",
    [
        lambda tree, x, v: tree.query(x, k=3),
        lambda tree, x, v: tree.query(x, k=2, distance_upper_bound=0.1 + x[:, 0]),
        lambda tree, x, v: tree.count_ball_point(x, 0.1),
        lambda tree, x, v: tree.query_ball_point(x, 0.05 + x[:, 1] / 10, 16),
        lambda tree, x, v: tree.interpolate(x, v, k=4),
        lambda tree, x, v: tree.interpolate(
            x, v, k=4, kernel="gaussian", length_scale=0.1
        ),
        *_LOCAL_FITS,
    ],
    ids=["query", "bound", "count", "ball", "idw", "gaussian", "rbf", "mls"],
)
def test_sizes_in_one_bucket_compile_once(data, call):
    tree, points, rng = data
    values = (points**2).sum(1)
    jax.block_until_ready(call(tree, _queries(rng, 100), values))
    x = _queries(rng, 117)
    # The reference: these queries under `jit`, where nothing is padded.
    exact = jax.jit(lambda x: call(tree, x, values))(x)
    for q in (101, 102, 103, 117):
        with _compiles() as counted:
            answer = call(tree, x[:q], values)
        assert counted[0] == 0, (q, counted[0])
        for got, want in zip(jax.tree.leaves(answer), jax.tree.leaves(exact)):
            want = want[:q]
            assert got.shape == want.shape and got.dtype == want.dtype
            if np.issubdtype(got.dtype, np.integer):
                np.testing.assert_array_equal(got, want)
            else:
                local_fit = call in _LOCAL_FITS
                np.testing.assert_allclose(
                    got, want, rtol=_LOCAL_FIT_RTOL if local_fit else 1e-6
                )


def test_padding_is_invisible_against_scipy(data):
    tree, points, rng = data
    reference = scipy.spatial.cKDTree(points.astype(np.float64))
    x = rng.random((7, 5, 3)).astype(np.float32)
    distances, indices = tree.query(x, k=4)
    assert distances.shape == indices.shape == (7, 5, 4)
    want_d, want_i = reference.query(x.astype(np.float64), k=4)
    np.testing.assert_array_equal(indices, want_i)
    np.testing.assert_allclose(distances, want_d, rtol=1e-6)
    counts = tree.count_ball_point(x, 0.1)
    assert counts.shape == (7, 5)
    np.testing.assert_array_equal(
        counts,
        reference.query_ball_point(x.astype(np.float64), 0.1, return_length=True),
    )
    single_d, single_i = tree.query(x[0, 0], k=4)
    assert single_d.shape == single_i.shape == (4,)
    np.testing.assert_array_equal(single_i, want_i[0, 0])


def test_errors_name_the_callers_queries(data):
    tree, _, rng = data
    x = _queries(rng, 5)
    x[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"first at index \(3, 1\)"):
        tree.query(x)
    with pytest.raises(ValueError, match=r"got shape \(5, 2\)"):
        tree.query(np.zeros((5, 2)))
    with pytest.raises(ValueError, match=r"batch shape \(5,\), got shape \(4,\)"):
        tree.query(_queries(rng, 5), distance_upper_bound=np.ones(4))
    with pytest.raises(ValueError, match=r"batch shape \(5,\), got shape \(1,\)"):
        tree.count_ball_point(_queries(rng, 5), np.ones(1))


def _tree_queries(tree, x):
    """kNN with missing neighbours (index `n`), counts and a ball query."""
    return (
        tree.query(x, k=5, distance_upper_bound=0.05),
        tree.count_ball_point(x, 0.1),
        tree.query_ball_point(x, 0.05, 16),
    )


def test_trees_whose_n_shares_a_bucket_share_the_build_and_queries(data):
    _, _, rng = data
    x = _queries(rng, 50)
    first = kdeqx.KDTree(rng.random((5000, 3)).astype(np.float32))
    jax.block_until_ready(_tree_queries(first, x))
    for n in (4990, 5001, 5100):
        points = rng.random((n, 3)).astype(np.float32)
        with _compiles() as counted:
            tree = kdeqx.KDTree(points)
            (distances, indices), counts, (_, ball, ball_counts) = _tree_queries(
                tree, x
            )
        assert counted[0] == 0, n
        reference = scipy.spatial.cKDTree(points.astype(np.float64))
        x64 = x.astype(np.float64)
        want_d, want_i = reference.query(x64, k=5, distance_upper_bound=0.05)
        assert (want_i == n).any()  # some missing neighbours: the sentinel is `n`
        np.testing.assert_array_equal(indices, want_i)
        np.testing.assert_allclose(distances, want_d, rtol=1e-6)
        np.testing.assert_array_equal(
            counts, reference.query_ball_point(x64, 0.1, return_length=True)
        )
        assert kdeqx.ball_lists(ball, ball_counts, sort=True) == [
            sorted(row) for row in reference.query_ball_point(x64, 0.05)
        ]
        assert np.all(np.asarray(ball)[np.arange(16) >= ball_counts[:, None]] == n)


def test_pad_to_bucket_shares_a_users_jitted_program(data):
    tree, points, rng = data
    nearest = jax.jit(lambda tree, x: tree.query(x, k=4))
    jax.block_until_ready(nearest(tree, kdeqx.pad_to_bucket(_queries(rng, 100))))
    reference = scipy.spatial.cKDTree(points.astype(np.float64))
    for q in (101, 117, 128):
        x = _queries(rng, q)
        with _compiles() as counted:
            padded = kdeqx.pad_to_bucket(x)
            _, indices = nearest(tree, padded)
        assert counted[0] == 0 and padded.shape == (128, 3)
        np.testing.assert_array_equal(
            indices[:q], reference.query(x.astype(np.float64), k=4)[1]
        )
    with pytest.raises(ValueError, match="at least one row"):
        kdeqx.pad_to_bucket(np.zeros((0, 3)))


def _same_graph(got, want):
    for name in ("senders", "receivers", "shifts", "count", "overflow"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), name)
    np.testing.assert_allclose(got.distances, want.distances, rtol=1e-6)


_CELL = np.array([[6.0, 0, 0], [1.0, 5.5, 0], [0.5, -0.7, 6.2]], np.float32)


def test_graphs_of_nearby_sizes_share_one_program():
    rng = np.random.default_rng(5)

    def crystal(n):
        return (rng.random((n, 3)) @ _CELL).astype(np.float32)

    jax.block_until_ready(kdeqx.radius_graph(crystal(178), 2.0, 9000, cell=_CELL))
    jax.block_until_ready(kdeqx.knn_graph(crystal(178), 5))
    for n in (146, 190):
        x = crystal(n)
        batch = np.repeat([0, 1], [n // 2, n - n // 2])
        with _compiles() as counted:
            graph = kdeqx.radius_graph(x, 2.0, 9000, cell=_CELL)
            nearest = kdeqx.knn_graph(x, 5)
        assert counted[0] == 0, n
        # As the unpadded graphs, under `jit`, where nothing is padded.
        _same_graph(
            graph,
            jax.jit(lambda x: kdeqx.radius_graph(x, 2.0, 9000, cell=_CELL, images=1))(
                x
            ),
        )
        _same_graph(nearest, jax.jit(lambda x: kdeqx.knn_graph(x, 5))(x))
        assert graph.batch is None and nearest.senders.shape == (n * 5,)
        if n != 146:
            continue
        in_segments = kdeqx.radius_graph(x, 2.0, 9000, cell=_CELL, batch=batch)
        np.testing.assert_array_equal(in_segments.batch, batch)
        _same_graph(
            in_segments,
            jax.jit(lambda x, b: kdeqx.radius_graph(x, 2.0, 9000, cell=_CELL, batch=b))(
                x, batch
            ),
        )


def test_padding_points_for_a_users_jit_adds_no_edge():
    rng = np.random.default_rng(6)
    x = (rng.random((100, 3)) @ _CELL).astype(np.float32)
    padded, ids = kdeqx.pad_points_to_bucket(x)
    assert padded.shape == (128, 3) and ids.shape == (128,)
    graph = jax.jit(lambda x, b: kdeqx.radius_graph(x, 2.0, 9000, cell=_CELL, batch=b))(
        padded, ids
    )
    want = kdeqx.radius_graph(x, 2.0, 9000, cell=_CELL)
    real = np.asarray(graph.senders) < 128
    np.testing.assert_array_equal(np.asarray(graph.senders)[real], want.senders[real])
    np.testing.assert_array_equal(graph.receivers[real], want.receivers[real])
    assert int(graph.count) == int(want.count) and np.all(graph.senders[real] < 100)
    with pytest.raises(TypeError, match="outside `jit`"):
        jax.jit(kdeqx.pad_points_to_bucket)(x)
