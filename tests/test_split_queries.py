"""Queries split over several devices (a `shard_map` over query rows, `jit` with
sharded inputs, a `KDTree`'s own split over CPU devices), against one device.

The checks are `check_*` functions in `test_sharded.py`, run here in a fresh process
with 4 simulated CPU devices: a file of their own, so that a second pytest worker
runs them beside the sharded-tree checks.
"""

import subprocess

import pytest

from .test_sharded import assert_passed, run_checks, SPLIT_QUERY_CHECKS


@pytest.fixture(scope="module")
def split_checks() -> subprocess.CompletedProcess:
    return run_checks(*SPLIT_QUERY_CHECKS)


@pytest.mark.multidevice
def test_shard_map_over_queries_keeps_their_sharding(split_checks):
    assert_passed(split_checks, "shard_map_queries")


@pytest.mark.multidevice
def test_queries_split_over_cpu_devices_match_one_device(split_checks):
    assert_passed(split_checks, "cpu_split")


@pytest.mark.multidevice
def test_jit_over_split_queries(split_checks):
    assert_passed(split_checks, "jit_queries")


@pytest.mark.multidevice
def test_jit_over_split_queries_on_an_explicit_mesh(split_checks):
    assert_passed(split_checks, "jit_queries_explicit")
