"""Lennard-Jones molecular dynamics in a triclinic periodic cell, with a neighbour
list reused across steps.

A liquid of Lennard-Jones particles (reduced units, density 0.8, cutoff 2.5 sigma,
energy shifted to zero at the cutoff) starts on a sheared lattice with random
velocities and is integrated with velocity Verlet. Forces are `-grad(energy)` through
the neighbour list's edge vectors; the list is updated inside the jitted step and
rebuilt only when some particle has moved more than half the skin. Positions are
wrapped into the cell every step (the shifts follow). The total energy drift is the
integrator's check: it stays small for a small time step.

    python examples/lennard_jones.py            # 512 particles, 500 steps, seconds
    KDEQX_FULL=1 python examples/lennard_jones.py
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import kdeqx


jax.config.update("jax_enable_x64", True)  # for an energy drift worth reading

FULL = bool(os.environ.get("KDEQX_FULL"))
SIDE = 16 if FULL else 8  # particles per lattice row: SIDE**3 in all
STEPS = 5_000 if FULL else 500
STEPS_PER_BLOCK = 100
DT = 0.002
CUTOFF, SKIN, DENSITY = 2.5, 0.3, 0.8
SHEAR = np.array([[1.0, 0.0, 0.0], [0.3, 1.0, 0.0], [-0.2, 0.25, 1.0]])


def pair_energy(r):
    shift = 4 * (CUTOFF**-12 - CUTOFF**-6)
    inside = r < CUTOFF
    safe = jnp.where(inside, r, 1.0)
    return jnp.where(inside, 4 * (safe**-12 - safe**-6) - shift, 0.0)


def potential_energy(x, neighbours, cell):
    """Half the sum over directed edges: each pair is in the list both ways."""
    vectors = neighbours.edges.edge_vectors(x, cell)
    squared = jnp.sum(vectors**2, axis=1)
    r = jnp.sqrt(jnp.where(squared > 0, squared, 1.0))
    return 0.5 * jnp.sum(jnp.where(neighbours.edges.edge_mask(), pair_energy(r), 0.0))


def wrapped(x, cell):
    fractional = x @ jnp.linalg.inv(cell)
    return (fractional - jnp.floor(fractional)) @ cell


def main():
    n = SIDE**3
    length = (n / DENSITY) ** (1 / 3)
    cell = jnp.asarray(SHEAR * length)
    grid = np.stack(np.meshgrid(*[np.arange(SIDE)] * 3, indexing="ij"), -1)
    x = jnp.asarray((grid.reshape(-1, 3) + 0.5) / SIDE) @ cell
    v = jax.random.normal(jax.random.key(0), (n, 3)) * np.sqrt(1.0)
    v = v - v.mean(axis=0)
    neighbours = kdeqx.NeighborList.allocate(x, CUTOFF, skin=SKIN, cell=cell)
    force = jax.grad(lambda x, nl: -potential_energy(x, nl, cell))

    @jax.jit
    def block(state):
        def step(state, _):
            x, v, f, neighbours = state
            v = v + 0.5 * DT * f
            x = wrapped(x + DT * v, cell)
            neighbours = neighbours.update(x)
            f = force(x, neighbours)
            v = v + 0.5 * DT * f
            return (x, v, f, neighbours), None

        return jax.lax.scan(step, state, None, STEPS_PER_BLOCK)[0]

    def total_energy(x, v, neighbours):
        return potential_energy(x, neighbours, cell) + 0.5 * jnp.sum(v**2)

    state = (x, v, force(x, neighbours), neighbours)
    start_energy = float(total_energy(x, v, neighbours))
    start = time.perf_counter()
    for _ in range(STEPS // STEPS_PER_BLOCK):
        previous = state
        state = block(state)
        if bool(state[3].overflow):  # redo the block with a larger list
            x = previous[0]
            state = (*previous[:3], previous[3].reallocate(x))
            state = block(state)
    x, v, _, neighbours = jax.block_until_ready(state)
    elapsed = time.perf_counter() - start
    end_energy = float(total_energy(x, v, neighbours))
    drift = abs(end_energy - start_energy) / abs(start_energy)
    print(
        f"{n} particles, {STEPS} steps in {elapsed:.2f} s "
        f"({int(neighbours.builds)} list builds, capacity {neighbours.max_edges}): "
        f"energy per particle {start_energy / n:.4f} -> {end_energy / n:.4f}, "
        f"relative drift {drift:.1e}"
    )
    assert drift < 1e-2, "velocity Verlet should conserve energy at this time step"


if __name__ == "__main__":
    main()
