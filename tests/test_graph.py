"""Neighbour graphs (`radius_graph`, `knn_graph`): edge sets and shifts against a
numpy brute force over every image, in free space, orthorhombic and triclinic cells,
slabs, batches; gradients against finite differences; matscipy where installed."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx


TRICLINIC = np.array([[3.0, 0.0, 0.0], [1.1, 2.6, 0.0], [0.6, -0.7, 2.9]])


def all_images(x, cell, pbc, reach):
    """Every `(i, j, S)` with its distance `|x_j - x_i + S @ cell|`, over offsets of
    up to `reach` cells along the periodic axes (float64)."""
    x = np.asarray(x, np.float64)
    n, d = x.shape
    if cell is None:
        table = np.zeros((1, d), int)
        lattice = np.zeros((d, d))
    else:
        lattice = np.diag(cell) if np.ndim(cell) == 1 else np.asarray(cell, float)
        ranges = [range(-reach, reach + 1) if p else [0] for p in pbc]
        table = np.array(list(itertools.product(*ranges)))
    diff = x[None, :, None, :] - x[:, None, None, :] + (table @ lattice)[None, None]
    distance = np.linalg.norm(diff, axis=-1)  # (i, j, image)
    i, j, s = np.meshgrid(
        np.arange(n), np.arange(n), np.arange(len(table)), indexing="ij"
    )
    return i.ravel(), j.ravel(), table[s.ravel()], distance.ravel()


def reference_radius_graph(
    x, r, cell=None, pbc=(True,) * 3, batch=None, self_loops=False, half=False, reach=4
):
    i, j, shifts, distance = all_images(x, cell, pbc, reach)
    zero = ~shifts.any(axis=1)
    keep = distance <= r
    if not self_loops:
        keep &= ~((i == j) & zero)
    if batch is not None:
        keep &= batch[i] == batch[j]
    if half:
        nonzero = shifts != 0
        first = shifts[np.arange(len(shifts)), np.argmax(nonzero, axis=1)]
        own = (first > 0) | (zero & self_loops)
        keep &= (i < j) | ((i == j) & own)
    return sorted(zip(i[keep], j[keep], map(tuple, shifts[keep])))


def reference_knn_graph(x, k, cell=None, pbc=(True,) * 3, batch=None, self_loops=False):
    i, j, shifts, distance = all_images(x, cell, pbc, 3)
    keep = (i != j) | shifts.any(axis=1) | self_loops
    if batch is not None:
        keep &= batch[i] == batch[j]
    edges = []
    for point in range(len(x)):
        mine = np.flatnonzero(keep & (i == point))
        order = sorted(mine, key=lambda e: (distance[e], j[e], tuple(shifts[e])))[:k]
        edges += sorted((point, j[e], tuple(shifts[e])) for e in order)
    return edges


def edges_of(graph: kdeqx.NeighborGraph, n: int):
    real = np.asarray(graph.senders) < n
    senders, receivers = (
        np.asarray(graph.senders)[real],
        np.asarray(graph.receivers)[real],
    )
    shifts = map(tuple, np.asarray(graph.shifts)[real])
    return list(zip(senders, receivers, shifts))


def check_graph(graph, x, cell, reference, capacity):
    n = len(x)
    kept = edges_of(graph, n)
    if len(reference) <= capacity:
        assert kept == reference
    else:  # as many as fit, real and in order (whichever the walk met first)
        assert len(kept) == capacity and kept == sorted(kept)
        assert set(kept) <= set(reference)
    assert int(graph.count) == len(reference)
    assert bool(graph.overflow) == (len(reference) > capacity)
    padding = np.asarray(graph.senders) == n
    assert (np.asarray(graph.receivers)[padding] == n).all()
    assert (np.asarray(graph.shifts)[padding] == 0).all()
    assert np.isinf(np.asarray(graph.distances)[padding]).all()
    vectors = np.asarray(graph.edge_vectors(x, cell))[~padding]
    np.testing.assert_allclose(
        np.asarray(graph.distances)[~padding],
        np.linalg.norm(vectors, axis=1),
        rtol=1e-6,
    )


def points_in_and_around(seed, n, d=3):
    """Points in `[-1, 4)` on every axis: outside the cell too, so they wrap."""
    return np.random.default_rng(seed).uniform(-1, 4, (n, d))


CASES = {
    "free space": dict(cell=None, r=1.0),
    "cubic box": dict(cell=np.array([3.0, 3.0, 3.0]), r=1.0),
    "triclinic": dict(cell=TRICLINIC, r=1.2),
    "triclinic, r beyond half the cell": dict(cell=TRICLINIC, r=2.0),
    "triclinic, r beyond the cell": dict(cell=TRICLINIC, r=3.5),
    "slab": dict(cell=TRICLINIC, r=2.0, pbc=(True, True, False)),
}


# Every case directed; half lists and self loops on the two hardest cells (each
# configuration is a compilation: the suite's time).
RADIUS_CASES = [(case, "directed") for case in CASES] + [
    (case, variant)
    for case in ("triclinic, r beyond half the cell", "slab")
    for variant in ("half", "self loops")
]


@pytest.mark.x64
@pytest.mark.parametrize("case, variant", RADIUS_CASES)
def test_radius_graph_is_every_image_within_r(case, variant):
    config = dict(CASES[case])
    r, cell, pbc = config["r"], config["cell"], config.get("pbc", (True,) * 3)
    x = points_in_and_around(0, 40)
    options = dict(half=variant == "half", self_loops=variant == "self loops")
    # Two cells each side for every cell (more than most r need): one program.
    images = None if cell is None else 2
    graph = kdeqx.radius_graph(
        x, r, 20000, cell=cell, pbc=pbc, images=images, **options
    )
    reference = reference_radius_graph(x, r, cell, pbc, **options)
    assert 10 < len(reference) <= 20000  # neither vacuous nor cut off
    check_graph(graph, x, cell, reference, 20000)


@pytest.mark.x64
def test_radius_graph_of_a_batch_keeps_edges_in_segments():
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 3, (60, 3))  # the segments overlap in space
    batch = rng.integers(0, 4, 60)
    for cell in (None, TRICLINIC):
        graph = kdeqx.radius_graph(x, 1.5, 3000, cell=cell, batch=batch)
        reference = reference_radius_graph(x, 1.5, cell, batch=batch)
        check_graph(graph, x, cell, reference, 3000)


@pytest.mark.x64
def test_radius_graph_overflow_counts_and_keeps_edges_in_order():
    x = points_in_and_around(2, 40)
    reference = reference_radius_graph(x, 2.0, TRICLINIC)
    graph = kdeqx.radius_graph(x, 2.0, 100, cell=TRICLINIC)
    check_graph(graph, x, TRICLINIC, reference, 100)


def test_radius_graph_float32_differs_only_at_the_cutoff():
    x = points_in_and_around(3, 50).astype(np.float32)
    graph = kdeqx.radius_graph(x, 1.5, 4000, cell=TRICLINIC.astype(np.float32))
    got = set(edges_of(graph, 50))
    i, j, shifts, distance = all_images(x, TRICLINIC, (True,) * 3, 2)
    near = dict(zip(zip(i, j, map(tuple, shifts)), distance))
    expected = {
        e for e, dist in near.items() if dist <= 1.5 and (e[0] != e[1] or any(e[2]))
    }
    assert all(abs(near[e] - 1.5) < 1e-5 for e in got ^ expected)
    assert len(got) > 500


@pytest.mark.x64
@pytest.mark.parametrize("case", ["free space", "triclinic", "slab"])
def test_knn_graph_is_each_points_k_nearest_images(case):
    config = CASES[case]
    cell, pbc = config["cell"], config.get("pbc", (True,) * 3)
    x = points_in_and_around(4, 30)
    configurations = [(7, False)] + [(3, True)] * (case == "triclinic")
    for k, self_loops in configurations:
        graph = kdeqx.knn_graph(x, k, cell=cell, pbc=pbc, self_loops=self_loops)
        reference = reference_knn_graph(x, k, cell, pbc, self_loops=self_loops)
        check_graph(graph, x, cell, reference, 30 * k)


def test_knn_graph_searches_only_images_within_the_kth_distance(monkeypatch):
    """Each image beyond a point's k-th nearest so far of every point is not
    searched: in a periodic cube the points near the faces that image crosses.
    The graph is still scipy's periodic k nearest."""
    from kdeqx._graph import _graph

    searched = []
    surely_beyond = _graph._surely_beyond

    def recorded(x, lo, hi, r):
        beyond = surely_beyond(x, lo, hi, r)
        jax.debug.callback(lambda b: searched.append(int((~b).sum())), beyond)
        return beyond

    monkeypatch.setattr(_graph, "_surely_beyond", recorded)
    rng = np.random.default_rng(31)
    n, k = 2000, 6
    x = rng.random((n, 3)).astype(np.float32)
    graph = kdeqx.knn_graph(x, k, cell=np.ones(3, np.float32))
    _, want = cKDTree(x.astype(np.float64), boxsize=1.0).query(x, k + 1)
    got = np.sort(np.asarray(graph.receivers).reshape(n, k), axis=1)
    np.testing.assert_array_equal(got, np.sort(want[:, 1:], axis=1))
    # 26 other images; a point's k-th distance here is about 0.09, so each face's
    # image takes about 9 % of the points, and the edges' and corners' a few.
    assert len(searched) == 26 and sum(searched) < 0.8 * n, searched


@pytest.mark.x64
@pytest.mark.parametrize("chunk", [1, 7])
def test_knn_graph_images_in_chunks_that_split_a_points_images(monkeypatch, chunk):
    """A chunk of image queries may end between two images of one point: its best
    is then merged in twice, and the graph is still every point's k nearest."""
    from kdeqx._graph import _graph

    monkeypatch.setattr(_graph, "_image_chunk", lambda n: chunk)
    x = points_in_and_around(6, 25)
    cell = CASES["triclinic"]["cell"]
    graph = kdeqx.knn_graph(x, 9, cell=cell)
    check_graph(graph, x, cell, reference_knn_graph(x, 9, cell, (True,) * 3), 25 * 9)


@pytest.mark.x64
def test_knn_graph_of_a_batch_with_a_segment_short_of_k():
    rng = np.random.default_rng(5)
    x = rng.uniform(0, 3, (30, 3))
    batch = np.repeat([2, 0, 1], [14, 13, 3])  # segment 1 has only 2 others
    graph = kdeqx.knn_graph(x, 4, batch=batch)
    reference = reference_knn_graph(x, 4, batch=batch)
    assert len(reference) == 27 * 4 + 3 * 2
    check_graph(graph, x, None, reference, 120)


@pytest.mark.x64
def test_lattice_ties_go_to_the_lower_receiver_then_shift():
    grid = np.stack(np.meshgrid(*[np.arange(3.0)] * 3, indexing="ij"), -1).reshape(
        -1, 3
    )
    box = np.array([3.0, 3.0, 3.0])
    for k in (10,):
        graph = kdeqx.knn_graph(grid, k, cell=box)
        check_graph(graph, grid, box, reference_knn_graph(grid, k, box), 27 * k)
    graph = kdeqx.radius_graph(grid, 1.0, 1000, cell=box)
    check_graph(graph, grid, box, reference_radius_graph(grid, 1.0, box), 1000)


@pytest.mark.x64
def test_matches_matscipy_neighbour_list():
    neighbours = pytest.importorskip("matscipy.neighbours")
    x = points_in_and_around(6, 200) * 2
    cell = TRICLINIC * 2
    for pbc in ((True, True, True), (True, False, True)):
        i, j, shifts = neighbours.neighbour_list(
            "ijS", positions=x, cell=cell, pbc=pbc, cutoff=2.5
        )
        graph = kdeqx.radius_graph(x, 2.5, 20000, cell=cell, pbc=pbc)
        expected = sorted(zip(i, j, map(tuple, shifts)))
        assert edges_of(graph, 200) == expected


@pytest.mark.x64
def test_gradients_into_positions_and_cell_match_finite_differences():
    x = points_in_and_around(7, 20)

    def energy(x, cell):
        graph = kdeqx.radius_graph(x, 2.0, 2000, cell=cell, images=1)
        vectors = graph.edge_vectors(x, cell)
        live = graph.edge_mask()
        return jnp.sum(jnp.where(live, jnp.exp(-jnp.sum(vectors**2, -1)), 0)) + jnp.sum(
            jnp.where(live, jnp.cos(graph.distances), 0)
        )

    forces, stress = jax.grad(energy, argnums=(0, 1))(x, TRICLINIC)
    step = 1e-6
    for array, gradient, argnum in ((x, forces, 0), (TRICLINIC, stress, 1)):
        for index in [(0, 0), (1, 2), (2, 1)]:
            plus, minus = array.copy(), array.copy()
            plus[index] += step
            minus[index] -= step
            args_plus = (plus, TRICLINIC) if argnum == 0 else (x, plus)
            args_minus = (minus, TRICLINIC) if argnum == 0 else (x, minus)
            numeric = (energy(*args_plus) - energy(*args_minus)) / (2 * step)
            np.testing.assert_allclose(gradient[index], numeric, rtol=1e-5, atol=1e-7)


def test_gradients_are_finite_at_zero_length_edges():
    x = jnp.array([[0.0, 0.0], [0.0, 0.0], [0.5, 0.5]])  # a duplicate point

    def total_length(x):
        graph = kdeqx.radius_graph(x, 1.0, 20, self_loops=True)
        return jnp.sum(jnp.where(graph.edge_mask(), graph.distances, 0))

    grad = jax.grad(total_length)(x)
    assert np.isfinite(np.asarray(grad)).all()
    # Only the pairs with the third point pull: the zero-length edges add nothing.
    np.testing.assert_allclose(
        grad[2], 2 * 2 * np.array([1, 1]) / np.sqrt(2), rtol=1e-6
    )


def test_traced_cell_under_jit_compiles_once_and_checks_the_reach():
    x = jnp.asarray(points_in_and_around(8, 64), jnp.float32)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def build(x, cell, r):
        return kdeqx.radius_graph(x, r, 4000, cell=cell)

    cell = jnp.asarray(TRICLINIC, jnp.float32)
    first = build(x, cell, jnp.float32(1.0))
    again = build(x + 0.01, cell * 1.01, jnp.float32(1.1))
    for graph, (y, c, r) in (
        (first, (x, cell, 1.0)),
        (again, (x + 0.01, cell * 1.01, 1.1)),
    ):
        eager = kdeqx.radius_graph(y, r, 4000, cell=c)
        assert edges_of(graph, 64) == edges_of(eager, 64)
    # One image on either side reaches the smallest cell height (2.53), not 2.6.
    with pytest.raises(Exception, match="images"):
        build(x, cell, jnp.float32(2.6)).distances.block_until_ready()


def test_vmap_over_systems_equals_each_system():
    xs = jnp.asarray(np.random.default_rng(9).uniform(0, 3, (4, 50, 3)), jnp.float32)
    cell = jnp.asarray(TRICLINIC, jnp.float32)
    graphs = jax.vmap(lambda x: kdeqx.radius_graph(x, 1.2, 1500, cell=cell, images=1))(
        xs
    )
    for b in range(4):
        one = kdeqx.radius_graph(xs[b], 1.2, 1500, cell=cell, images=1)
        assert edges_of(jax.tree.map(lambda a: a[b], graphs), 50) == edges_of(one, 50)


def test_tiny_inputs():
    empty = kdeqx.radius_graph(np.zeros((0, 3), np.float32), 1.0, 4)
    assert int(empty.count) == 0 and (np.asarray(empty.senders) == 0).all()
    # One point in a small cell: its own images are its neighbours.
    one = np.array([[0.2, 0.3]], np.float32)
    graph = kdeqx.radius_graph(one, 1.5, 20, cell=np.array([1.0, 2.0], np.float32))
    assert sorted(s for _, _, s in edges_of(graph, 1)) == [(-1, 0), (1, 0)]
    knn = kdeqx.knn_graph(one, 2, cell=np.array([1.0, 2.0], np.float32))
    assert edges_of(knn, 1) == [(0, 0, (-1, 0)), (0, 0, (1, 0))]
    lonely = kdeqx.knn_graph(one, 3)
    assert int(lonely.count) == 0 and not bool(lonely.overflow)


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_flat_cells_are_rejected_eagerly_and_under_jit(scale):
    """A cell whose volume is negligible beside its vectors (one vector a 1e-5 tilt
    away from another's line) raises, eagerly and under `jit`, at any scale; the
    same cell tilted by 0.5 is a cell."""
    x = np.random.default_rng(0).random((10, 3)).astype(np.float32) * scale

    def cell(tilt):
        lattice = [[1.0, 0.0, 0.0], [2.0, tilt, 0.0], [0.0, 0.0, 1.0]]
        return np.array(lattice, np.float32) * np.float32(scale)

    def count(lattice):
        return kdeqx.radius_graph(x, 0.2 * scale, 400, cell=lattice).count

    with pytest.raises(ValueError, match="volume"):
        count(cell(1e-5))
    with pytest.raises(Exception, match="volume"):
        jax.block_until_ready(jax.jit(count)(cell(1e-5)))
    assert int(count(cell(0.5))) == int(jax.jit(count)(cell(0.5))) > 0


def test_bad_input_raises_clear_errors():
    x = np.random.default_rng(0).random((10, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="volume"):
        kdeqx.radius_graph(
            x, 0.5, 10, cell=np.array([[1, 0, 0], [2, 0, 0], [0, 0, 1.0]])
        )
    with pytest.raises(ValueError, match="cell"):
        kdeqx.radius_graph(x, 0.5, 10, cell=np.ones((2, 2)))
    with pytest.raises(ValueError, match="pbc"):
        kdeqx.radius_graph(x, 0.5, 10, cell=np.ones(3), pbc=(True, False))
    with pytest.raises(ValueError, match="r"):
        kdeqx.radius_graph(x, 0.0, 10)
    with pytest.raises(ValueError, match="r"):
        kdeqx.radius_graph(x, np.nan, 10)
    with pytest.raises(ValueError, match="max_edges"):
        kdeqx.radius_graph(x, 0.5, 0)
    with pytest.raises(TypeError, match="batch"):
        kdeqx.radius_graph(x, 0.5, 10, batch=np.zeros(10))
    with pytest.raises(ValueError, match="batch"):
        kdeqx.radius_graph(x, 0.5, 10, batch=np.zeros(9, int))
    with pytest.raises(ValueError, match="images"):
        kdeqx.radius_graph(x, 1.5, 10, cell=np.ones(3), images=1)
    with pytest.raises(ValueError, match="finite"):
        kdeqx.radius_graph(np.full((3, 3), np.nan), 0.5, 10)
    with pytest.raises(ValueError, match="k"):
        kdeqx.knn_graph(x, 0)
    with pytest.raises(Exception, match="images"):  # 10 points, 27 cells: 269 images
        kdeqx.knn_graph(x, 300, cell=np.ones(3)).distances.block_until_ready()


def test_to_jraph_message_passing_equals_segment_sum():
    jraph = pytest.importorskip("jraph")
    x = jnp.asarray(points_in_and_around(10, 30), jnp.float32)
    graph = kdeqx.radius_graph(x, 1.5, 600)
    features = jnp.arange(30.0)[:, None] + 1
    graphs = graph.to_jraph(features)
    assert isinstance(graphs, jraph.GraphsTuple)
    assert int(graphs.n_edge.sum()) == 600 and int(graphs.n_edge[0]) == int(graph.count)
    # Sum of the senders' features at each receiver: jraph's padded layout (padding
    # edges into node n) equals a segment sum over the real edges.
    summed = jax.ops.segment_sum(graphs.nodes[graphs.senders], graphs.receivers, 31)[
        :30
    ]
    live = graph.edge_mask()
    senders = np.asarray(graph.senders)[np.asarray(live)]
    receivers = np.asarray(graph.receivers)[np.asarray(live)]
    expected = np.zeros(30)
    np.add.at(expected, receivers, np.asarray(features)[senders, 0])
    np.testing.assert_allclose(summed[:, 0], expected)
    assert (np.asarray(graphs.nodes[30]) == 0).all()


def test_edge_lengths_far_from_unit_coordinates():
    # Squared float32 lengths overflow beyond ~1e19 and underflow below ~1e-19: each
    # edge is measured in a unit near its own size.
    rng = np.random.default_rng(5)
    base = rng.random((60, 3))
    batch = np.repeat([0, 1], 30)
    for shift in (-100, 70):
        c = 2.0**shift
        points = (base * c).astype(np.float32)
        cell = (np.eye(3) * c).astype(np.float32)
        graphs = [
            kdeqx.radius_graph(points, 0.3 * c, 2000),
            kdeqx.radius_graph(points, 0.3 * c, 2000, cell=cell),
            kdeqx.knn_graph(points, 3, batch=batch),
        ]
        for graph, shifts in zip(graphs, (0, 1, 0)):
            count = int(graph.count)
            assert count > 0
            s, r = (
                np.asarray(graph.senders[:count]),
                np.asarray(graph.receivers[:count]),
            )
            vector = base[r] - base[s] + shifts * np.asarray(graph.shifts[:count])
            np.testing.assert_allclose(
                np.asarray(graph.distances[:count]) / c,
                np.linalg.norm(vector, axis=1),
                rtol=1e-6,
            )
