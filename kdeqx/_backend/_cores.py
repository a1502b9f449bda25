"""CPU devices: one per core. XLA:CPU splits each large kernel of a program over the
cores (its intra-op thread pool). Queries split over the CPU's devices, one per
core, already keep every core busy: the split then only costs, as every kernel waits
for its slowest part and the devices' parts contend for the same cores. Compiled
without it, kNN queries split over one device per core ran faster, and their times
spread far less (see `benchmarks/sharded.py`)."""

import os

import jax


_WITHOUT_KERNEL_SPLITS = {"xla_disable_hlo_passes": "cpu-parallel-task-assigner"}


def device_per_core_options(devices: int) -> dict[str, str]:
    """XLA compiler options for a program whose work is split over `devices` CPU
    devices: without splits of each kernel over the cores when there are at least
    as many devices as cores for this process, none otherwise."""
    return dict(_WITHOUT_KERNEL_SPLITS) if devices >= available_cores() else {}


def available_cores() -> int:
    """The cores this process may run on."""
    sched_getaffinity = getattr(os, "sched_getaffinity", None)
    if sched_getaffinity is not None:
        return len(sched_getaffinity(0))
    return os.cpu_count() or 1


def use_every_core() -> int:
    """Gives JAX one CPU device per core this process may use, over which a
    `kdeqx.KDTree` splits its large query batches, each device walking its share with
    its own lanes (see the guide "Scaling"). Call it once, before JAX starts: JAX
    fixes its devices when it runs its first computation. A script or an application
    calls it, not a library.

    **Returns:**

    The number of CPU devices JAX will have.

    **Raises:**

    `RuntimeError` where JAX has already started.
    """
    cores = available_cores()
    try:
        jax.config.update("jax_num_cpu_devices", cores)
    except RuntimeError as error:
        raise RuntimeError(
            "kdeqx.use_every_core() must run before JAX starts, that is before the "
            "first JAX computation or array: call it right after the imports. JAX "
            f"has already started with {jax.local_device_count()} CPU device(s)."
        ) from error
    return cores
