"""The block engine beyond kNN and radius queries: `count_neighbors`, the local fits
and `knn_graph`, against scipy and the walk."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx

from .helpers import DATASETS


@pytest.mark.parametrize("dataset", ["uniform", "clustered"])
def test_count_neighbors_matches_scipy(dataset):
    rng = np.random.default_rng(11)
    points = DATASETS[dataset](rng, 1500, 3).astype(np.float32)
    others = rng.random((700, 3)).astype(np.float32)
    radii = np.array([0.0, 0.02, 0.05, 0.1, 0.3])
    reference = cKDTree(points.astype(np.float64))
    other_reference = cKDTree(others.astype(np.float64))
    tree = kdeqx.KDTree(points, engine="blocks")
    other = kdeqx.KDTree(others, engine="blocks")
    np.testing.assert_array_equal(
        tree.count_neighbors(other, radii),
        reference.count_neighbors(other_reference, radii),
    )
    np.testing.assert_array_equal(
        tree.count_neighbors(tree, radii, cumulative=False),
        reference.count_neighbors(reference, radii, cumulative=False),
    )
    weights = rng.random(len(points)).astype(np.float32)
    np.testing.assert_allclose(
        tree.count_neighbors(tree, radii, weights=weights),
        reference.count_neighbors(reference, radii, weights=weights.astype(np.float64)),
        rtol=1e-5,
    )


def test_periodic_count_neighbors_matches_scipy():
    rng = np.random.default_rng(12)
    points = rng.random((900, 2)).astype(np.float32)
    radii = np.array([0.05, 0.2, 0.45])
    tree = kdeqx.KDTree(points, box=1.0, engine="blocks")
    reference = cKDTree(points.astype(np.float64), boxsize=1.0)
    np.testing.assert_array_equal(
        tree.count_neighbors(tree, radii, p=1),
        reference.count_neighbors(reference, radii, p=1),
    )


@pytest.mark.parametrize("kernel", ["rbf", "mls"])
def test_local_fits_equal_the_walk(kernel):
    rng = np.random.default_rng(13)
    points = rng.random((500, 2)).astype(np.float32)
    values = np.sin(3 * points[:, 0]) * np.cos(2 * points[:, 1])
    x = jnp.asarray(rng.random((60, 2)).astype(np.float32))
    answers, neighbours = [], []
    for engine in ("walk", "blocks"):
        tree = kdeqx.KDTree(points, engine=engine)
        neighbours.append(tree.query(x, k=12)[1])
        model = kdeqx.Interpolator(tree, values.astype(np.float32), k=12, kernel=kernel)
        value = eqx.filter_jit(lambda m, x: m(x))(model, x)
        # The gradient of one kernel: the other's goes through the same search.
        grad = (
            eqx.filter_jit(jax.grad(lambda x, m: m(x).sum()))(x, model)
            if kernel == "mls"
            else value
        )
        answers.append((value, grad))
    # The same neighbours, so the same fits, up to float32 solves compiled apart.
    np.testing.assert_array_equal(neighbours[0], neighbours[1])
    np.testing.assert_allclose(answers[0][0], answers[1][0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(answers[0][1], answers[1][1], rtol=1e-3, atol=1e-3)


def _same_graph(a, b):
    for name in ("senders", "receivers", "shifts", "count", "overflow"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.distances, b.distances, rtol=1e-6)


@pytest.mark.parametrize("case", ["free, batch", "a cell per system"])
def test_knn_graph_on_blocks_equals_the_walk(case):
    rng = np.random.default_rng(14)
    n, k = 400, 6
    kwargs = {}
    points = rng.random((n, 3)).astype(np.float32)
    if case == "free, batch":
        kwargs["batch"] = np.sort(rng.integers(0, 5, n))
    else:  # triclinic and orthorhombic cells
        ids = np.sort(rng.integers(0, 3, n))
        cells = np.stack([np.eye(3) * 3, np.eye(3) * 4, np.eye(3) * 3.5])
        cells[1, 1, 0] = 0.8
        cells = cells.astype(np.float32)
        points = np.einsum("ni,nij->nj", points, cells[ids])
        kwargs.update(cell=cells, batch=ids)
    walk = kdeqx.knn_graph(points, k, engine="walk", **kwargs)
    blocks = kdeqx.knn_graph(points, k, engine="blocks", **kwargs)
    _same_graph(walk, blocks)
    # and each point's k nearest, as the graph says, against scipy in free space
    if case == "free, batch":
        for segment in np.unique(kwargs["batch"]):
            rows = np.flatnonzero(kwargs["batch"] == segment)
            _, want = cKDTree(points[rows]).query(points[rows], k + 1)
            got = np.asarray(blocks.receivers).reshape(n, k)[rows]
            assert [set(r) for r in got] == [set(rows[w[1:]]) for w in want]
