"""Queries split over 2 CPU devices against 1 device, in one run.

    python benchmarks/sharded.py [--n 2e5] [--queries 2e5] [--k 8] [--repeats 3]
                                 [--rounds 2]

JAX fixes its device count at start-up, so each device count runs in its own process
(`XLA_FLAGS=--xla_force_host_platform_device_count=D`), on the same data; this script
starts them alternately, `--rounds` times each (so that a change in the machine's load
hits both alike), and prints the best times side by side:

- `split queries`: one `KDTree` replicated on every device, the queries split over the
    devices with `jax.shard_map`: each device answers its share, nothing is
    communicated.
- `split queries, plain jit`: the same, but relying on `jax.jit` alone to keep the
    queries' sharding. Today the queries' finiteness check (`eqx.error_if`) gathers
    them, so every device answers every query; see docs/scaling.md.
- `ShardedKDTree`: the points split over the devices, one tree each; every device
    searches its tree for every query and the `k` candidates are all-gathered and
    merged. On 1 device this is one tree plus the merge.

Times are steady (best of `--repeats` calls in each of `--rounds` processes, after a
warm-up). A CPU "device" is a thread
pool of the same process: two devices can use at most the machine's two cores, and
the machine is shared, so read the ratios, not the absolute times.
"""

import argparse
import json
import os
import subprocess
import sys

from _timing import best_of


def warm_best_of(fn, repeats):
    import jax

    jax.block_until_ready(fn())  # warm-up: compile
    return best_of(fn, repeats)


def measure(n, q, k, repeats):
    """Runs in a process with the device count already fixed; returns times (s)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import kdeqx
    from kdeqx._tree._sharded import ShardedKDTree

    devices = jax.device_count()
    rng = np.random.default_rng(0)
    points = rng.random((n, 3), np.float32)
    x = rng.random((q, 3), np.float32)
    mesh = jax.make_mesh((devices,), ("d",), axis_types=(AxisType.Auto,))
    replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    tree = jax.device_put(kdeqx.KDTree(points), replicated)
    x_split = jax.device_put(x, by_rows)

    def query(tree, x):
        return tree.query(x, k)

    # `check_vma=False`: the tree's `eqx.error_if` checks use a host callback.
    split = jax.jit(
        jax.shard_map(
            query, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"), check_vma=False
        )
    )
    plain = jax.jit(query)
    reference = jax.jit(query)(kdeqx.KDTree(points), x)

    build = jax.jit(lambda p: ShardedKDTree(p, mesh, "d"))
    sharded = build(points)
    sharded_query = jax.jit(query)
    for answer in (split(tree, x_split), sharded_query(sharded, x)):
        assert np.array_equal(answer[1], reference[1]), "answers differ"

    return {
        "devices": devices,
        "split queries": warm_best_of(lambda: split(tree, x_split), repeats),
        "split queries, plain jit": warm_best_of(lambda: plain(tree, x_split), repeats),
        "ShardedKDTree build": warm_best_of(lambda: build(points), repeats),
        "ShardedKDTree query": warm_best_of(lambda: sharded_query(sharded, x), repeats),
    }


def run_with_devices(devices, args):
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}",
    }
    command = [
        sys.executable,
        __file__,
        "--worker",
        f"--n={args.n}",
        f"--queries={args.queries}",
        f"--k={args.k}",
        f"--repeats={args.repeats}",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stdout + result.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=float, default=2e5)
    parser.add_argument("--queries", type=float, default=2e5)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.n, args.queries = int(args.n), int(args.queries)
    if args.worker:
        print(json.dumps(measure(args.n, args.queries, args.k, args.repeats)))
        return

    import jax

    load = ", ".join(f"{avg:.1f}" for avg in os.getloadavg())
    print(
        f"device: cpu, jax {jax.__version__}, {os.cpu_count()} CPU cores, load average "
        f"{load} at start (a shared machine: compare ratios, not absolute times)"
    )
    print(
        f"n = {args.n:,} points, {args.queries:,} queries, d = 3, float32 uniform in "
        f"the unit cube, k = {args.k}; best of {args.repeats} calls x {args.rounds} "
        "alternating processes per device count, after a warm-up; answers checked "
        "equal to one KDTree"
    )
    one, two = {}, {}
    for _ in range(args.rounds):
        for best, devices in ((one, 1), (two, 2)):
            for name, seconds in run_with_devices(devices, args).items():
                best[name] = min(best.get(name, seconds), seconds)
    print(f"{'':28}{'1 device':>12}{'2 devices':>12}{'1 / 2':>9}")
    for name in one:
        if name != "devices":
            ratio = one[name] / two[name]
            print(f"{name:28}{one[name]:11.3f}s{two[name]:11.3f}s{ratio:8.2f}x")


if __name__ == "__main__":
    main()
