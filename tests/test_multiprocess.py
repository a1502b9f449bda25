"""Two JAX processes on localhost (`jax.distributed`, gloo collectives, two CPU
devices each): a `KDTree`'s queries split over this process's devices only, so its
answers can be read where they were asked; a `ShardedKDTree` over this process's
devices works alongside. Both against scipy."""

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
