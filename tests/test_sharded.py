"""Several devices: queries split over devices, and `ShardedKDTree` over split points.

Everything is compared against one `KDTree` on one device. JAX fixes its device count
when it starts and the rest of the suite runs on one device, so the multi-device checks
(`tests/multidevice_checks.py`) run under pytest in a fresh process with 4 simulated
CPU devices, and each test here reads that run's report.
"""

import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np
import pytest

from .multidevice_checks import _assert_same


NUM_DEVICES = 4


CHECKS = pathlib.Path(__file__).with_name("multidevice_checks.py")


def run_checks(*names: str, **env: str) -> subprocess.CompletedProcess:
    """Runs `test_<name>` of `multidevice_checks.py` for each name under pytest, in a
    fresh process with 4 CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "")  # the suite's (`conftest.py`)
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={NUM_DEVICES}",
        "JAX_PLATFORMS": "cpu",
        **env,
    }
    selected = " or ".join(f"test_{name}" for name in names)
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(CHECKS), "-n", "0", "-rA", "-k", selected],
        capture_output=True,
        text=True,
        env=env,
        cwd=CHECKS.parent.parent,
        timeout=900,
    )


def assert_passed(result: subprocess.CompletedProcess, name: str) -> None:
    """That pytest's report of the child run says `test_<name>` passed."""
    output = result.stdout + result.stderr
    passed = f"PASSED tests/multidevice_checks.py::test_{name}"
    assert passed in result.stdout, f"check {name!r} failed:\n{output[-6000:]}"


# Compiling dominates these checks, and a process start costs seconds, so each group
# shares one process, which reports each check as PASSED or FAILED. The checks of
# queries split over devices run in `test_split_queries.py`, so that a second pytest
# worker runs them alongside these.
SHARDED_TREE_CHECKS = (
    "sharded_tree",
    "sharded_blocks_engine",
    "sharded_communication",
    "sharded_ball_and_interpolator",
    "sharded_pairs",
)
SPLIT_QUERY_CHECKS = (
    "shard_map_queries",
    "jit_queries",
    "jit_queries_explicit",
    "cpu_split",
)


@pytest.fixture(scope="module")
def shared_checks() -> subprocess.CompletedProcess:
    return run_checks(*SHARDED_TREE_CHECKS)


# --- Run in this process (one device) ---


def _one_device_mesh():
    return jax.make_mesh((1,), ("shards",))


def test_empty_tree_answers_sentinels():
    import kdeqx
    from kdeqx._tree._sharded import ShardedKDTree

    points, x = np.zeros((0, 2)), np.random.default_rng(0).random((9, 2))
    sharded, tree = ShardedKDTree(points, _one_device_mesh()), kdeqx.KDTree(points)
    for ours, ref in zip(sharded.query(x, 4), tree.query(x, 4), strict=True):
        np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(sharded.count_ball_point(x, 0.3), np.zeros(9))


def test_bad_construction_raises():
    from kdeqx._tree._sharded import ShardedKDTree

    mesh = _one_device_mesh()
    points = np.zeros((5, 2))
    with pytest.raises(TypeError, match="Mesh"):
        ShardedKDTree(points, "shards")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        ShardedKDTree(points, mesh, "points")
    with pytest.raises(ValueError, match=r"shape \(n, d\)"):
        ShardedKDTree(np.zeros(5), mesh)
    with pytest.raises(ValueError, match="finite"):
        ShardedKDTree(np.array([[0.0, np.nan]]), mesh)
    with pytest.raises(ValueError, match="finite"):
        ShardedKDTree(points, mesh, box=np.inf)
    with pytest.raises(ValueError, match="leaf_size"):
        ShardedKDTree(points, mesh, leaf_size=0)


def test_bad_queries_raise():
    from kdeqx._tree._sharded import ShardedKDTree

    tree = ShardedKDTree(np.random.default_rng(0).random((20, 2)), _one_device_mesh())
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 2\)"):
        tree.query(np.zeros((3, 3)), 2)
    with pytest.raises(ValueError, match="finite"):
        tree.query(np.array([[0.0, np.inf]]), 2)
    with pytest.raises(ValueError, match=">= 1"):
        tree.query(x, 0)
    with pytest.raises(ValueError, match="batch shape"):
        tree.count_ball_point(x, np.ones(4))
    with pytest.raises(ValueError, match=">= 0"):
        tree.count_ball_point(x, -1.0)
    with pytest.raises(ValueError, match="one row per point"):
        tree.interpolate(x, np.ones(19))
    with pytest.raises(ValueError, match="finite"):
        tree.interpolate(x, np.full(20, np.nan))
    with pytest.raises(ValueError, match="length_scale"):
        tree.interpolate(x, np.ones(20), kernel="gaussian")
    with pytest.raises(ValueError, match="length_scale"):
        tree.interpolate(x, np.ones(20), kernel="gaussian", length_scale=0.0)
    # The runtime type checker of the test suite may reject the Literal first.
    with pytest.raises((ValueError, TypeError), match="kernel"):
        tree.interpolate(x, np.ones(20), kernel="cubic")  # pyright: ignore
    empty = ShardedKDTree(np.zeros((0, 2)), _one_device_mesh())
    with pytest.raises(ValueError, match="empty"):
        empty.interpolate(x, np.zeros(0))


def test_one_device_ball_query_and_interpolator_match_one_tree():
    import kdeqx
    from kdeqx._tree._sharded import ShardedKDTree

    rng = np.random.default_rng(5)
    points, x = rng.random((50, 2)), rng.random((7, 2))
    values = rng.standard_normal((50, 3))
    sharded = ShardedKDTree(points, _one_device_mesh())
    tree = kdeqx.KDTree(points)

    @eqx.filter_jit  # one program per tree: compiling is what costs
    def answers(t):
        balls = [t.query_ball_point(x, 0.3, capacity) for capacity in (1, 4, 64)]
        fields = [
            kdeqx.Interpolator(t, values, k=3)(x),
            *(t.interpolate(x, values, k=12, kernel=kind) for kind in ("rbf", "mls")),
        ]
        return balls, fields

    ours, reference = answers(sharded), answers(tree)
    _assert_same(ours[0], reference[0])
    for field, expected in zip(ours[1], reference[1], strict=True):
        _assert_same(field, expected, exact=False)
    empty = ShardedKDTree(np.zeros((0, 2)), _one_device_mesh())
    distances, indices, counts = empty.query_ball_point(x, 1.0, 3)
    assert np.all(np.isinf(distances)) and np.all(indices == 0)
    assert np.all(counts == 0)
    with pytest.raises(Exception, match="max_neighbors=1"):
        sharded.query_ball_point(x, 0.3, 1, raise_on_overflow=True)


# --- Run in a fresh process with 4 devices ---


@pytest.mark.multidevice
def test_sharded_tree_matches_one_tree(shared_checks):
    assert_passed(shared_checks, "sharded_tree")


@pytest.mark.multidevice
def test_sharded_tree_with_the_block_engine_matches_one_tree(shared_checks):
    assert_passed(shared_checks, "sharded_blocks_engine")


@pytest.mark.multidevice
def test_sharded_tree_communicates_only_candidates(shared_checks):
    assert_passed(shared_checks, "sharded_communication")


@pytest.mark.multidevice
def test_sharded_ball_queries_and_interpolator_match_one_tree(shared_checks):
    assert_passed(shared_checks, "sharded_ball_and_interpolator")


@pytest.mark.multidevice
def test_sharded_pairs_and_counts_match_one_tree(shared_checks):
    assert_passed(shared_checks, "sharded_pairs")
