"""Batches of systems, each in a cell of its own (`cell` of shape `(B, d, d)` or
`(B, d)`, `batch` ids `0 .. B - 1`): radius and kNN graphs and neighbour lists
against a numpy brute force over each system's images and against one call per
system; per-system `pbc`; gradients into the cells against finite differences;
errors; `to_jraph` with one graph per system."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx


R = 1.4
# One shape for most tests: they share compiled programs.
SIZES = [17, 9, 30, 1, 22]
MAX_EDGES = 3000


def crystals(seed, sizes, d=3, lengths=False):
    """Cells `(B, d, d)` (or `(B, d)` lengths) of heights above `R`, and points in
    them (some a little outside, so they wrap), as `(points, batch, cells)`."""
    rng = np.random.default_rng(seed)
    cells = []
    for _ in sizes:
        lattice = np.diag(rng.uniform(2.6, 3.6, d))
        if not lengths:
            lattice += np.tril(rng.uniform(-0.6, 0.6, (d, d)), -1)
        cells.append(np.diag(lattice) if lengths else lattice)
    cells = np.array(cells)
    lattices = cells if not lengths else np.array([np.diag(c) for c in cells])
    batch = np.repeat(np.arange(len(sizes)), sizes)
    fractional = rng.uniform(-0.2, 1.2, (len(batch), d))
    points = np.einsum("ni,nij->nj", fractional, lattices[batch])
    return points.astype(np.float32), batch, cells.astype(np.float32)


def as_lattices(cells):
    cells = np.asarray(cells, np.float64)
    return cells if cells.ndim == 3 else np.array([np.diag(c) for c in cells])


def every_image(x, batch, cells, pbc, reach=2):
    """`(i, j, S, distance)` of every pair within a system (float64), over offsets of
    up to `reach` cells along each system's periodic axes."""
    x = np.asarray(x, np.float64)
    d = x.shape[1]
    if cells is None:  # free space
        cells, pbc = np.zeros((batch.max() + 1, d)), False
    lattices = as_lattices(cells)
    pbc = np.broadcast_to(pbc, (len(lattices), d))
    out = []
    for b, lattice in enumerate(lattices):
        members = np.flatnonzero(batch == b)
        ranges = [range(-reach, reach + 1) if p else [0] for p in pbc[b]]
        table = np.array(list(itertools.product(*ranges))).reshape(-1, d)
        y = x[members]
        diff = y[None, :, None] - y[:, None, None] + (table @ lattice)[None, None]
        distance = np.linalg.norm(diff, axis=-1)
        for i, j, s in zip(*np.nonzero(np.isfinite(distance))):
            out.append((members[i], members[j], tuple(table[s]), distance[i, j, s]))
    return out


def reference_radius(x, batch, cells, pbc=True, r=R):
    return {
        (i, j, s): dist
        for i, j, s, dist in every_image(x, batch, cells, pbc)
        if dist <= r and not (i == j and not any(s))
    }


def reference_knn(x, batch, cells, k, pbc=True):
    candidates = {}
    for i, j, s, dist in every_image(x, batch, cells, pbc):
        if not (i == j and not any(s)):
            candidates.setdefault(i, []).append((dist, j, s))
    edges = {}
    for i, found in candidates.items():
        for dist, j, s in sorted(found)[:k]:
            edges[(i, j, s)] = dist
    return edges


def edges_of(graph, n, mask=None):
    """The graph's edges `{(i, j, S): distance}` (those where `mask`), checking its
    padding."""
    senders = np.asarray(graph.senders)
    real = senders < n
    assert (np.asarray(graph.receivers)[~real] == n).all()
    assert (np.asarray(graph.shifts)[~real] == 0).all()
    assert np.isinf(np.asarray(graph.distances)[~real]).all()
    if mask is not None:
        real &= np.asarray(mask)
    return {
        (i, j, tuple(s)): dist
        for i, j, s, dist in zip(
            senders[real],
            np.asarray(graph.receivers)[real],
            np.asarray(graph.shifts)[real].tolist(),
            np.asarray(graph.distances)[real],
        )
    }


def assert_same_edges(got, expected):
    assert set(got) == set(expected)
    keys = sorted(expected)
    np.testing.assert_allclose(
        [got[e] for e in keys], [expected[e] for e in keys], rtol=2e-5, atol=2e-6
    )


@pytest.mark.parametrize("form", ["lattices", "lengths"])
def test_radius_graph_with_a_cell_per_system(form):
    x, batch, cells = crystals(0, SIZES, lengths=form == "lengths")
    order = np.random.default_rng(1).permutation(len(x))  # ids in any order
    x, batch = x[order], batch[order]
    graph = kdeqx.radius_graph(x, R, MAX_EDGES, cell=cells, batch=batch)
    expected = reference_radius(x, batch, cells)
    assert_same_edges(edges_of(graph, len(x)), expected)
    assert int(graph.count) == len(expected) and not bool(graph.overflow)
    assert graph.num_systems == 5
    # Each edge's vector is measured in its own system's cell.
    live = np.asarray(graph.edge_mask())
    vectors = np.asarray(graph.edge_vectors(x, cells))
    np.testing.assert_allclose(
        np.linalg.norm(vectors[live], axis=1),
        np.asarray(graph.distances)[live],
        rtol=1e-6,
    )
    assert (vectors[~live] == 0).all()


def test_one_call_equals_one_call_per_system():
    sizes = [12, 25, 7]
    x, batch, cells = crystals(2, sizes)
    starts = np.cumsum([0] + sizes)
    together = kdeqx.radius_graph(x, R, 2000, cell=cells, batch=batch, half=True)
    alone = {}
    for b, start in enumerate(starts[:-1]):
        one = kdeqx.radius_graph(
            x[start : starts[b + 1]], R, 2000, cell=cells[b], half=True
        )
        for (i, j, s), dist in edges_of(one, sizes[b]).items():
            alone[(i + start, j + start, s)] = dist
    assert_same_edges(edges_of(together, len(x)), alone)


@pytest.mark.parametrize("engine", ["walk", "blocks"])
def test_segments_stay_apart_at_any_scale(engine):
    """Segments are set apart along an extra axis of the search: a separation on the
    scale of the cutoff, far below the coordinates (identical points far from the
    origin), squared to zero in the tree's scaled coordinates and joined them; one
    of order one joined tiny systems' candidates. Against brute force within each
    segment."""
    rng = np.random.default_rng(4)
    batch = np.arange(12) % 3
    same = batch[:, None] == batch[None]
    far = np.repeat(rng.random((1, 3)) * 1e30, 12, axis=0).astype(np.float32)
    graph = kdeqx.radius_graph(far, 1.0, 200, batch=batch, engine=engine)
    expected = set(zip(*np.nonzero(same & ~np.eye(12, dtype=bool))))
    real = np.asarray(graph.senders) < 12
    got = zip(*(np.asarray(a)[real] for a in (graph.senders, graph.receivers)))
    assert set(got) == expected and int(graph.count) == len(expected)
    tiny = (rng.random((12, 3)) * 1e-30).astype(np.float32)
    graph = kdeqx.knn_graph(tiny, 2, batch=batch, engine=engine)
    d = np.linalg.norm(tiny[:, None].astype(float) - tiny[None], axis=-1)
    d = np.where(same & ~np.eye(12, dtype=bool), d, np.inf)
    nearest = np.sort(np.argsort(d, axis=1)[:, :2], axis=1)  # in receiver order
    np.testing.assert_array_equal(np.asarray(graph.receivers).reshape(12, 2), nearest)


def test_knn_graph_with_a_cell_per_system():
    x, batch, cells = crystals(3, SIZES)
    with pytest.raises(Exception, match="images"):  # the lone atom's own images
        kdeqx.knn_graph(x, 5, cell=cells, batch=batch).distances.block_until_ready()
    graph = kdeqx.knn_graph(x, 5, cell=cells, batch=batch, images=2)
    assert_same_edges(edges_of(graph, len(x)), reference_knn(x, batch, cells, 5))
    assert graph.max_edges == 5 * len(x) and int(graph.count) == 5 * len(x)


def test_pbc_per_system_and_for_all():
    x, batch, cells = crystals(4, SIZES)
    pbc = np.array(
        [
            [True, True, True],
            [False, False, True],  # a wire
            [True, True, False],  # a slab
            [False, False, False],  # a molecule in a box
            [False, True, True],
        ]
    )
    radius = kdeqx.radius_graph(x, R, MAX_EDGES, cell=cells, batch=batch, pbc=pbc)
    assert_same_edges(
        edges_of(radius, len(x)), reference_radius(x, batch, cells, pbc=pbc)
    )
    knn = kdeqx.knn_graph(x, 5, cell=cells, batch=batch, pbc=pbc)
    assert_same_edges(edges_of(knn, len(x)), reference_knn(x, batch, cells, 5, pbc=pbc))
    # One row of `pbc` for every system.
    slabs = (True, False, True)
    radius = kdeqx.radius_graph(x, R, MAX_EDGES, cell=cells, batch=batch, pbc=slabs)
    assert_same_edges(
        edges_of(radius, len(x)), reference_radius(x, batch, cells, pbc=slabs)
    )


def test_default_images_cover_every_cell():
    """One small cell needs two images on either side where the others need one;
    too few images raise."""
    x, batch, cells = crystals(5, [10, 12])
    cells[1] *= 0.5  # heights from 1.3 to 1.8, below `r`
    x[batch == 1] *= 0.5
    graph = kdeqx.radius_graph(x, 2.0, 4000, cell=cells, batch=batch)
    assert_same_edges(edges_of(graph, len(x)), reference_radius(x, batch, cells, r=2.0))
    with pytest.raises(ValueError, match="images"):
        kdeqx.radius_graph(x, 2.0, 4000, cell=cells, batch=batch, images=1)


def test_neighbor_list_with_a_cell_per_system():
    x, batch, cells = crystals(6, [20, 13, 31])
    lattices = as_lattices(cells)
    rng = np.random.default_rng(7)
    neighbours = kdeqx.NeighborList.allocate(x, R, skin=0.3, cell=cells, batch=batch)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(neighbours, y):
        return neighbours.update(y)

    def wrapped(y):
        fractional = np.einsum("ni,nij->nj", y, np.linalg.inv(lattices)[batch])
        fractional -= np.floor(fractional)
        return np.einsum("ni,nij->nj", fractional, lattices[batch]).astype(np.float32)

    y = x
    for t in range(6):
        y = wrapped(y + rng.normal(0, 0.05, y.shape).astype(np.float32))
        neighbours = step(neighbours, y)
        within = edges_of(neighbours.graph(y), len(y), neighbours.within_cutoff(y))
        assert_same_edges(within, reference_radius(y, batch, cells))
    assert 1 < int(neighbours.builds) < 7 and not bool(neighbours.overflow)
    again = neighbours.reallocate(y)
    assert_same_edges(
        edges_of(again.edges, len(y)), reference_radius(y, batch, cells, r=R + 0.3)
    )


@pytest.mark.x64
def test_gradients_into_points_and_cells_match_finite_differences():
    x, batch, cells = crystals(8, [6, 9])
    x, cells = x.astype(np.float64), cells.astype(np.float64)

    def energy(x, cells):
        graph = kdeqx.radius_graph(x, R, 400, cell=cells, batch=batch, images=1)
        vectors = graph.edge_vectors(x, cells)
        live = graph.edge_mask()
        return jnp.sum(jnp.where(live, jnp.exp(-jnp.sum(vectors**2, -1)), 0)) + jnp.sum(
            jnp.where(live, jnp.cos(graph.distances), 0)
        )

    forces, stress = jax.grad(energy, argnums=(0, 1))(x, cells)
    assert np.isfinite(forces).all() and np.isfinite(stress).all()
    assert np.abs(stress[0]).max() > 0 and np.abs(stress[1]).max() > 0
    step = 1e-6
    for array, gradient, argnum in ((x, forces, 0), (cells, stress, 1)):
        for index in (
            [(0, 0), (3, 2), (8, 1)]
            if argnum == 0
            else [
                (0, 0, 0),
                (0, 2, 1),
                (1, 1, 0),
                (1, 2, 2),
            ]
        ):
            plus, minus = array.copy(), array.copy()
            plus[index] += step
            minus[index] -= step
            args_plus = (plus, cells) if argnum == 0 else (x, plus)
            args_minus = (minus, cells) if argnum == 0 else (x, minus)
            numeric = (energy(*args_plus) - energy(*args_minus)) / (2 * step)
            np.testing.assert_allclose(gradient[index], numeric, rtol=1e-5, atol=1e-7)


def test_ids_and_shapes_raise_clear_errors():
    x, batch, cells = crystals(9, [5, 6])
    with pytest.raises(ValueError, match="batch"):
        kdeqx.radius_graph(x, R, 100, cell=cells)
    with pytest.raises(ValueError, match=r"0 \.\. 1"):
        kdeqx.radius_graph(x, R, 100, cell=cells, batch=batch + 1)
    with pytest.raises(ValueError, match=r"0 \.\. 1"):
        kdeqx.knn_graph(x, 2, cell=cells, batch=batch - 1)
    with pytest.raises(ValueError, match=r"0 \.\. 1"):
        kdeqx.NeighborList.allocate(x, R, skin=0.1, cell=cells, batch=batch * 2)

    @jax.jit
    def count(batch):
        return kdeqx.radius_graph(x, R, 100, cell=cells, batch=batch).count

    assert int(count(batch)) > 0
    with pytest.raises(Exception, match=r"0 \.\. 1"):
        jax.block_until_ready(count(batch + 1))
    with pytest.raises(ValueError, match="cell"):
        kdeqx.radius_graph(x, R, 100, cell=np.ones((2, 2)), batch=batch)
    with pytest.raises(ValueError, match="cell"):
        kdeqx.radius_graph(x, R, 100, cell=np.ones((2, 3, 2)), batch=batch)
    with pytest.raises(ValueError, match="pbc"):
        kdeqx.radius_graph(
            x, R, 100, cell=cells, batch=batch, pbc=np.ones((3, 3), bool)
        )
    with pytest.raises(ValueError, match="pbc"):  # one row per system: needs cells
        kdeqx.radius_graph(x, R, 100, cell=cells[0], pbc=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="volume"):
        flat = cells.copy()
        flat[1, 2] = flat[1, 1]
        kdeqx.radius_graph(x, R, 100, cell=flat, batch=batch)
    with pytest.raises(ValueError, match="finite"):
        kdeqx.radius_graph(x, R, 100, cell=cells * np.nan, batch=batch)
    graph = kdeqx.radius_graph(x, R, 100, cell=cells[0])
    with pytest.raises(ValueError, match="batch"):  # which cell is whose?
        graph.edge_vectors(x, cells)


def test_to_jraph_gives_a_graph_per_system():
    jraph = pytest.importorskip("jraph")
    x, batch, cells = crystals(10, SIZES)
    graph = kdeqx.radius_graph(x, R, MAX_EDGES, cell=cells, batch=batch)
    features = jnp.arange(len(x), dtype=jnp.float32)[:, None]
    graphs = graph.to_jraph(features, globals=jnp.zeros((6, 2)))
    assert isinstance(graphs, jraph.GraphsTuple)
    expected = reference_radius(x, batch, cells)
    per_system = np.bincount([batch[i] for i, _, _ in expected], minlength=5)
    assert list(np.asarray(graphs.n_node)) == SIZES + [1]
    assert list(np.asarray(graphs.n_edge)) == list(per_system) + [
        MAX_EDGES - len(expected)
    ]
    # jraph's own view: each edge in its graph, padding last.
    assert list(np.asarray(jraph.get_graph_padding_mask(graphs))) == [1] * 5 + [0]
    unbatched = jraph.unbatch(graphs)
    assert [int(g.n_edge[0]) for g in unbatched[:5]] == list(per_system)
    assert all(int(g.senders.max(initial=0)) < g.n_node[0] for g in unbatched[:5])
    # Under `jit`, `B` from the cells; globals need one row per graph and padding.
    jitted = jax.jit(lambda g: g.to_jraph(features).n_edge)(graph)
    assert (np.asarray(jitted) == np.asarray(graphs.n_edge)).all()
    with pytest.raises(ValueError, match="globals"):
        graph.to_jraph(features, globals=jnp.zeros((3, 1)))
    with pytest.raises(ValueError, match="nodes"):
        graph.to_jraph(features[:-1])
    with pytest.raises(ValueError, match="num_graphs"):
        graph.to_jraph(features, num_graphs=3)


def test_to_jraph_of_molecules_and_its_errors():
    """A batch in free space needs `num_graphs`; ids must be sorted."""
    sizes = [5, 7, 4]
    batch = np.repeat(np.arange(3), sizes)
    x = np.random.default_rng(11).random((16, 3)).astype(np.float32)
    graph = kdeqx.radius_graph(x, 0.6, 400, batch=batch)
    nodes = jnp.ones((16, 1))
    with pytest.raises(ValueError, match="num_graphs"):
        graph.to_jraph(nodes)
    graphs = graph.to_jraph(nodes, num_graphs=3)
    assert list(np.asarray(graphs.n_node)) == sizes + [1]
    expected = reference_radius(x, batch, None, r=0.6)
    per_system = np.bincount([batch[i] for i, _, _ in expected], minlength=3)
    assert list(np.asarray(graphs.n_edge)[:3]) == list(per_system)
    with pytest.raises(ValueError, match="sorted"):
        shuffled = kdeqx.radius_graph(x, 0.6, 400, batch=batch[::-1].copy())
        shuffled.to_jraph(nodes, num_graphs=3)
    with pytest.raises(Exception, match="sorted"):
        shuffled = kdeqx.radius_graph(x, 0.6, 400, batch=batch[::-1].copy())
        jax.block_until_ready(
            jax.jit(lambda g: g.to_jraph(nodes, num_graphs=3).n_node)(shuffled)
        )
    with pytest.raises(ValueError, match=r"0 \.\. 1"):
        graph.to_jraph(nodes, num_graphs=2)
    # Without `batch`: one graph and the padding graph, globals of 2 rows.
    single = kdeqx.radius_graph(x, 0.6, 400)
    assert single.to_jraph(nodes, globals=jnp.zeros((2, 1))).n_node.shape == (2,)
    with pytest.raises(ValueError, match="globals"):
        single.to_jraph(nodes, globals=jnp.zeros((3, 1)))
