"""Process-level set-ups. Two JAX processes on localhost (`jax.distributed`, gloo
collectives, two CPU devices each): a `KDTree`'s queries split over this process's
devices only, so its answers can be read where they were asked; a `ShardedKDTree` over
this process's devices works alongside; both against scipy. `kdeqx.use_every_core`
before JAX starts, and its error after."""

import os
import socket
import subprocess
import sys

import pytest


_WORKER = """
import sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process
)
assert jax.device_count() == 4 and jax.local_device_count() == 2
import numpy as np
from jax.sharding import Mesh
from scipy.spatial import cKDTree
import kdeqx

rng = np.random.default_rng(process)
points, x = rng.random((3000, 3)), rng.random((1500, 3))
expected_d, expected_i = cKDTree(points).query(x, 8)
tree = kdeqx.KDTree(points)
d, i = tree.query(x, 8)
np.testing.assert_array_equal(np.asarray(i), expected_i)
np.testing.assert_allclose(np.asarray(d), expected_d, rtol=1e-5, atol=1e-6)
counts = np.asarray(tree.count_ball_point(x, 0.1))
np.testing.assert_array_equal(
    counts, cKDTree(points).query_ball_point(x, 0.1, return_length=True)
)
mesh = Mesh(np.array(jax.local_devices()), ("shards",))
sharded = kdeqx.ShardedKDTree(points, mesh=mesh)
d, i = sharded.query(x, 8)
np.testing.assert_array_equal(np.asarray(i), expected_i)
print(f"PASSED {process}")
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.multidevice
def test_two_processes_answer_locally():
    port = _free_port()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(port), str(process)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process in (0, 1)
    ]
    try:
        outputs = [worker.communicate(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    for process, (worker, (out, err)) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, err[-3000:]
        assert f"PASSED {process}" in out


_EVERY_CORE = """
import os, sys
import kdeqx
import jax
import jax.numpy as jnp
if sys.argv[1] == "before":
    cores = kdeqx.use_every_core()
    assert cores == len(os.sched_getaffinity(0)) == jax.local_device_count(), cores
else:
    jnp.ones(2)  # JAX has started, with one CPU device
    try:
        kdeqx.use_every_core()
    except RuntimeError as error:
        assert "before JAX starts" in str(error), error
    else:
        assert len(os.sched_getaffinity(0)) == 1, "no error after JAX started"
print("done")
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_use_every_core_before_jax_starts_or_says_so(when):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-c", _EVERY_CORE, when],
        capture_output=True,
        text=True,
        env={**env, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    assert result.returncode == 0 and "done" in result.stdout, result.stderr[-2000:]
