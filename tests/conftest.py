import os
import shutil
import subprocess
import sys
import tempfile

import equinox as eqx
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from .helpers import SUITE_XLA_FLAGS, x64


def _jaxlib_accepts(flags: str) -> bool:
    """Whether XLA starts with `flags` (it aborts on a flag it does not know)."""
    probe = "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.ones(2))"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return result.returncode == 0


def pytest_configure(config):
    # Before any backend starts here, and before xdist starts its workers, which
    # inherit this environment.
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    if "XLA_FLAGS" not in os.environ and _jaxlib_accepts(SUITE_XLA_FLAGS):
        os.environ["XLA_FLAGS"] = SUITE_XLA_FLAGS
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.stash[_CACHE_DIR] = _share_compiled_programs()


def pytest_unconfigure(config):
    cache = config.stash.get(_CACHE_DIR, None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


_CACHE_DIR = pytest.StashKey[str]()


def _share_compiled_programs() -> str:
    """Points JAX's persistent compilation cache at a fresh folder for this run.

    Tests compile many identical programs (the same query on the same shapes, in
    another test's `jit`, another xdist worker or a subprocess); with a cache shared
    by every process of the run each is compiled once (`docs/design-decisions.md`,
    "The test suite"). The folder starts empty, so a run never reuses programs from an
    earlier one, and is removed at the end. Counting compiles still works: a cache hit
    is reported as a compile (`_compiles` in `test_sharded.py`).
    """
    cache = tempfile.mkdtemp(prefix="kdeqx-test-programs-")
    settings = {
        "jax_compilation_cache_dir": cache,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)  # for workers and subprocesses
        jax.config.update(name, value)  # for this process (`-n 0`)
    return cache


# The suite runs as users do by default, with x64 off. A test that needs float64 (one
# with a float64 parameter, or marked `x64`) runs with it on.


def _is_float64(value) -> bool:
    if value is None or isinstance(value, bool | int | str | tuple | list | dict):
        return False
    try:
        return np.dtype(value) == np.float64
    except TypeError:
        return False


def _needs_x64(item: pytest.Item) -> bool:
    if item.get_closest_marker("x64") is not None:
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(map(_is_float64, callspec.params.values()))


# Linux limits a process's memory maps (`vm.max_map_count`, 65,530 by default). Every
# compiled program stays mapped while a cache holds it, and XLA crashes (a segfault or
# an abort while compiling) when a map fails. The whole suite in one process compiles
# more than that: the caches are emptied before it gets close.
_MAX_MAPS = 40_000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _compiled_programs_released():
    yield
    if _memory_maps() > _MAX_MAPS:
        eqx.clear_caches()
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _x64_where_needed(request):
    if _needs_x64(request.node):
        with x64(True):
            yield
    else:
        assert not jax.config.read("jax_enable_x64")
        yield


# A modest number of examples in CI, the same ones every run (a red CI must mean a
# change broke something); `KDEQX_HYPOTHESIS_PROFILE=long` for a deep, random run.
settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", parent=settings.get_profile("ci"), max_examples=500, derandomize=False
)
settings.load_profile(os.environ.get("KDEQX_HYPOTHESIS_PROFILE", "ci"))
