"""The block engine beyond kNN and radius queries: `count_neighbors`, the local fits,
`knn_graph`, `radius_graph`, `NeighborList` and the pair queries, against scipy,
brute force and the walk."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx
from kdeqx import _backend
from kdeqx._backend import _scatters
from kdeqx._engine import _traverse
from kdeqx._engine._traverse import ROW_SLOTS, Sink

from .helpers import DATASETS
from .test_graph import (
    CASES,
    check_graph,
    points_in_and_around,
    reference_radius_graph,
)


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


# Several images of a triclinic cell, directed; a slab's half list; a cell
# smaller than `r` with self loops: each a program of its own.
@pytest.mark.x64
@pytest.mark.parametrize(
    "case, variant",
    [
        ("triclinic, r beyond half the cell", "directed"),
        ("slab", "half"),
        ("triclinic, r beyond the cell", "self loops"),
    ],
)
def test_radius_graph_on_blocks_is_every_image_within_r(case, variant):
    config = dict(CASES[case])
    r, cell, pbc = config["r"], config["cell"], config.get("pbc", (True,) * 3)
    x = points_in_and_around(0, 40)
    options = dict(half=variant == "half", self_loops=variant == "self loops")
    graph = kdeqx.radius_graph(
        x, r, 20000, cell=cell, pbc=pbc, engine="blocks", **options
    )
    reference = reference_radius_graph(x, r, cell, pbc, **options)
    assert 10 < len(reference) <= 20000
    check_graph(graph, x, cell, reference, 20000)


def test_images_beyond_r_of_every_point_are_not_searched(monkeypatch):
    """In a periodic cell most images of most points lie beyond `r` of the whole
    box: the block engine searches only the others, and still finds every edge."""
    from kdeqx._graph import _graph

    searched = []
    image_queries = _graph._image_queries

    def recorded(*args):
        x, reach = image_queries(*args)
        jax.debug.callback(lambda r: searched.append(int((r >= 0).sum())), reach)
        return x, reach

    monkeypatch.setattr(_graph, "_image_queries", recorded)
    rng = np.random.default_rng(21)
    n, side, r = 800, 6.0, 0.9
    x = (rng.random((n, 3)) * side).astype(np.float32)
    cell = np.full(3, side, np.float32)
    graph = kdeqx.radius_graph(x, r, 40000, cell=cell, engine="blocks")
    reference = reference_radius_graph(x, r, cell, reach=1)
    check_graph(graph, x, cell, reference, 40000)
    # 27 images of each point; those within `r` of the box: about (1 + 2 r / side)^3
    # of a point's, here 2.2. The points are padded to their bucket, each padding
    # point a segment of its own, whose first image alone is searched.
    padding = kdeqx.bucket(n) - n
    assert len(searched) == 1, searched
    assert 2 * n < searched[0] - padding < 2.4 * n, searched


@pytest.mark.parametrize("offset", [0.0, 1e4, 3e6])
def test_only_images_surely_beyond_r_of_the_box_are_dropped(offset):
    """Exact at any magnitude: an image dropped has no point within `r` even in
    float32's rounding, however far the coordinates lie from the origin."""
    from kdeqx._graph._graph import _surely_beyond

    rng = np.random.default_rng(22)
    points = (offset + rng.random((300, 3)) * 2).astype(np.float32)
    lo, hi = points.min(axis=0), points.max(axis=0)
    r = np.float32(0.25)
    # Queries straight out from the box's faces: from the point on a face (its
    # nearest, at about the distance moved, at r within rounding) and from others.
    axis = rng.integers(0, 3, 4000)
    upper = rng.random(4000) < 0.5
    extreme = np.where(upper, points.argmax(axis=0)[axis], points.argmin(axis=0)[axis])
    others = points[rng.integers(0, 300, 4000)]
    start = np.where((np.arange(4000) % 2 == 0)[:, None], points[extreme], others)
    start[np.arange(4000), axis] = np.where(upper, hi[axis], lo[axis])
    length = rng.uniform(0.9, 1.1, 4000) * r
    x = start.astype(np.float64)
    x[np.arange(4000), axis] += np.where(upper, length, -length)
    x = x.astype(np.float32)
    dropped = _surely_beyond(jnp.asarray(x), jnp.asarray(lo), jnp.asarray(hi), r)
    dropped = np.asarray(dropped)
    for rounded in (np.float32, np.float64):
        gaps = x[:, None, :].astype(rounded) - points[None].astype(rounded)
        nearest = np.sqrt((gaps**2).sum(-1)).min(axis=1)
        within = nearest <= r
        assert within.sum() > 100 and not np.any(dropped & within), offset
    # And what lies beyond r by more than float32's spacing is dropped.
    box_gap = np.maximum(np.maximum(lo - x, x - hi), 0).astype(np.float64)
    spacing = np.spacing(np.float32(offset + 2))
    far = np.sqrt((box_gap**2).sum(-1)) > 1.01 * r + 8 * spacing
    if offset < 1e6:  # float32's spacing there is far below `r`
        assert far.sum() > 1000 and np.all(dropped[far])


def test_radius_graph_and_neighbor_list_on_blocks_equal_the_walk():
    """A cell per system (triclinic and orthorhombic, one not periodic along an
    axis), as one graph, a capacity that overflows, and a neighbour list followed
    through steps that rebuild it: the walk's edges, shifts and counts."""
    rng = np.random.default_rng(15)
    n = 300
    ids = np.sort(rng.integers(0, 3, n))
    cells = np.stack([np.eye(3) * 3, np.eye(3) * 4, np.eye(3) * 3.5])
    cells[1, 1, 0] = 0.8
    cells = cells.astype(np.float32)
    points = np.einsum("ni,nij->nj", rng.random((n, 3)), cells[ids]).astype(np.float32)
    pbc = np.array([[True] * 3, [True] * 3, [True, True, False]])
    graphs = [
        kdeqx.radius_graph(points, 1.0, 20000, cell=cells, batch=ids, pbc=pbc, engine=e)
        for e in ("walk", "blocks")
    ]
    assert 1000 < int(graphs[0].count) <= 20000
    _same_graph(*graphs)
    cut = kdeqx.radius_graph(
        points, 1.0, 500, cell=cells, batch=ids, pbc=pbc, engine="blocks"
    )
    assert bool(cut.overflow) and int(cut.count) == int(graphs[0].count)
    kept = list(zip(np.asarray(cut.senders), np.asarray(cut.receivers)))
    assert kept == sorted(kept)

    cell = np.full(3, 5.0, np.float32)
    x = rng.random((n, 3)).astype(np.float32) * 5
    lists = [
        kdeqx.NeighborList.allocate(
            x, 1.0, skin=0.2, cell=cell, max_edges=6000, engine=e
        )
        for e in ("walk", "blocks")
    ]
    assert [nl.engine for nl in lists] == ["walk", "blocks"]
    step = eqx.filter_jit(lambda nl, x: nl.update(x))
    for _ in range(3):
        x = (x + 0.04 * rng.standard_normal(x.shape)).astype(np.float32)
        lists = [step(nl, x) for nl in lists]
    assert int(lists[1].builds) > 1 and not bool(lists[1].overflow)
    _same_graph(lists[0].edges, lists[1].edges)


# Tiny budgets in an open box, the default ones in a periodic box: each of the
# engine's paths once (the tiny budgets' fresh programs cost the suite compile time).
@pytest.mark.parametrize("budgets, periodic", [("tiny", False), ("default", True)])
def test_pairs_of_two_trees_on_blocks_equal_scipy(
    monkeypatch, request, budgets, periodic
):
    """`sparse_distance_matrix` of two trees searched by blocks: scipy's entries, and
    with budgets so small that blocks overflow and are searched again query by query,
    no pair twice. Over capacity, the true count."""
    from kdeqx._backend import _lanes

    if budgets == "tiny":
        monkeypatch.setattr(_lanes, "_BLOCK_SHAPE", _lanes.BlockShape(4, 2, 4, 2))
        jax.clear_caches()  # the queries' traces hold no shape
        request.addfinalizer(jax.clear_caches)
    rng = np.random.default_rng(12)
    a = DATASETS["clustered"](rng, 400, 3).astype(np.float32)
    b = rng.random((300, 3)).astype(np.float32)
    box = 1.0 if periodic else None
    if periodic:
        a %= 1.0
    r = 0.09
    ours, count = kdeqx.KDTree(a, boxsize=box).sparse_distance_matrix(
        kdeqx.KDTree(b, leaf_size=8, engine="blocks", boxsize=box), r, max_entries=4096
    )
    ref = cKDTree(a, boxsize=box).sparse_distance_matrix(
        cKDTree(b, boxsize=box), r, output_type="coo_matrix"
    )
    assert int(count) == ref.nnz
    np.testing.assert_allclose(ours.todense(), ref.toarray(), rtol=1e-5, atol=1e-7)
    _, short = kdeqx.KDTree(a, boxsize=box).sparse_distance_matrix(
        kdeqx.KDTree(b, leaf_size=8, engine="blocks", boxsize=box), r, max_entries=16
    )
    assert int(short) == ref.nnz


# Tiny budgets in an open box, the default ones in a periodic box: each of the
# engine's paths once (the tiny budgets' fresh programs cost the suite compile time).
@pytest.mark.parametrize("budgets, periodic", [("tiny", False), ("default", True)])
def test_pairs_of_one_tree_on_blocks_equal_scipy(
    monkeypatch, request, budgets, periodic
):
    """`query_pairs` and the tree's own `sparse_distance_matrix` by blocks: scipy's
    pairs, each once, whatever the budgets; over capacity, the true count."""
    from kdeqx._backend import _lanes

    if budgets == "tiny":
        monkeypatch.setattr(_lanes, "_BLOCK_SHAPE", _lanes.BlockShape(4, 2, 4, 2))
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)
    rng = np.random.default_rng(13)
    points = DATASETS["clustered"](rng, 500, 3).astype(np.float32) % 1.0
    box = 1.0 if periodic else None
    tree = kdeqx.KDTree(points, leaf_size=8, engine="blocks", boxsize=box)
    reference = cKDTree(points, boxsize=box)
    r = 0.01
    expected = reference.query_pairs(r, output_type="ndarray")
    pairs, _, count = tree.query_pairs(r, max_pairs=4096)
    assert int(count) == len(expected)
    found = np.asarray(pairs)[: int(count)]
    np.testing.assert_array_equal(found, expected[np.lexsort(expected.T[::-1])])
    _, _, short = tree.query_pairs(r, max_pairs=8)
    assert int(short) == len(expected)
    matrix, entries = tree.sparse_distance_matrix(tree, r, max_entries=8192)
    walk = kdeqx.KDTree(points, leaf_size=8, engine="walk", boxsize=box)
    walked, walked_entries = walk.sparse_distance_matrix(walk, r, max_entries=8192)
    ref = reference.sparse_distance_matrix(reference, r, output_type="coo_matrix")
    assert int(entries) == int(walked_entries)
    np.testing.assert_allclose(matrix.todense(), ref.toarray(), rtol=1e-5, atol=1e-7)
    # The same entries; distances to the rounding of two programs' fusions.
    np.testing.assert_array_equal(matrix.todense() > 0, walked.todense() > 0)
    np.testing.assert_allclose(matrix.todense(), walked.todense(), rtol=4e-7)


@pytest.mark.parametrize("size", [20, 32, 40, 256])
def test_ranks_of_flags_count_the_flags_before_each_in_row_major_order(size):
    """A word's bitmask and a prefix over words; rows of several words taken as
    their words; other rows by a prefix sum over every flag."""
    rng = np.random.default_rng(6)
    emits = rng.random((3, 7, size)) < rng.random((3, 7, 1))
    got = jax.jit(_backend.flags_before)(jnp.asarray(emits))
    flat = emits.reshape(-1).astype(np.int64)
    np.testing.assert_array_equal(got, (np.cumsum(flat) - flat).reshape(emits.shape))


@pytest.mark.parametrize("capacity", [5000, 300])
def test_records_picked_by_rows_are_the_scattered_records(capacity):
    """The TPU's way of appending a tile's records (each row's picked into slots by
    reductions, rounds of slots; run here on the CPU) stores and counts what the
    scatter does: the same records while there is room, the same counts beyond."""
    rng = np.random.default_rng(5)
    # Rows of 64 flags holding none to all: up to four rounds of slots.
    emits = rng.random((3, 5, 64)) < rng.random((3, 5, 1)) * 0.65
    emits[0, 0] = True
    emits = jnp.asarray(emits)
    ids = np.arange(emits.size, dtype=np.int32).reshape(emits.shape)
    records = (ids, np.stack([ids, -ids], -1), (ids * 0.5).astype(np.float32))
    records = jax.tree.map(jnp.asarray, records)
    # Items a record stands for (none where no record is emitted, as visitors give).
    weights = jnp.where(emits, jnp.asarray(rng.integers(1, 4, emits.shape)), 0)
    empty = (
        jnp.full(capacity, -1, jnp.int32),
        jnp.full((capacity, 2), -1, jnp.int32),
        jnp.full(capacity, -1.0, jnp.float32),
    )
    start = Sink(empty, jnp.asarray(7, jnp.int32), jnp.asarray(3, jnp.int32))
    scattered = start.appended(emits, records, weights)
    picked = start.appended_by_rows(emits, records, weights, backend="tpu")
    assert emits.sum(-1).max() > 3 * ROW_SLOTS
    emitted = int(emits.sum())
    assert int(picked.written) == int(scattered.written) == 7 + weights[emits].sum()
    assert int(picked.stored) == int(scattered.stored) == min(3 + emitted, capacity)
    got, want = (np.asarray(s.records[0]) for s in (picked, scattered))
    np.testing.assert_array_equal(got[:3], -1)  # what was stored stays
    ids = np.asarray(ids)[np.asarray(emits)]
    if capacity > emitted + 3:  # every record stored, and nothing else
        np.testing.assert_array_equal(np.sort(got), np.sort(want))
        assert set(got[3 : int(picked.stored)]) == set(ids)
    else:  # full: records that were emitted, each once
        kept = got[3:]
        assert len(set(kept)) == len(kept) and set(kept) <= set(ids)
    stored = slice(3, int(picked.stored))
    np.testing.assert_array_equal(picked.records[1][stored, 0], got[stored])
    np.testing.assert_array_equal(picked.records[1][stored, 1], -got[stored])
    np.testing.assert_array_equal(picked.records[2][stored], got[stored] * 0.5)


def test_graphs_and_pairs_by_the_tpus_appends_equal_the_walk(monkeypatch, request):
    """The block engine's graphs and pairs with records appended the TPU's way (on
    the CPU): the walk's edges and scipy's pairs."""
    monkeypatch.setattr(_traverse, "scatters_element_by_element", lambda b=None: True)
    monkeypatch.setattr(_scatters, "gathers_rows_faster", lambda b=None: True)
    jax.clear_caches()  # read when a query is traced
    request.addfinalizer(jax.clear_caches)
    rng = np.random.default_rng(16)
    cell = np.full(3, 4.0, np.float32)
    x = (rng.random((400, 3)) * 4).astype(np.float32)
    graphs = [
        kdeqx.radius_graph(x, 0.9, 30000, cell=cell, engine=e)
        for e in ("walk", "blocks")
    ]
    assert int(graphs[0].count) > 5000
    _same_graph(*graphs)
    tree = kdeqx.KDTree(x, engine="blocks")
    pairs, _, count = tree.query_pairs(0.5, max_pairs=5000)
    want = cKDTree(x).query_pairs(0.5, output_type="ndarray")
    assert int(count) == len(want)
    np.testing.assert_array_equal(pairs[: int(count)], want[np.lexsort(want.T[::-1])])
    # Over capacity: the true count, and as many of scipy's pairs as fit.
    pairs, distances, count = tree.query_pairs(0.5, max_pairs=len(want) // 3)
    assert int(count) == len(want)
    assert set(map(tuple, np.asarray(pairs).tolist())) <= set(map(tuple, want.tolist()))
    assert len(set(map(tuple, np.asarray(pairs).tolist()))) == len(want) // 3
    np.testing.assert_allclose(
        distances, np.linalg.norm(x[pairs[:, 0]] - x[pairs[:, 1]], axis=1), rtol=1e-6
    )
