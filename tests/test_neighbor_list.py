"""`NeighborList`: across steps of wrapped random motion, the pairs within the cutoff
equal a fresh radius graph's at every step; overflow, reallocation, jit and vmap."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx
from kdeqx._engine import _traverse


CELL = np.array([[5.0, 0.0, 0.0], [1.0, 4.5, 0.0], [0.5, 0.3, 4.8]])


def wrapped(y):
    fractional = y @ np.linalg.inv(CELL)
    return (fractional - np.floor(fractional)) @ CELL


def edges_within(graph, mask, n):
    keep = np.asarray(mask) & (np.asarray(graph.senders) < n)
    shifts = map(tuple, np.asarray(graph.shifts)[keep])
    return sorted(
        zip(np.asarray(graph.senders)[keep], np.asarray(graph.receivers)[keep], shifts)
    )


@pytest.mark.x64
def test_update_follows_wrapped_particles_and_rebuilds_in_time():
    half = False  # half lists are the builder's option (test_graph, test_properties)
    rng = np.random.default_rng(0)
    y = rng.uniform(0, 4, (60, 3))
    neighbours = kdeqx.NeighborList.allocate(y, 1.5, skin=0.4, cell=CELL, half=half)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(neighbours, y):
        return neighbours.update(y)

    for t in range(12):
        y = wrapped(y + rng.normal(0, 0.03, y.shape))
        neighbours = step(neighbours, y)
        fresh = kdeqx.radius_graph(y, 1.5, 5000, cell=CELL, half=half)
        graph = neighbours.graph(y)
        got = edges_within(graph, neighbours.within_cutoff(y), 60)
        assert got == edges_within(fresh, fresh.edge_mask(), 60), t
        live = np.asarray(graph.edge_mask())
        vectors = np.asarray(neighbours.edges.edge_vectors(y, CELL))[live]
        np.testing.assert_allclose(
            np.linalg.norm(vectors, axis=1), np.asarray(graph.distances)[live]
        )
    assert 1 < int(neighbours.builds) < 12  # rebuilt, but not at every step
    assert not bool(neighbours.overflow)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"cell": CELL},
        {"cell": CELL, "half": True},
        {"batch": np.repeat([0, 1], 20)},
    ],
    ids=["free space", "cell", "half", "batch"],
)
def test_capacity_is_sized_from_the_pairs_found(options):
    """The first pass counts the pairs without collecting them: the capacity is
    `ceil(pairs * margin) + 1`, the pairs those of a radius graph at `cutoff + skin`
    (which collects them); no pairs at all leave room for one."""
    y = np.random.default_rng(4).uniform(0, 4, (40, 3))
    neighbours = kdeqx.NeighborList.allocate(y, 1.1, skin=0.3, margin=1.5, **options)
    pairs = int(kdeqx.radius_graph(y, 1.4, 2000, **options).count)
    assert pairs > 0
    assert neighbours.max_edges == int(np.ceil(pairs * 1.5)) + 1
    assert int(neighbours.edges.count) == pairs and not bool(neighbours.overflow)
    lonely = kdeqx.NeighborList.allocate(y[:1], 1.1, skin=0.3)
    assert lonely.max_edges == 1 and int(lonely.edges.count) == 0


@pytest.mark.parametrize(
    "case, searches, counts",
    [
        ("uniform in its cell", 1, 0),
        ("clustered in its cell", 2, 0),
        ("free space", 1, 0),
        ("batch", 1, 0),
        ("a cell per system", 1, 0),
        ("periodic along two axes", 1, 1),
    ],
)
def test_capacity_guessed_from_the_density(case, searches, counts, monkeypatch):
    """The pairs are collected into a capacity guessed from the density (of each
    system of a batch) and cut to size: one search where the guess holds them;
    where it does not (points crowded into a corner of their cell), that search
    counts them and a second collects them; without a guess (a cell periodic along
    some axes only), a count comes first. The list is the same every way: the radius
    graph's edges, in the capacity sized from them."""
    from kdeqx._graph import _neighbor_list

    rng = np.random.default_rng(5)
    cell = np.diag([4.0, 4.0, 4.0])
    options = {"cell": cell}
    y = rng.uniform(0, 4, (64, 3))
    if case == "clustered in its cell":
        y = y / 4
    elif case == "free space":
        options = {}
    elif case == "batch":
        options = {"batch": np.repeat([0, 1], 32)}
    elif case == "a cell per system":
        y[32:] *= 1.25
        cells = np.stack([cell, 1.25 * cell])
        options = {"cell": cells, "batch": np.repeat([0, 1], 32)}
    elif case == "periodic along two axes":
        options = {"cell": cell, "pbc": (True, True, False)}
    calls = {"searches": 0, "counts": 0}

    def counted(name, f):
        def call(*args):
            calls[name] += 1
            return f(*args)

        return call

    for name, attribute in [
        ("searches", "_pairs_in_reach"),
        ("counts", "_count_in_reach"),
    ]:
        f = getattr(_neighbor_list, attribute)
        monkeypatch.setattr(_neighbor_list, attribute, counted(name, f))
    neighbours = kdeqx.NeighborList.allocate(y, 0.9, skin=0.3, margin=1.5, **options)
    assert calls == {"searches": searches, "counts": counts}
    fresh = kdeqx.radius_graph(y, 1.2, 4000, **options)
    pairs = int(fresh.count)
    assert neighbours.max_edges == int(np.ceil(pairs * 1.5)) + 1
    assert int(neighbours.edges.count) == pairs and not bool(neighbours.overflow)
    every = np.ones(neighbours.max_edges, bool)
    assert edges_within(neighbours.edges, every, 64) == edges_within(
        fresh, fresh.edge_mask(), 64
    )
    padding = np.asarray(neighbours.edges.senders) == 64
    assert padding.sum() == neighbours.max_edges - pairs
    assert np.all(np.asarray(neighbours.edges.receivers)[padding] == 64)
    assert np.all(np.isinf(np.asarray(neighbours.edges.distances)[padding]))


def test_overflow_is_reported_and_reallocate_makes_room():
    rng = np.random.default_rng(1)
    y = rng.uniform(0, 4, (50, 3)).astype(np.float32)
    neighbours = kdeqx.NeighborList.allocate(y, 1.2, skin=0.2, cell=CELL, max_edges=400)
    assert not bool(neighbours.overflow)
    squeezed = y * 0.6  # denser: more pairs than the capacity
    neighbours = jax.jit(lambda n, y: n.update(y))(neighbours, squeezed)
    assert bool(neighbours.overflow)
    assert int(neighbours.edges.count) > neighbours.max_edges
    bigger = neighbours.reallocate(squeezed)
    assert not bool(bigger.overflow)
    assert bigger.max_edges >= int(neighbours.edges.count)


@pytest.mark.parametrize("engine", ["walk", "blocks", "blocks, the TPU's appends"])
def test_vmap_over_systems_with_a_shared_capacity(engine, monkeypatch, request):
    if engine == "blocks, the TPU's appends":  # its rounds of slots under vmap
        monkeypatch.setattr(
            _traverse, "scatters_element_by_element", lambda b=None: True
        )
        jax.clear_caches()  # read when the update is traced
        request.addfinalizer(jax.clear_caches)
        engine = "blocks"
    rng = np.random.default_rng(2)
    ys = rng.uniform(0, 4, (3, 40, 3)).astype(np.float32)
    lists = [
        kdeqx.NeighborList.allocate(
            y, 1.3, skin=0.3, cell=CELL, max_edges=1500, engine=engine
        )
        for y in ys
    ]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *lists)
    moved = ys + rng.normal(0, 0.2, ys.shape).astype(np.float32)  # beyond skin / 2
    updated = jax.vmap(lambda n, y: n.update(y))(stacked, moved)
    for b in range(3):
        one = jax.tree.map(lambda a: a[b], updated)
        assert not bool(one.overflow)
        fresh = kdeqx.radius_graph(moved[b], 1.3, 4000, cell=CELL)
        mask = one.within_cutoff(moved[b])
        assert edges_within(one.edges, mask, 40) == edges_within(
            fresh, fresh.edge_mask(), 40
        )


def test_bad_input():
    y = np.random.default_rng(3).random((10, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="skin"):
        kdeqx.NeighborList.allocate(y, 0.5, skin=-0.1)
    with pytest.raises(ValueError, match="cutoff"):
        kdeqx.NeighborList.allocate(y, 0.0, skin=0.1)
    with pytest.raises(ValueError, match="margin"):
        kdeqx.NeighborList.allocate(y, 0.5, skin=0.1, margin=0.5)
    neighbours = kdeqx.NeighborList.allocate(y, 0.5, skin=0.1)
    with pytest.raises(ValueError, match="shape"):
        neighbours.update(y[:5])
