"""Backend tricks against their plain-JAX references, and the internals they serve
(the k-best merge, Morton codes) against numpy, so a failure points at one function."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdeqx import _backend
from kdeqx._engine._merge import (
    best_of_pairs,
    merge_by_networks,
    merge_by_ranks,
    merge_by_reduction,
    merge_into_best,
    merge_k_best,
    pairs_of_best,
    precedes_last,
    SMALL_K,
)
from kdeqx._engine._traverse import morton_codes

from .helpers import DTYPES


def _float32_with_edge_cases(rng, m):
    values = rng.standard_normal(m).astype(np.float32)
    values[: m // 4] = rng.integers(-3, 3, m // 4)  # ties
    # (No subnormals: XLA:CPU flushes them to zero, so they key as 0, which only
    # balances the build's splits differently.)
    tiny = np.finfo(np.float32).tiny
    edge = [0.0, -0.0, np.inf, -np.inf, tiny, -tiny, 3e38]
    values[-len(edge) :] = edge
    return rng.permutation(values)


@pytest.mark.parametrize("m", [0, 1, 7, 1000])
def test_argsort_keys_is_a_stable_argsort(m):
    keys = jnp.asarray(np.random.default_rng(m).integers(0, 5, m), jnp.uint32)
    ours = jax.jit(_backend.argsort_keys)(keys)
    reference = _backend.argsort_keys_reference(keys)
    np.testing.assert_array_equal(ours, reference)
    np.testing.assert_array_equal(ours, np.argsort(np.asarray(keys), stable=True))


def test_float32_sort_keys_order_as_the_values():
    values = _float32_with_edge_cases(np.random.default_rng(0), 200)
    keys = np.asarray(_backend.float32_sort_keys(jnp.asarray(values)))
    order = np.argsort(keys, stable=True)
    np.testing.assert_array_equal(values[order], np.sort(values))
    # -0 and +0 are one key; every other pair of distinct values two.
    assert len(np.unique(keys)) == len(np.unique(values))


def _pairs(rng, m, dtype):
    d2 = rng.integers(0, 4, m).astype(dtype)  # many equal distances
    d2[0] = np.inf
    indices = rng.integers(-1, 6, m).astype(np.int32)
    return jnp.asarray(d2), jnp.asarray(indices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_before_is_the_lexicographic_order(dtype):
    rng = np.random.default_rng(1)
    a, b = _pairs(rng, 40, dtype), _pairs(rng, 9, dtype)
    ours = jax.jit(_backend.pairs_before)(*a, *b)
    reference = _backend.pairs_before_reference(*a, *b)
    np.testing.assert_array_equal(ours, reference)
    expected = [
        [
            (float(a[0][j]), int(a[1][j])) < (float(b[0][i]), int(b[1][i]))
            for j in range(40)
        ]
        for i in range(9)
    ]
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_pick_one_hot_picks_the_marked_entries(dtype):
    rng = np.random.default_rng(2)
    k, m1, m2 = 5, 5, 12
    values1 = jnp.asarray(rng.standard_normal(m1) * 1e30, dtype)
    values2 = jnp.asarray(np.r_[np.inf, rng.standard_normal(m2 - 1)], dtype)
    # Each output slot picks exactly one entry of one of the two sources.
    slot_source = rng.integers(0, 2, k)
    mask1 = np.zeros((k, m1), bool)
    mask2 = np.zeros((k, m2), bool)
    mask1[
        np.flatnonzero(slot_source == 0), rng.integers(0, m1, k)[slot_source == 0]
    ] = 1
    mask2[
        np.flatnonzero(slot_source == 1), rng.integers(0, m2, k)[slot_source == 1]
    ] = 1
    sources = ((jnp.asarray(mask1), values1), (jnp.asarray(mask2), values2))
    ours = jax.jit(_backend.pick_one_hot)(sources)
    np.testing.assert_array_equal(ours, _backend.pick_one_hot_reference(sources))
    expected = [
        (values1[mask1[i]] if slot_source[i] == 0 else values2[mask2[i]])[0]
        for i in range(k)
    ]
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sums_equal_the_reference_sum(dtype):
    terms = np.random.default_rng(3).random((50, 7)).astype(dtype) ** 2
    terms[0] = 0
    terms[1, 3] = np.inf
    reference = np.asarray(_backend.sum_nonnegative_reference(jnp.asarray(terms)))
    for trick in (_backend.sum_nonnegative, _backend.sum_by_additions):
        ours = np.asarray(jax.jit(trick)(jnp.asarray(terms)))
        # Rounding may differ in the order of the additions, not more.
        np.testing.assert_allclose(ours, reference, rtol=8 * np.finfo(dtype).eps)
        np.testing.assert_array_equal(ours[:2], [0, np.inf])
    # Exact for sums that round nowhere, and never below the largest term.
    integers = jnp.asarray(np.random.default_rng(4).integers(0, 9, (20, 5)), dtype)
    np.testing.assert_array_equal(
        _backend.sum_nonnegative(integers), np.sum(integers, -1)
    )
    huge = jnp.asarray([[np.finfo(dtype).max, 1.0, 1.0]], dtype)
    assert _backend.sum_nonnegative(huge)[0] == np.finfo(dtype).max


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(0),
        np.ones((3, 4)),
        np.array([1.0, np.nan]),
        np.array([[np.inf, 0.0]]),
        np.array([-np.inf]),
        np.array([3e38, -3e38], np.float32),
    ],
)
def test_all_finite_is_isfinite_all(array):
    array = jnp.asarray(array)
    expected = bool(np.all(np.isfinite(np.asarray(array))))
    assert bool(jax.jit(_backend.all_finite)(array)) == expected
    assert bool(_backend.all_finite_reference(array)) == expected


def test_move_rows_is_a_scatter_per_row():
    rng = np.random.default_rng(5)
    orders = jnp.asarray(rng.integers(0, 100, (3, 64)), jnp.int32)
    destination = jnp.asarray(np.stack([rng.permutation(64) for _ in range(3)]))
    destination = destination.astype(jnp.int32)
    ours = jax.jit(_backend.move_rows)(orders, destination)
    np.testing.assert_array_equal(
        ours, _backend.move_rows_reference(orders, destination)
    )
    expected = np.zeros((3, 64), np.int32)
    for j in range(3):
        expected[j, np.asarray(destination[j])] = orders[j]
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("dtype", [jnp.uint32, jnp.uint8])  # uint8: 3 x 128 > 255
def test_move_rows_in_place_writes_the_moved_rows_over_the_others(dtype):
    rng = np.random.default_rng(6)
    d, words, width = 3, 16, 8
    m = words * width
    orders = rng.integers(0, 200, (d, m))
    # As in a level of the build: segments of two words, in each the two moved rows
    # come from rows 0 and 2 (in either order; row 1 stays) and each is permuted
    # within the segment.
    first = np.repeat(np.where(rng.random(words // 2) < 0.5, 0, 2), 2)
    rows = np.stack([first, 2 - first])[:, :, None]
    moving = rng.integers(0, 200, (2, m))

    def permuted_within_segments():
        size = 2 * width
        return np.concatenate([rng.permutation(size) + s for s in range(0, m, size)])

    destination = np.stack([permuted_within_segments() for _ in range(2)])
    destination = destination.reshape(2, words, width)
    ours = jax.jit(_backend.move_rows_in_place)(
        jnp.asarray(orders, dtype),
        jnp.asarray(moving, dtype),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(destination, dtype),
    )
    expected = orders.copy()
    flat_rows = np.broadcast_to(rows, destination.shape).reshape(2, m)
    flat_destination = destination.reshape(2, m)
    for r in range(2):
        expected[flat_rows[r], flat_destination[r]] = moving[r]
    np.testing.assert_array_equal(ours, expected)


def test_smallest_first_of_by_a_sort_is_top_k_and_a_gather():
    """The TPU's way (the payload sorted along) against `lax.top_k` and a gather,
    ties (and infinities) taken in order."""
    rng = np.random.default_rng(9)
    x = rng.integers(0, 6, (30, 64)).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = np.inf
    payload = rng.permutation(30 * 64).reshape(30, 64).astype(np.int32)
    args = (jnp.asarray(x), jnp.asarray(payload), 20)
    ours = jax.jit(_backend.smallest_first_of, static_argnums=(2, 3))(*args, "tpu")
    reference = _backend.smallest_first_of_reference(*args)
    order = np.argsort(x, axis=1, kind="stable")[:, :20]
    for a, b, expected in zip(
        ours,
        reference,
        (np.take_along_axis(x, order, 1), np.take_along_axis(payload, order, 1)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, expected)


@pytest.mark.parametrize("tile", [20, 40, 64])  # a word, a prefix sum, words
@pytest.mark.parametrize("count", [0, 3, 7, 8, 11])
def test_append_in_order_by_reductions_is_the_scatter(count, tile):
    """The TPU's way (a reduction per slot) against the scatter, and numpy: the
    entries inside, in order, from slot `count`, those beyond the last dropped."""
    rng = np.random.default_rng(count)
    k = 8
    kept = (
        jnp.asarray(rng.random(k), jnp.float32),
        jnp.asarray(rng.integers(0, 100, k), jnp.int32),
    )
    new = (
        jnp.asarray(rng.random(tile), jnp.float32),
        jnp.asarray(rng.permutation(tile) - 5, jnp.int32),
    )
    for inside in (rng.random(tile) < 0.15, np.zeros(tile, bool), np.ones(tile, bool)):
        args = (kept, new, jnp.asarray(inside), jnp.asarray(count, jnp.int32))
        ours = jax.jit(_backend.append_in_order, static_argnums=4)(*args, "tpu")
        reference = _backend.append_in_order_reference(*args)
        for a, b, old, values in zip(ours, reference, kept, new, strict=True):
            np.testing.assert_array_equal(a, b)
            expected = np.asarray(old).copy()
            chosen = np.asarray(values)[inside][: max(0, k - count)]
            expected[count : count + len(chosen)] = chosen
            np.testing.assert_array_equal(a, expected)


@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_set_positions_are_numpys_nonzero(density):
    flags = np.random.default_rng(3).random(5000) < density
    running = jnp.cumsum(jnp.asarray(flags), dtype=jnp.int32)
    places = jnp.arange(6000, dtype=jnp.int32)  # past the last set flag too
    want = np.full(6000, 5000)
    want[: flags.sum()] = np.flatnonzero(flags)
    np.testing.assert_array_equal(_backend.set_positions(running, places), want)


def test_gather_clamped_clamps_out_of_range_indices():
    array = jnp.arange(10.0).reshape(5, 2)
    index = jnp.asarray([-3, -1, 0, 2, 4, 5, 99], jnp.int32)
    ours = jax.jit(_backend.gather_clamped)(array, index)
    np.testing.assert_array_equal(ours, _backend.gather_clamped_reference(array, index))
    np.testing.assert_array_equal(ours, np.asarray(array)[np.clip(index, 0, 4)])


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_axes_at_are_the_columns_at_the_rows(backend):
    values = jnp.asarray(np.random.default_rng(0).random((7, 3)), jnp.float32)
    index = jnp.asarray([[0, 6, 3], [2, 2, 7]], jnp.int32)  # 7: out of range
    ours = jax.jit(ft.partial(_backend.axes_at, backend=backend))(values, index)
    reference = _backend.axes_at_reference(values, index)
    inside = np.asarray(index) < 7
    for axis, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert a.shape == index.shape
        want = np.asarray(values)[np.minimum(np.asarray(index), 6), axis]
        np.testing.assert_array_equal(np.asarray(a)[inside], want[inside])
        np.testing.assert_array_equal(a, b)
        assert np.all(np.isfinite(a))
    empty = _backend.axes_at(jnp.zeros((0, 2)), index, backend=backend)
    assert [a.shape for a in empty] == [index.shape] * 2


@pytest.mark.parametrize(
    "dtype", [jnp.complex64, pytest.param(jnp.complex128, marks=pytest.mark.x64)]
)
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_complex_product_is_a_complex_dot_general(dtype, backend):
    """On prepared operands, against the reference and numpy: Gauss's three real
    products round differently, so to a few ulps of the operands' norms."""
    rng = np.random.default_rng(6)
    a = rng.normal(size=(5, 4, 3)) + 1j * rng.normal(size=(5, 4, 3))
    b = rng.normal(size=(5, 3, 6)) + 1j * rng.normal(size=(5, 3, 6))
    a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    for numbers, expected in [
        ((((2,), (1,)), ((0,), (0,))), np.einsum("bij,bjk->bik", a, b)),
        ((((0, 2), (0, 1)), ((), ())), np.einsum("bij,bjk->ik", a, b)),
    ]:
        prepared = [_backend.complex_factors(x, backend) for x in (a, b)]
        ours = _backend.complex_product(*prepared, numbers, backend)
        reference = _backend.complex_product_reference(a, b, numbers)
        tolerance = 32 * np.finfo(a.real.dtype).eps * np.max(np.abs(expected))
        np.testing.assert_allclose(ours, expected, atol=tolerance)
        np.testing.assert_allclose(reference, expected, atol=tolerance)


def test_lane_count_per_backend():
    assert _backend.lane_count(64, "cpu") == _backend.CPU_LANES  # k = 8
    assert _backend.lane_count(128 * 8, "cpu") == 128  # k = 128: cache-sized
    assert _backend.lane_count(2**20, "cpu") == 64  # a floor
    for state_bytes in (1, 64, 4096, 2**40):
        lanes = _backend.lane_count(state_bytes, "gpu")
        assert lanes & (lanes - 1) == 0  # a power of two
        assert _backend.CPU_LANES <= lanes <= 2**20
        assert lanes == _backend.CPU_LANES or lanes * state_bytes <= 2**30
    assert _backend.lane_count(64, "gpu") == 2**20


def test_fit_chunk_per_backend():
    assert _backend.fit_chunk(36 * 36 * 4, "cpu") == _backend.CPU_FIT_CHUNK == 2048
    assert _backend.fit_chunk(36 * 36 * 4, "gpu") == 2**17  # k = 32: 680 MB of systems
    for system_bytes in (1, 5184, 2**20, 2**40):
        chunk = _backend.fit_chunk(system_bytes, "tpu")
        assert chunk & (chunk - 1) == 0  # a power of two
        assert chunk == 2048 or (chunk > 2048 and chunk * system_bytes <= 2**30)


def test_step_cap_per_backend(monkeypatch):
    monkeypatch.setattr(_backend._lanes, "ACCELERATOR_STEPS", 7)
    assert _backend.step_cap("cpu") == _backend.CPU_STEPS == 8
    assert _backend.step_cap("gpu") == _backend.step_cap("tpu") == 7


def test_kernels_are_split_over_cores_only_when_devices_are_fewer(monkeypatch):
    monkeypatch.setattr(_backend._cores, "available_cores", lambda: 2)
    without_splits = {"xla_disable_hlo_passes": "cpu-parallel-task-assigner"}
    assert _backend.device_per_core_options(2) == without_splits
    assert _backend.device_per_core_options(4) == without_splits
    assert _backend.device_per_core_options(1) == {}
    monkeypatch.setattr(_backend._cores, "available_cores", lambda: 16)
    assert _backend.device_per_core_options(2) == {}


def merge_as_walks_keep_lists(best_d2, best_indices, d2, indices):
    """`merge_into_best` on the walk's lists (packed halves for float32), as pairs."""
    best = merge_into_best(best_of_pairs(best_d2, best_indices), d2, indices)
    return pairs_of_best(best, best_d2.dtype, best_indices.dtype)


@pytest.mark.parametrize(
    "merge",
    [
        merge_k_best,
        merge_by_reduction,
        merge_by_ranks,
        merge_by_networks,
        merge_as_walks_keep_lists,
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 4, 9, 33, 100])
@pytest.mark.parametrize("leaf", [8, 64])
def test_merges_keep_the_k_smallest_pairs(merge, dtype, k, leaf):
    if merge is merge_by_reduction and k > SMALL_K:
        pytest.skip("merge_k_best merges more than SMALL_K by networks")
    rng = np.random.default_rng(k)
    for _ in range(20):
        best = sorted(
            zip(rng.integers(0, 5, k).astype(dtype), rng.permutation(200)[:k])
        )
        empty = rng.integers(0, k + 1)  # empty entries (bound2, -1) at the end
        bound2 = dtype(5)
        best = best[: k - empty] + [(bound2, -1)] * empty
        d2 = rng.integers(0, 6, leaf).astype(dtype)
        indices = 200 + rng.permutation(leaf)  # no real index in both
        padding = rng.random(leaf) < 0.3
        d2[padding], indices[padding] = np.inf, 1000
        best_d2 = jnp.asarray([b[0] for b in best], dtype)
        best_indices = jnp.asarray([b[1] for b in best], jnp.int32)
        merged = jax.jit(merge)(
            best_d2, best_indices, jnp.asarray(d2), jnp.asarray(indices, jnp.int32)
        )
        expected = sorted(best + list(zip(d2, indices)))[:k]
        np.testing.assert_array_equal(merged[0], [e[0] for e in expected])
        np.testing.assert_array_equal(merged[1], [e[1] for e in expected])


@pytest.mark.parametrize("dtype", DTYPES)
def test_best_lists_prune_as_pairs_compare(dtype):
    # The walk prunes a subtree unless (its box distance, its key) comes before the
    # last of the k best, with ties broken by index; -0 counts as 0.
    rng = np.random.default_rng(3)
    last = [(dtype(0), -1), (dtype(0), 5), (dtype(2), 7), (dtype(2), -1)]
    for last_d2, last_index in last:
        best_d2 = jnp.asarray([0, last_d2], dtype)
        best = best_of_pairs(best_d2, jnp.asarray([0, last_index], jnp.int32))
        assert len(best) == (1 if dtype == np.float32 else 2)
        d2 = np.concatenate([[-0.0, 0.0], rng.integers(0, 4, 30)]).astype(dtype)
        index = rng.integers(-1, 10, d2.shape[0]).astype(np.int32)
        ours = jax.jit(jax.vmap(precedes_last, (0, 0, None)))(
            jnp.asarray(d2), jnp.asarray(index), best
        )
        expected = [(a, i) < (last_d2, last_index) for a, i in zip(d2, index)]
        np.testing.assert_array_equal(ours, expected)


def _interleave(cells: np.ndarray, bits: int) -> np.ndarray:
    """Bit `b` of dimension `j` to bit `b * dims + j`, one bit at a time."""
    dims = cells.shape[1]
    codes = np.zeros(len(cells), np.uint64)
    for b in range(bits):
        for j in range(dims):
            bit = (cells[:, j].astype(np.uint64) >> np.uint64(b)) & np.uint64(1)
            codes |= bit << np.uint64(b * dims + j)
    return codes


@pytest.mark.parametrize("d", [1, 2, 3, 7, 40])
def test_morton_codes_interleave_the_quantised_coordinates(d):
    rng = np.random.default_rng(d)
    lo, hi = np.full(d, -1.0, np.float32), np.full(d, 3.0, np.float32)
    x = rng.uniform(-2, 4, (100, d)).astype(np.float32)  # some outside the box
    dims = min(d, 30)
    bits = 30 // dims
    width = 2.0 ** (np.floor(np.log2(hi - lo)) + 1)  # above the extent, 4: 8
    unit = np.clip((x[:, :dims] - lo[:dims]) / width[:dims], 0, 1)
    cells = (unit * (2**bits - 1)).astype(np.uint32)
    codes = morton_codes(jnp.asarray(x), jnp.asarray(lo), jnp.asarray(hi))
    np.testing.assert_array_equal(
        np.asarray(codes, np.uint64), _interleave(cells, bits)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_pairs_sorts_rows_lexicographically(dtype):
    rng = np.random.default_rng(6)
    d2 = rng.integers(0, 5, (4, 50)).astype(dtype)
    d2[:, :3] = np.inf
    indices = np.stack([rng.permutation(50) - 1 for _ in range(4)]).astype(np.int32)
    ours = jax.jit(_backend.sort_pairs)(jnp.asarray(d2), jnp.asarray(indices))
    reference = _backend.sort_pairs_reference(jnp.asarray(d2), jnp.asarray(indices))
    for a, b in zip(ours, reference, strict=True):
        np.testing.assert_array_equal(a, b)
    for row in range(4):
        expected = sorted(zip(d2[row], indices[row]))
        np.testing.assert_array_equal(ours[0][row], [e[0] for e in expected])
        np.testing.assert_array_equal(ours[1][row], [e[1] for e in expected])


@pytest.mark.x64
def test_sort_pairs_orders_float64_distances_by_every_bit():
    """float64 distances that agree in their high 32 bits and differ below them, and
    ties among them, sort as the two-key sort does."""
    rng = np.random.default_rng(7)
    d2 = 1.0 + rng.integers(0, 6, (3, 80)) * 2.0**-45
    d2[:, :5] = np.inf
    d2[0, 10:20] = 0.0
    indices = np.stack([rng.permutation(80) - 1 for _ in range(3)]).astype(np.int32)
    ours = jax.jit(_backend.sort_pairs)(jnp.asarray(d2), jnp.asarray(indices))
    for row in range(3):
        expected = sorted(zip(d2[row], indices[row]))
        np.testing.assert_array_equal(ours[0][row], [e[0] for e in expected])
        np.testing.assert_array_equal(ours[1][row], [e[1] for e in expected])


def test_sort_edges_packs_three_keys_as_the_reference_sorts():
    rng = np.random.default_rng(0)
    nodes, images = 1000, 27
    edges = [
        jnp.asarray(rng.integers(0, top, 5000), jnp.int32)
        for top in (nodes, nodes, images)
    ]
    ours = jax.jit(_backend.sort_edges, static_argnums=(3, 4))(*edges, nodes, images)
    reference = _backend.sort_edges_reference(*edges)
    for a, b in zip(ours, reference, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("width", [1, 17, _backend._pairs.RANKED_WIDTH + 1])
def test_edges_sorted_in_rows_by_ranks_as_the_reference_sorts(width):
    """Rows with repeated edges (padding) and repeated receivers of other images;
    placed by ranks up to `RANKED_WIDTH` edges, sorted beyond."""
    rng = np.random.default_rng(1)
    receivers = rng.integers(0, 6, (200, width)).astype(np.int32)
    images = rng.integers(0, 3, (200, width)).astype(np.int32)
    ours = jax.jit(_backend.sort_edges_in_rows)(receivers, images)
    order = np.lexsort((images, receivers), axis=1)  # stable: ties by position
    np.testing.assert_array_equal(ours[0], np.take_along_axis(receivers, order, 1))
    np.testing.assert_array_equal(ours[1], np.take_along_axis(images, order, 1))


def test_entries_placed_in_rows_move_to_their_slots_and_the_rest_are_filled():
    rng = np.random.default_rng(2)
    rows, width, kept = 50, 9, 6
    values = rng.random((rows, width)).astype(np.float32)
    labels = rng.integers(0, 100, (rows, width)).astype(np.int32)
    # A few entries of each row go to distinct slots; the rest to `kept` (dropped).
    slots = np.full((rows, width), kept, np.int32)
    for row in range(rows):
        movers = rng.choice(width, rng.integers(0, kept + 1), replace=False)
        slots[row, movers] = rng.choice(kept, len(movers), replace=False)
    placed = jax.jit(_backend.placed_in_rows, static_argnums=(2, 3))
    got_values, got_labels = placed(slots, (values, labels), (np.inf, -1), kept)
    expected_values = np.full((rows, kept), np.inf, np.float32)
    expected_labels = np.full((rows, kept), -1, np.int32)
    for row, entry in zip(*np.nonzero(slots < kept), strict=True):
        expected_values[row, slots[row, entry]] = values[row, entry]
        expected_labels[row, slots[row, entry]] = labels[row, entry]
    np.testing.assert_array_equal(got_values, expected_values)
    np.testing.assert_array_equal(got_labels, expected_labels)


def test_quick_start_options_keep_only_the_options_this_jaxlib_knows(monkeypatch):
    options = {"xla_no_such_option": 1, "xla_backend_optimization_level": 1}
    monkeypatch.setattr(_backend._compile, "QUICK_START_OPTIONS", options)
    _backend.quick_start_options.cache_clear()
    try:
        known = _backend.quick_start_options()
        unoptimised = _backend.quick_start_options(optimise=False)
    finally:
        _backend.quick_start_options.cache_clear()
    cpu = jax.default_backend() == "cpu"
    assert known == ({"xla_backend_optimization_level": 1} if cpu else {})
    assert unoptimised == ({"xla_backend_optimization_level": 0} if cpu else {})


def test_outside_any_trace():
    assert _backend.outside_any_trace()
    seen = []
    jax.jit(lambda x: seen.append(_backend.outside_any_trace()) or x)(1.0)
    jax.vmap(lambda x: seen.append(_backend.outside_any_trace()) or x)(jnp.ones(2))
    assert seen == [False, False]
