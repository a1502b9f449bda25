"""Neighbour graphs beside matscipy and jax-md, cores matched.

    python benchmarks/graphs.py [--sizes 10000 100000] [--repeats 3] [--cpu-devices 1]

Particles uniform at unit density, the cutoff that gives about 50 neighbours each
(`r = (50 / (4/3 pi))**(1/3)`, 2.29), float32 for the JAX libraries (matscipy is
float64 only). Each row is timed best of `--repeats` with every core, then pinned to
core 0 (`_timing.cores`, as `taskset -c 0`); matscipy is single-threaded.

- `build cubic` / `build triclinic`: the whole graph, both directions, with shifts.
  kdeqx `radius_graph` (jitted) against matscipy `neighbour_list("ijS")` and
  jax-md's `neighbor_list` rebuilt inside `jit` (its `update` with a zero skin, cell
  list on; Dense and Sparse formats; in the triclinic cell `periodic_general` with
  fractional coordinates, as jax-md requires for it).
- `compile`: trace and compile time of `radius_graph` and `knn_graph` for n = 8e3,
  1e5 and 1e6 points (not run).
- `knn cubic`: the 16 nearest images of each point in the cube, kdeqx `knn_graph`
  (jitted) against scipy's periodic `cKDTree`, built and queried for the 17 nearest
  (each point is its own nearest) with `workers=-1`.
- `update`: 100 MD-like steps in one jitted `lax.scan` where nobody moves past half
  the skin (skin 0.3): the list's `update` and a pair energy over the pairs within
  the cutoff, kdeqx `NeighborList` against jax-md's `update` (Dense and Sparse);
  divide by 100 for one step.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from _timing import compile_time, print_matched

import kdeqx


NEIGHBOURS = 50


def cutoff() -> float:
    return (NEIGHBOURS / (4 / 3 * np.pi)) ** (1 / 3)


def system(n: int, triclinic: bool, rng):
    side = n ** (1 / 3)
    if triclinic:  # same volume, tilted
        cell = side * np.array([[1.0, 0, 0], [0.3, 1.0, 0], [-0.2, 0.25, 1.0]])
    else:
        cell = side * np.eye(3)
    fractional = rng.random((n, 3))
    return (fractional @ cell).astype(np.float32), cell.astype(np.float32)


def build_task(n: int, triclinic: bool, rng):
    from matscipy.neighbours import neighbour_list

    x, cell = system(n, triclinic, rng)
    r = cutoff()
    capacity = int(n * NEIGHBOURS * 1.15)
    images = 1  # r is far below the cell heights
    ours = jax.jit(
        lambda x: kdeqx.radius_graph(x, r, capacity, cell=cell, images=images)
    )
    graph = ours(x)
    i, _, _ = neighbour_list(
        "ijS", positions=x.astype(np.float64), cell=cell, pbc=[True] * 3, cutoff=r
    )
    note = f" | edges kdeqx {int(graph.count)} matscipy {len(i)}"
    implementations = {
        "kdeqx": lambda: ours(x).distances,
        "matscipy": lambda: neighbour_list(
            "ijS", positions=x.astype(np.float64), cell=cell, pbc=[True] * 3, cutoff=r
        ),
    }
    rebuilds, edges = _jax_md_rebuilds(x, cell, r, skin=0.0)
    implementations.update(rebuilds)
    note += " jax-md " + " ".join(str(e) for e in edges)
    return implementations, note


def knn_task(n: int, rng):
    """kdeqx `knn_graph` in a periodic cube against scipy's periodic `cKDTree`, and
    how often their receivers agree."""
    from scipy.spatial import cKDTree

    x, cell = system(n, False, rng)
    side = float(cell[0, 0])
    ours = jax.jit(lambda x: kdeqx.knn_graph(x, K_NEAREST, cell=cell))
    wrapped = np.mod(x.astype(np.float64), side)

    def theirs():
        tree = cKDTree(wrapped, boxsize=side)
        return tree.query(wrapped, K_NEAREST + 1, workers=-1)

    receivers = np.asarray(ours(x).receivers).reshape(n, K_NEAREST)
    want = theirs()[1][:, 1:]
    equal = np.mean(np.sort(receivers, axis=1) == np.sort(want, axis=1))
    note = f" | receivers equal scipy's in {equal:.6f} (the rest float32 near-ties)"
    return {"kdeqx": lambda: ours(x).receivers, "scipy": theirs}, note


K_NEAREST = 16


def _jax_md_space(x, cell):
    """jax-md's displacement, box and positions for `cell` (rows = cell vectors): a
    cube as `space.periodic`, any other cell as `space.periodic_general` with
    fractional coordinates (jax-md's box has the cell vectors as columns)."""
    from jax_md import space

    if np.allclose(cell, cell[0, 0] * np.eye(3)):
        side = float(cell[0, 0])
        return space.periodic(side)[0], side, jnp.asarray(x), False
    box = jnp.asarray(cell.T)
    fractional = jnp.asarray((x @ np.linalg.inv(cell)) % 1.0)
    displacement, _ = space.periodic_general(box, fractional_coordinates=True)
    return displacement, box, fractional, True


def _jax_md_lists(x, cell, r, skin):
    from jax_md import partition

    displacement, box, positions, fractional = _jax_md_space(x, cell)
    lists = {}
    for name, form in (
        ("jax-md Dense", partition.Dense),
        ("jax-md Sparse", partition.Sparse),
    ):
        neighbor_fn = partition.neighbor_list(
            displacement,
            box,
            r,
            dr_threshold=skin,
            format=form,
            capacity_multiplier=1.15,
            fractional_coordinates=fractional,
        )
        lists[name] = (neighbor_fn, neighbor_fn.allocate(positions))
    return lists, positions


def _jax_md_rebuilds(x, cell, r, skin):
    """jax-md's list rebuilt inside `jit` (its `update` with a zero skin, for
    positions moved a little), and its edge count, per format."""
    rebuilds, edges = {}, []
    lists, positions = _jax_md_lists(x, cell, r, skin)
    moved = positions + 1e-5
    for name, (neighbor_fn, nbrs) in lists.items():
        update = jax.jit(lambda y, nbrs, fn=neighbor_fn: fn.update(y, nbrs).idx)
        idx = update(moved, nbrs)
        senders = idx[0] if name.endswith("Sparse") else idx
        edges.append(int(jnp.sum(senders < len(x))))
        rebuilds[name] = lambda update=update, nbrs=nbrs: update(moved, nbrs)
    return rebuilds, edges


def update_task(n: int, rng):
    """`STEPS` MD-like steps in one jitted `lax.scan`: every particle moves a little
    (never past half the skin: no rebuild), the list is updated, and a pair energy
    is summed over the pairs within the cutoff; the time is per step."""
    x, cell = system(n, False, rng)
    side, r, skin = float(cell[0, 0]), cutoff(), 0.3
    x = jnp.asarray(x)
    velocity = jnp.asarray(rng.normal(0, 1, x.shape).astype(np.float32))

    def moved(step):
        return x + 1e-3 * jnp.sin(0.1 * step) * velocity

    def pair_energy(distance, inside):
        return jnp.sum(jnp.where(inside, jnp.exp(-distance * distance), 0.0))

    neighbours = kdeqx.NeighborList.allocate(x, r, skin=skin, cell=cell, margin=1.15)

    @jax.jit
    def ours(neighbours):
        def step(neighbours, t):
            y = moved(t)
            neighbours = neighbours.update(y)
            graph = neighbours.graph(y)
            return neighbours, pair_energy(graph.distances, graph.distances < r)

        return jax.lax.scan(step, neighbours, jnp.arange(STEPS))

    implementations = {"kdeqx": lambda: ours(neighbours)[1]}
    from jax_md import space

    displacement, _ = space.periodic(side)
    pairwise = space.map_bond(displacement)
    for name, (neighbor_fn, nbrs) in _jax_md_lists(x, cell, r, skin)[0].items():
        dense = name.endswith("Dense")

        @jax.jit
        def theirs(nbrs, fn=neighbor_fn, dense=dense):
            def step(nbrs, t):
                y = moved(t)
                nbrs = fn.update(y, nbrs)
                if dense:
                    senders = jnp.broadcast_to(jnp.arange(n)[:, None], nbrs.idx.shape)
                    receivers = nbrs.idx
                else:
                    receivers, senders = nbrs.idx
                senders, receivers = senders.reshape(-1), receivers.reshape(-1)
                real = receivers < n
                vectors = pairwise(y[senders], y[jnp.where(real, receivers, 0)])
                distance = jnp.sqrt(jnp.sum(vectors**2, axis=-1) + 1e-30)
                return nbrs, pair_energy(distance, real & (distance < r))

            return jax.lax.scan(step, nbrs, jnp.arange(STEPS))

        implementations[name] = lambda theirs=theirs, nbrs=nbrs: theirs(nbrs)[1]
    energies = {name: float(fn()[0]) for name, fn in implementations.items()}
    builds = int(ours(neighbours)[0].builds)
    note = f" | per {STEPS} steps; builds {builds} (1: none); first energies " + (
        " ".join(f"{e:.6g}" for e in energies.values())
    )
    return implementations, note


STEPS = 100


def compile_times(sizes):
    """Seconds to trace and compile (not run) a radius graph, a kNN graph and a
    list update, per `n`: the programs do not grow with `n`."""
    row = []
    for n in sizes:
        points = jax.ShapeDtypeStruct((n, 3), jnp.float32)
        cell = jnp.eye(3) * n ** (1 / 3)
        radius = compile_time(
            lambda: jax.jit(
                lambda x: kdeqx.radius_graph(x, cutoff(), 60 * n, cell=cell, images=1)
            ),
            points,
        )
        knn = compile_time(
            lambda: jax.jit(lambda x: kdeqx.knn_graph(x, 16, cell=cell)), points
        )
        row.append(f"n={n}: radius_graph {radius:.2f} s, knn_graph {knn:.2f} s")
    print("compile (trace + compile, not run) | " + " | ".join(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=1)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    print(
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__};"
        f" unit density, r = {cutoff():.3f} (~{NEIGHBOURS} neighbours), float32"
    )
    compile_times([1_000 * 2**3, 10**5, 10**6])
    for n in args.sizes:
        rng = np.random.default_rng(0)
        tasks = {
            "build cubic": lambda: build_task(n, False, rng),
            "build triclinic": lambda: build_task(n, True, rng),
            "knn cubic": lambda: knn_task(n, rng),
            "update": lambda: update_task(n, rng),
        }
        for name, make in tasks.items():
            implementations, note = make()
            for fn in implementations.values():
                jax.block_until_ready(fn())  # compiled, warm
            print_matched(f"n={n:<7} {name:<16}", implementations, args.repeats, note)


if __name__ == "__main__":
    main()
