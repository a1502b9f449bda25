"""A GNN-style batch of periodic crystals, each in a triclinic cell of its own, as one
radius graph and one jraph batch.

Eight crystals of different cells and atom counts lie in one array of atoms, with a
system id per atom (`batch`) and one cell per system (`cell` of shape `(8, 3, 3)`).
One `kdeqx.radius_graph` call finds every pair within the cutoff, each through its
own crystal's periodic images; the edges are checked against a numpy brute force
over each crystal's images on its own. `to_jraph` turns the graph into jraph's padded
batch: one graph per crystal and a padding graph. A toy energy per crystal, summed
over its edges, is differentiated with respect to the atoms and the cells (forces
and stress per crystal) inside `jit`.

    python examples/crystals.py            # seconds on a CPU
    KDEQX_FULL=1 python examples/crystals.py
"""

import itertools
import os

import jax
import jax.numpy as jnp
import jraph
import numpy as np

import kdeqx


FULL = bool(os.environ.get("KDEQX_FULL"))
CRYSTALS = 64 if FULL else 8
CUTOFF = 3.0
# Room for every edge: at most about 60 neighbours per atom at this cutoff.
EDGES_PER_ATOM = 60


def crystal(rng):
    """A supercell of a random triclinic cell with a basis of one to three atoms,
    shaken a little: `(atoms, cell)`, the atoms anywhere (some outside the cell,
    which the graph wraps)."""
    primitive = np.diag(rng.uniform(2.4, 3.2, 3))
    primitive += np.tril(rng.uniform(-0.8, 0.8, (3, 3)), -1)
    basis = rng.random((rng.integers(1, 4), 3))
    repeats = rng.integers(2, 4, 3)
    cells = np.array(list(itertools.product(*(range(m) for m in repeats))))
    fractional = (cells[:, None] + basis[None]).reshape(-1, 3) / repeats
    cell = repeats[:, None] * primitive
    atoms = fractional @ cell + rng.normal(0, 0.05, (len(fractional), 3))
    return atoms, cell


def brute_force(atoms, cell, cutoff):
    """Every `(i, j, S)` with `|x_j - x_i + S @ cell| <= cutoff`, `i != j` or `S != 0`,
    over two images on either side (the cells' heights exceed the cutoff)."""
    table = np.array(list(itertools.product(range(-2, 3), repeat=3)))
    diff = atoms[None, :, None] - atoms[:, None, None] + (table @ cell)[None, None]
    i, j, s = np.nonzero(np.linalg.norm(diff, axis=-1) <= cutoff)
    keep = (i != j) | table[s].any(axis=1)
    return {(a, b, tuple(t)) for a, b, t in zip(i[keep], j[keep], table[s[keep]])}


def energy(atoms, cells, graph, batch):
    """A toy pair energy per crystal: `sum exp(-r**2 / 2)` over its edges, through
    the edge vectors in each crystal's own cell (differentiable in both)."""
    vectors = graph.edge_vectors(atoms, cells)
    pairs = jnp.where(graph.edge_mask(), jnp.exp(-jnp.sum(vectors**2, -1) / 2), 0)
    system = jnp.asarray(batch)[jnp.minimum(graph.senders, len(batch) - 1)]
    return jax.ops.segment_sum(pairs, system, CRYSTALS)


def main():
    rng = np.random.default_rng(0)
    systems = [crystal(rng) for _ in range(CRYSTALS)]
    sizes = [len(atoms) for atoms, _ in systems]
    atoms = np.concatenate([a for a, _ in systems]).astype(np.float32)
    cells = np.stack([c for _, c in systems]).astype(np.float32)
    batch = np.repeat(np.arange(CRYSTALS), sizes)  # sorted: jraph's graphs are runs

    graph = kdeqx.radius_graph(
        atoms, CUTOFF, EDGES_PER_ATOM * len(atoms), cell=cells, batch=batch
    )
    assert not bool(graph.overflow)
    print(
        f"{CRYSTALS} crystals of {min(sizes)} to {max(sizes)} atoms ({len(atoms)} in "
        f"all), one radius_graph call: {int(graph.count)} edges"
    )

    live = np.asarray(graph.edge_mask())
    found = set(
        zip(
            np.asarray(graph.senders)[live].tolist(),
            np.asarray(graph.receivers)[live].tolist(),
            map(tuple, np.asarray(graph.shifts)[live].tolist()),
        )
    )
    expected, per_crystal = set(), []
    start = 0
    for (crystal_atoms, cell), size in zip(systems, sizes):
        own = brute_force(atoms[start : start + size].astype(np.float64), cell, CUTOFF)
        expected |= {(i + start, j + start, s) for i, j, s in own}
        per_crystal.append(len(own))
        start += size
    print(f"edges equal a brute force over each crystal's images: {found == expected}")
    assert found == expected

    species = jax.nn.one_hot(jnp.arange(len(atoms)) % 3, 3)
    graphs = graph.to_jraph(
        species,
        edges=graph.distances[:, None],
        globals=jnp.zeros((CRYSTALS + 1, 1)),
    )
    n_node, n_edge = np.asarray(graphs.n_node), np.asarray(graphs.n_edge)
    print(
        f"jraph batch of {len(n_node) - 1} graphs and a padding graph: "
        f"n_node {n_node.tolist()}, n_edge {n_edge.tolist()}"
    )
    counts_match = n_node[:-1].tolist() == sizes and n_edge[:-1].tolist() == (
        per_crystal
    )
    print(f"n_node and n_edge equal each crystal's atoms and edges: {counts_match}")
    assert counts_match
    assert isinstance(graphs, jraph.GraphsTuple)

    @jax.jit
    def forces_and_stress(atoms, cells):
        def total(atoms, cells):
            return jnp.sum(energy(atoms, cells, graph, batch))

        return jax.grad(total, argnums=(0, 1))(atoms, cells)

    forces, stress = forces_and_stress(atoms, cells)
    finite = bool(np.isfinite(forces).all() and np.isfinite(stress).all())
    print(
        f"forces {forces.shape} and stress {stress.shape} (one per cell) through the "
        f"graph, all finite: {finite}"
    )
    assert finite


if __name__ == "__main__":
    main()
