"""Molecular dynamics that stops when its neighbour list overflows, reallocates the
list and carries on, losing no step.

A `NeighborList` has a fixed capacity (`max_edges`), sized when it is allocated
outside `jit`. A rebuild inside `jit` that finds more pairs than fit sets `overflow`
and keeps only some of them: the forces are then wrong, and a loop that does not
look runs on with them to the end. Here a cold Lennard-Jones gas (reduced units,
cutoff 2.5 sigma, energy shifted to zero there) condenses into droplets, so each
particle gathers neighbours and the pair count grows; the list is allocated with a
tight margin for the gas.

The steps run in chunks, each a jitted `lax.while_loop` that takes a step and keeps
it only if its list did not overflow: at the first one that did, the loop stops with
the state before that step. On the host, `reallocate` sizes the list again for those
positions (with the default margin), and the next chunk continues from there. Each
capacity is a new shape and so a new compilation: the margin trades memory against
these.

Two checks: the total energy is conserved, and the trajectory equals that of the
same run with a list allocated large enough from the start.

    python examples/md_overflow.py                        # 216 particles, seconds
    python examples/md_overflow.py --side 12 --steps 3000
    KDEQX_FULL=1 python examples/md_overflow.py
"""

import argparse
import os
import time

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

import kdeqx


jax.config.update("jax_enable_x64", True)  # for an energy drift worth reading

FULL = bool(os.environ.get("KDEQX_FULL"))
DT = 0.005
CUTOFF, SKIN = 2.5, 0.3
DENSITY, TEMPERATURE = 0.4, 0.3  # a gas cold enough to condense
GAS_MARGIN = 1.05  # tight, so that a short run overflows (the default is 1.25)
CHUNK = 200  # steps per call of the jitted loop: the host looks in between


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


def force(x, neighbours, cell):
    return -jax.grad(potential_energy)(x, neighbours, cell)


@jax.jit
def total_energy(state, cell):
    x, v, _, neighbours = state
    return potential_energy(x, neighbours, cell) + 0.5 * jnp.sum(v**2)


def wrapped(x, cell):
    fractional = x @ jnp.linalg.inv(cell)
    return (fractional - jnp.floor(fractional)) @ cell


def verlet_step(state, cell):
    x, v, f, neighbours = state
    v = v + 0.5 * DT * f
    x = wrapped(x + DT * v, cell)
    neighbours = neighbours.update(x)
    f = force(x, neighbours, cell)
    return x, v + 0.5 * DT * f, f, neighbours


@jax.jit
def advance(state, steps, cell):
    """Up to `steps` steps from `state`, stopping before the first whose list
    overflowed.

    Returns the state after the last step kept, the number of steps kept, the pairs
    that the overflowing rebuild found (zero if none overflowed), and the number of
    steps kept with an overflowed list (zero, unless the selection below is wrong).
    """

    def more(carry):
        done, _, needed, _ = carry
        return (done < steps) & (needed == 0)

    def step(carry):
        done, state, _, bad = carry
        trial = verlet_step(state, cell)
        overflow = trial[3].overflow
        state = jax.tree.map(
            lambda old, new: jnp.where(overflow, old, new), state, trial
        )
        needed = jnp.where(overflow, trial[3].edges.count, 0)
        return done + (~overflow), state, needed, bad + state[3].overflow

    zero = jnp.zeros((), jnp.int32)
    needed = jnp.zeros_like(state[3].edges.count)
    done, state, needed, bad = lax.while_loop(more, step, (zero, state, needed, zero))
    return state, done, needed, bad


def run(state, steps, cell):
    """`steps` steps from `state`, reallocating the list whenever it overflows.

    Returns the final state, the steps done, the capacities used, the steps kept
    with an overflowed list, and the total energy after each chunk.
    """
    done, capacities, bad, energies = 0, [state[3].max_edges], 0, []
    reallocated = False
    while done < steps:
        state, kept, needed, overflowed = advance(state, min(CHUNK, steps - done), cell)
        done, bad = done + int(kept), bad + int(overflowed)
        if int(needed):
            if reallocated and not int(kept):  # no progress: never loop for ever
                raise RuntimeError("The list overflowed where it was sized.")
            x, v, f, neighbours = state
            state = (x, v, f, neighbours.reallocate(x))
            capacities.append(state[3].max_edges)
            print(
                f"  step {done + 1} overflowed the list ({int(needed):,} pairs, "
                f"{capacities[-2]:,} places): dropped; reallocated after step {done} "
                f"with {capacities[-1]:,} places"
            )
        reallocated = bool(int(needed))
        energies.append(float(total_energy(state, cell)))
    return state, done, capacities, bad, energies


def nearest_image(difference, cell):
    fractional = difference @ np.linalg.inv(cell)
    return (fractional - np.round(fractional)) @ cell


def main():
    parser = argparse.ArgumentParser(description="MD that reallocates on overflow.")
    parser.add_argument(
        "--side", type=int, default=16 if FULL else 6, help="side**3 particles"
    )
    parser.add_argument("--steps", type=int, default=5_000 if FULL else 300)
    args = parser.parse_args()

    n = args.side**3
    cell = jnp.eye(3) * (n / DENSITY) ** (1 / 3)
    grid = np.stack(np.meshgrid(*[np.arange(args.side)] * 3, indexing="ij"), -1)
    x = jnp.asarray((grid.reshape(-1, 3) + 0.5) / args.side) @ cell
    v = jax.random.normal(jax.random.key(0), (n, 3)) * np.sqrt(TEMPERATURE)
    v = v - v.mean(axis=0)

    def start(**capacity):
        neighbours = kdeqx.NeighborList.allocate(
            x, CUTOFF, skin=SKIN, cell=cell, **capacity
        )
        return (x, v, force(x, neighbours, cell), neighbours)

    state = start(margin=GAS_MARGIN)
    first_pairs = int(state[3].edges.count)
    start_energy = float(total_energy(state, cell))
    print(f"{n} particles, {args.steps} steps of a condensing gas:")
    clock = time.perf_counter()
    state, done, capacities, bad, energies = run(state, args.steps, cell)
    elapsed = time.perf_counter() - clock
    drift = max(abs(e - start_energy) for e in energies) / abs(start_energy)
    print(
        f"{done} of {args.steps} steps done in {elapsed:.2f} s (compiling included); "
        f"reallocations: {len(capacities) - 1} (capacity "
        f"{' -> '.join(f'{c:,}' for c in capacities)}); "
        f"steps kept with an overflowed list: {bad}"
    )
    print(
        f"pairs in the list {first_pairs:,} -> {int(state[3].edges.count):,}; "
        f"energy per particle {start_energy / n:.4f} -> {energies[-1] / n:.4f}, "
        f"largest relative drift {drift:.1e}"
    )

    # The capacity the run ended with, from the start: no reallocation, and the
    # compiled loop is reused.
    reference = start(max_edges=capacities[-1])
    reference, _, room, _, _ = run(reference, args.steps, cell)
    assert len(room) == 1, "the final capacity should hold every build of the run"
    moved = nearest_image(np.asarray(state[0]) - np.asarray(reference[0]), cell)
    faster = np.asarray(state[1]) - np.asarray(reference[1])
    print(
        f"same run with capacity {room[0]:,} from the start (no reallocation): "
        f"positions differ by {np.max(np.abs(moved)):.1e}, "
        f"velocities by {np.max(np.abs(faster)):.1e}"
    )
    assert not bool(state[3].overflow)
    assert drift < 1e-2, "velocity Verlet should conserve energy at this time step"


if __name__ == "__main__":
    main()
