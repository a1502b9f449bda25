"""Backend tuning: every trick that makes the build or a query faster on one backend,
each beside the plain JAX it stands for.

A trick and its `*_reference` give the same answers (bit for bit, unless a docstring
says otherwise); `tests/test_backend.py` checks each pair against each other, so the
rest of the library may use either and means the same thing. The tricks are correct
on every backend; only the lane count and the step cap are chosen per backend.

Unless noted, the choices were made on XLA:CPU; the benchmark named beside a choice
backs it.
"""

import contextlib
import functools as ft
import importlib
import operator
import os

import jax
import jax.lax as lax
import jax.numpy as jnp

from ._custom_types import Array, Bool, Float, Int, UInt


# ---------------------------------------------------------------------------------
# Lanes: how many queries the traversal engine walks at once.

# XLA:CPU, for the walk that leaves far children pending: 1024 lanes and at most 8
# moves between two leaf visits. Fewer or more moves, or half or twice the lanes, were
# no faster (fewer lanes help only small batches far from the points: few queries per
# lane). The walk that climbed back through each parent needed about twice the moves,
# and a cap of 16. Lanes and steps: see `benchmarks/knn_k.py` and
# `benchmarks/walk_order.py`.
CPU_LANES = 1024
CPU_STEPS = 8
# Fewer lanes for larger states, so that the lanes' states stay in cache: large k ran
# far faster on a few lanes than on 1024. k <= 16 keeps all 1024. The budget and the
# floor: see `benchmarks/knn_k.py`.
_CPU_STATE_BYTES = 2**17
_CPU_MIN_LANES = 64

# GPUs and TPUs: enough lanes to fill the device (a GPU keeps far more threads in
# flight than a CPU), as long as the lanes' states fit in this much memory, and 16
# moves between leaf visits. On a GPU, with the walk that climbed back through the
# parents, the cap made no difference; the pending walk's is `benchmarks/gpu.py`'s to
# check.
_ACCELERATOR_MAX_LANES = 2**20
_ACCELERATOR_STATE_BYTES = 2**30
ACCELERATOR_STEPS = 16


def lane_count(state_bytes: int, backend: str | None = None) -> int:
    """The number of lanes for a walk whose per-query state takes `state_bytes`.

    On the CPU a few lanes, fewer for larger states (their states together
    cache-sized); elsewhere as many as fit the memory cap, a power of two
    `>= CPU_LANES`. `backend` defaults to `jax.default_backend()`, the
    backend that programs are compiled for unless arrays are placed elsewhere.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        fit = max(_CPU_MIN_LANES, _CPU_STATE_BYTES // max(1, state_bytes))
        return min(CPU_LANES, _power_of_two_at_most(fit))
    fit = min(_ACCELERATOR_MAX_LANES, _ACCELERATOR_STATE_BYTES // max(1, state_bytes))
    return max(CPU_LANES, _power_of_two_at_most(fit))


def _power_of_two_at_most(m: int) -> int:
    """The largest power of two `<= m` (0 for `m < 1`)."""
    return 1 << (m.bit_length() - 1) if m > 0 else 0


# Local fits: how many queries' small dense systems are solved at once. On XLA:CPU
# 2,048, which bounds the temporaries; elsewhere as many as fit this much memory, and
# at least as many (larger chunks were faster on a GPU: `benchmarks/gpu.py`).
CPU_FIT_CHUNK = 2048
_ACCELERATOR_FIT_BYTES = 2**30


def fit_chunk(system_bytes: int, backend: str | None = None) -> int:
    """How many local systems of `system_bytes` each to solve at once: `CPU_FIT_CHUNK`
    on the CPU, elsewhere a power of two `>= CPU_FIT_CHUNK` whose systems fit in
    `_ACCELERATOR_FIT_BYTES`. `backend` as in `lane_count`."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        return CPU_FIT_CHUNK
    fit = _ACCELERATOR_FIT_BYTES // max(1, system_bytes)
    return max(CPU_FIT_CHUNK, _power_of_two_at_most(fit))


def step_cap(backend: str | None = None) -> int:
    """How many steps every lane of a walk moves between two leaf visits (lanes that
    reach their next leaf sooner wait there). `backend` as in `lane_count`."""
    backend = jax.default_backend() if backend is None else backend
    return CPU_STEPS if backend == "cpu" else ACCELERATOR_STEPS


# ---------------------------------------------------------------------------------
# CPU devices: one per core.
#
# XLA:CPU splits each large kernel of a program over the cores (its intra-op thread
# pool). Queries split over the CPU's devices, one per core, already keep every core
# busy: the split then only costs, as every kernel waits for its slowest part and the
# devices' parts contend for the same cores. Compiled without it, kNN queries split
# over one device per core ran faster, and their times spread far less (see
# `benchmarks/sharded.py`).
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


# ---------------------------------------------------------------------------------
# Sorting: one sort of packed 64-bit integers.
#
# XLA:CPU sorts a single integer array several times faster than a (key, index) pair,
# which is what `jnp.argsort` sorts.


def enable_x64_locally():
    """A context in which 64-bit types exist, whatever the user's x64 setting."""
    # `jax.enable_x64` in recent JAX, `jax.experimental.enable_x64` before.
    context = getattr(jax, "enable_x64", None)
    if context is None:
        context = getattr(importlib.import_module("jax.experimental"), "enable_x64")
    return context(True)


def float32_sort_keys(values: Float[Array, "*shape"]) -> UInt[Array, "*shape"]:
    """uint32 keys whose unsigned order is the order of `values` rounded to float32."""
    values = jnp.where(values == 0, 0, values).astype(jnp.float32)  # -0 sorts as +0
    bits = lax.bitcast_convert_type(values, jnp.uint32)
    negative = (bits >> 31).astype(bool)
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def argsort_keys(keys: UInt[Array, " m"]) -> Int[Array, " m"] | UInt[Array, " m"]:
    """A stable argsort of uint32 `keys` (ties by position): a 32-bit key and a 32-bit
    position packed into one uint64 and sorted together. The packed keys are unique,
    so XLA's unstable sort serves: on XLA:CPU it is much faster on keys that are
    mostly in order already, and no slower on random ones."""
    m = keys.shape[0]
    if m > 2**32:  # positions would not fit in 32 bits
        return argsort_keys_reference(keys)
    position = jnp.arange(m, dtype=jnp.uint32)
    with enable_x64_locally():
        packed = keys.astype(jnp.uint64) << 32 | position.astype(jnp.uint64)
        return lax.sort(packed, is_stable=False).astype(jnp.uint32)


def argsort_keys_reference(keys: UInt[Array, " m"]) -> Int[Array, " m"]:
    return jnp.argsort(keys, stable=True)


# ---------------------------------------------------------------------------------
# Comparing (squared distance, index) pairs.


def lexicographic_less(d2_a, index_a, d2_b, index_b):
    """`(d2_a, index_a) < (d2_b, index_b)`: distance first, then the lower index."""
    return (d2_a < d2_b) | ((d2_a == d2_b) & (index_a < index_b))


def pairs_before(
    d2_a: Float[Array, " a"],
    index_a: Int[Array, " a"],
    d2_b: Float[Array, " b"],
    index_b: Int[Array, " b"],
) -> Bool[Array, "b a"]:
    """`[i, j]`: whether pair `j` of `a` comes before pair `i` of `b`.

    For squared distances `>= 0` and indices `>= -1`. With 32-bit distances and
    indices, each pair is ordered by one comparison of uint64 keys rather than the five
    of the lexicographic order (kNN queries ran faster). Written in `lax` alone:
    inside the local x64 context each `jax.numpy` function would be traced afresh,
    which lengthened a query's first call.
    """
    if d2_a.dtype.itemsize != 4 or index_a.dtype.itemsize != 4:
        return pairs_before_reference(d2_a, index_a, d2_b, index_b)
    shape = (d2_b.shape[0], d2_a.shape[0])
    with enable_x64_locally():
        keys_a = lax.broadcast_in_dim(_packed_keys(d2_a, index_a), shape, (1,))
        keys_b = lax.broadcast_in_dim(_packed_keys(d2_b, index_b), shape, (0,))
        return lax.lt(keys_a, keys_b)


def pairs_before_reference(d2_a, index_a, d2_b, index_b) -> Bool[Array, "b a"]:
    return lexicographic_less(
        d2_a[None, :], index_a[None, :], d2_b[:, None], index_b[:, None]
    )


def packs_pairs(d2_dtype, index_dtype) -> bool:
    """Whether `(d2, index)` pairs of these dtypes fit one uint64 key."""
    return jnp.dtype(d2_dtype).itemsize == 4 and jnp.dtype(index_dtype).itemsize == 4


def pair_keys_context(d2_dtype, index_dtype):
    """The context in which `pack_pairs`' keys exist (x64, for packed keys)."""
    if packs_pairs(d2_dtype, index_dtype):
        return enable_x64_locally()
    return contextlib.nullcontext()


def pack_pairs(d2: Array, indices: Array) -> tuple[Array, ...]:
    """`(d2, index)` pairs as keys in their lexicographic order: one uint64 array
    where the pair fits (compared and moved in one operation each, rather than five
    and two), else the two arrays. Use inside `pair_keys_context`, in `lax` alone."""
    if packs_pairs(d2.dtype, indices.dtype):
        return (_packed_keys(d2, indices),)
    return d2, indices


def unpack_pairs(keys: tuple[Array, ...], d2_dtype, index_dtype) -> tuple[Array, Array]:
    if len(keys) == 2:
        return keys[0], keys[1]
    (packed,) = keys
    high = lax.shift_right_logical(packed, jnp.uint64(32))
    high = lax.convert_element_type(high, jnp.uint32)
    low = lax.convert_element_type(packed, jnp.uint32)
    low = lax.sub(low, jnp.uint32(1))
    return (
        lax.bitcast_convert_type(high, d2_dtype),
        lax.bitcast_convert_type(low, index_dtype),
    )


def pair_halves(d2: Array, indices: Array) -> UInt[Array, "*shape 2"]:
    """Pairs that pack (`packs_pairs`) as the two uint32 halves of their packed keys,
    along a new last axis: the distance's bits, then `index + 1`. They need no x64."""
    high = lax.bitcast_convert_type(d2, jnp.uint32)
    low = lax.add(lax.bitcast_convert_type(indices, jnp.uint32), jnp.uint32(1))
    return jnp.stack([high, low], axis=-1)


def pairs_of_halves(
    halves: UInt[Array, "*shape 2"], d2_dtype, index_dtype
) -> tuple[Array, Array]:
    """`pair_halves`, undone."""
    high, low = halves[..., 0], halves[..., 1]
    return (
        lax.bitcast_convert_type(high, d2_dtype),
        lax.bitcast_convert_type(lax.sub(low, jnp.uint32(1)), index_dtype),
    )


def precedes_halves(d2: Array, index: Array, halves: UInt[Array, "*shape 2"]):
    """Whether the pair `(d2, index)` (`d2 >= 0`, or -0) comes before the pair whose
    `pair_halves` are `halves`, compared in the halves themselves: a loop that reads
    the halves then only slices them, which XLA:CPU keeps in the loop's kernel (it
    hoists a conversion of loop-invariant halves into kernels of their own)."""
    # The sign bit cleared: -0 as +0.
    high = lax.bitwise_and(
        lax.bitcast_convert_type(d2, jnp.uint32), jnp.uint32(0x7FFFFFFF)
    )
    low = lax.add(lax.bitcast_convert_type(index, jnp.uint32), jnp.uint32(1))
    other_high, other_low = halves[..., 0], halves[..., 1]
    return (high < other_high) | ((high == other_high) & (low < other_low))


def keys_of_halves(halves: UInt[Array, "m 2"]) -> UInt[Array, " m"]:
    """`pair_halves` of `m` pairs as their packed keys, inside `pair_keys_context`."""
    high, low = (
        lax.convert_element_type(lax.index_in_dim(halves, i, 1, False), jnp.uint64)
        for i in (0, 1)
    )
    return lax.bitwise_or(lax.shift_left(high, jnp.uint64(32)), low)


def halves_of_keys(keys: UInt[Array, " m"]) -> UInt[Array, "m 2"]:
    """`keys_of_halves`, undone (inside `pair_keys_context`)."""
    high = lax.convert_element_type(
        lax.shift_right_logical(keys, jnp.uint64(32)), jnp.uint32
    )
    low = lax.convert_element_type(keys, jnp.uint32)
    return lax.concatenate([lax.expand_dims(high, (1,)), lax.expand_dims(low, (1,))], 1)


def largest_pairs(keys: tuple[Array, ...], size: int) -> tuple[Array, ...]:
    """`size` keys that sort after every pair."""
    if len(keys) == 1:
        return (lax.full((size,), jnp.iinfo(jnp.uint64).max, jnp.uint64),)
    d2, indices = keys
    return (
        lax.full((size,), jnp.inf, d2.dtype),
        lax.full((size,), jnp.iinfo(indices.dtype).max, indices.dtype),
    )


def pairs_minmax(a: tuple[Array, ...], b: tuple[Array, ...]):
    """The elementwise lesser and greater of two arrays of keys."""
    if len(a) == 1:
        return (lax.min(a[0], b[0]),), (lax.max(a[0], b[0]),)
    a_first = lexicographic_less(*a, *b)
    low = tuple(lax.select(a_first, x, y) for x, y in zip(a, b, strict=True))
    high = tuple(lax.select(a_first, y, x) for x, y in zip(a, b, strict=True))
    return low, high


def sort_pairs(
    d2: Float[Array, "*batch m"], indices: Int[Array, "*batch m"]
) -> tuple[Float[Array, "*batch m"], Int[Array, "*batch m"]]:
    """Sorts each row of `(d2 >= 0, index >= -1)` pairs lexicographically: one sort of
    packed uint64 keys where the pairs fit, which XLA:CPU sorts several times faster
    than a two-key sort."""
    if not packs_pairs(d2.dtype, indices.dtype):
        if jnp.dtype(d2.dtype).itemsize == 8 and d2.shape[-1] < 2**32:
            return _sort_wide_pairs(d2, indices)
        return sort_pairs_reference(d2, indices)
    with enable_x64_locally():
        (keys,) = pack_pairs(d2, indices)
        keys = lax.sort(keys, dimension=keys.ndim - 1)
        return unpack_pairs((keys,), d2.dtype, indices.dtype)


def sort_index_pairs(
    rows: Int[Array, " m"], cols: Int[Array, " m"]
) -> tuple[Int[Array, " m"], Int[Array, " m"]]:
    """Sorts `(row, col)` pairs of non-negative 32-bit indices by row, then column:
    one sort of packed uint64 keys (several times faster on XLA:CPU than a two-key
    sort)."""
    if jnp.dtype(rows.dtype).itemsize != 4 or jnp.dtype(cols.dtype).itemsize != 4:
        return sort_index_pairs_reference(rows, cols)
    with enable_x64_locally():
        high, low = (
            lax.convert_element_type(
                lax.bitcast_convert_type(a, jnp.uint32), jnp.uint64
            )
            for a in (rows, cols)
        )
        keys = lax.sort(lax.bitwise_or(lax.shift_left(high, jnp.uint64(32)), low))
        high = lax.shift_right_logical(keys, jnp.uint64(32))
        return (
            lax.bitcast_convert_type(
                lax.convert_element_type(high, jnp.uint32), rows.dtype
            ),
            lax.bitcast_convert_type(
                lax.convert_element_type(keys, jnp.uint32), cols.dtype
            ),
        )


def sort_index_pairs_reference(rows, cols):
    rows, cols = lax.sort((rows, cols), num_keys=2)
    return rows, cols


def sort_edges(
    senders: Int[Array, " m"],
    receivers: Int[Array, " m"],
    images: Int[Array, " m"],
    nodes: int,
    image_count: int,
) -> tuple[Int[Array, " m"], Int[Array, " m"], Int[Array, " m"]]:
    """Sorts edges by sender, then receiver, then image (`0 <= senders, receivers <
    nodes`, `0 <= images < image_count`): one sort of mixed-radix uint64 keys where
    they fit, as `sort_index_pairs`."""
    if nodes * nodes * image_count >= 2**64:
        return sort_edges_reference(senders, receivers, images)
    with enable_x64_locally():
        wide = [a.astype(jnp.uint64) for a in (senders, receivers, images)]
        radix = jnp.uint64(nodes), jnp.uint64(image_count)
        # Unique but for padding (all equal): stability cannot matter.
        keys = lax.sort(
            (wide[0] * radix[0] + wide[1]) * radix[1] + wide[2], is_stable=False
        )
        image, pair = keys % radix[1], keys // radix[1]
        return (
            (pair // radix[0]).astype(senders.dtype),
            (pair % radix[0]).astype(receivers.dtype),
            image.astype(images.dtype),
        )


def sort_edges_reference(senders, receivers, images):
    senders, receivers, images = lax.sort((senders, receivers, images), num_keys=3)
    return senders, receivers, images


def sort_edges_in_rows(
    receivers: Int[Array, "n k"], images: Int[Array, "n k"]
) -> tuple[Int[Array, "n k"], Int[Array, "n k"]]:
    """Each row sorted by receiver, then image."""
    receivers, images = lax.sort((receivers, images), dimension=1, num_keys=2)
    return receivers, images


def _sort_wide_pairs(d2, indices):
    """`sort_pairs` for float64 distances, which do not pack with an index: three
    sorts of uint64 keys, least significant first (a radix sort in 32-bit digits):
    by index, by the low half of the distance's bits, then by the high half. Each
    key carries the position its pair reached in the previous sort, so that each sort
    keeps the previous order among its ties; single-operand integer sorts are the
    ones XLA:CPU runs fast."""
    axis = d2.ndim - 1
    with enable_x64_locally():
        bits = lax.bitcast_convert_type(d2, jnp.uint64)
        digits = (
            lax.convert_element_type(
                lax.add(lax.bitcast_convert_type(indices, jnp.uint32), jnp.uint32(1)),
                jnp.uint64,
            ),
            lax.bitwise_and(bits, jnp.uint64(2**32 - 1)),
            lax.shift_right_logical(bits, jnp.uint64(32)),
        )
        order = lax.broadcasted_iota(jnp.int32, d2.shape, axis)
        for digit in digits:
            digit = jnp.take_along_axis(digit, order, axis=-1)
            keys = lax.bitwise_or(
                lax.shift_left(digit, jnp.uint64(32)),
                lax.broadcasted_iota(jnp.uint64, d2.shape, axis),
            )
            ranked = lax.sort(keys, dimension=axis)
            position = lax.bitwise_and(ranked, jnp.uint64(2**32 - 1))
            order = jnp.take_along_axis(
                order, lax.convert_element_type(position, jnp.int32), axis=-1
            )
    return (
        jnp.take_along_axis(d2, order, axis=-1),
        jnp.take_along_axis(indices, order, axis=-1),
    )


def sort_pairs_reference(d2, indices):
    d2, indices = lax.sort((d2, indices), dimension=d2.ndim - 1, num_keys=2)
    return d2, indices


def _packed_keys(d2, indices):
    """uint64 keys in the order of `(d2, index)`: the bits of `d2 >= 0` above, and
    `index + 1` below (so an index of -1 sorts first)."""
    high = lax.bitcast_convert_type(d2, jnp.uint32)
    low = lax.add(lax.bitcast_convert_type(indices, jnp.uint32), jnp.uint32(1))
    high, low = (lax.convert_element_type(half, jnp.uint64) for half in (high, low))
    return lax.bitwise_or(lax.shift_left(high, jnp.uint64(32)), low)


# ---------------------------------------------------------------------------------
# Reductions that XLA:CPU would hand to YNNPACK.
#
# XLA:CPU hands float reductions over at least 4096 elements to YNNPACK kernels, which
# cost far more per call, inside a loop, than work fused into its neighbours.


def pick_one_hot(
    sources: tuple[tuple[Bool[Array, "k _"], Array], ...],
) -> Array:
    """`sum_s sum_j where(mask_s[:, j], values_s[j], 0)` for one-hot rows, which
    pick one entry of one source per output slot.

    Floats are picked as their bits: a float sum went to a YNNPACK kernel, which made
    the whole kNN query slower.
    """
    dtype = sources[0][1].dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return pick_one_hot_reference(sources)
    bits = jnp.dtype(f"int{8 * dtype.itemsize}")
    as_bits = tuple(
        (mask, lax.bitcast_convert_type(values, bits)) for mask, values in sources
    )
    return lax.bitcast_convert_type(pick_one_hot_reference(as_bits), dtype)


def pick_one_hot_reference(sources) -> Array:
    picks = [
        jnp.sum(jnp.where(mask, values[None, :], 0), axis=1, dtype=values.dtype)
        for mask, values in sources
    ]
    return ft.reduce(operator.add, picks)


def sum_nonnegative(terms: Float[Array, "... d"]) -> Float[Array, "..."]:
    """The sum over the last axis of non-negative `terms`, by one reduction with two
    outputs, the sum and the largest term; their maximum is the sum, bit for bit (a
    rounded sum of non-negative terms is never below one of them).

    XLA:CPU keeps this reduction in its own loop emitter, where kNN queries ran
    faster. (Plain additions, the other way around YNNPACK, were miscompiled: see
    `sum_by_additions`.)
    """
    zero = jnp.zeros((), terms.dtype)
    total, largest = lax.reduce(
        (terms, terms),
        (zero, zero),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
        (terms.ndim - 1,),
    )
    return jnp.maximum(total, largest)


def sum_nonnegative_reference(terms: Float[Array, "... d"]) -> Float[Array, "..."]:
    return jnp.sum(terms, axis=-1)


def sum_by_additions(terms: Float[Array, "... d"]) -> Float[Array, "..."]:
    """The sum over the last axis by plain additions, in order (rounding may differ
    from a reduction's in the last bit).

    A block's leaf distances are summed so (`Minkowski.leaf_distances`). One point's
    leaf distances summed this way made XLA:CPU return wrong k-nearest neighbours
    (d = 8, float32, in a vmapped walk): right with
    `--xla_disable_hlo_passes=algsimp`, so a miscompile in XLA's algebraic
    simplifier, which the test suite caught; those use `sum_nonnegative`.
    """
    total = terms[..., 0]
    for i in range(1, terms.shape[-1]):
        total = total + terms[..., i]
    return total


@jax.jit
def all_finite(array: Array) -> Bool[Array, ""]:
    """Whether every entry is finite: `a - a` is 0 where `a` is finite and NaN at NaN
    and +-inf, so one sum tests all entries, in one kernel (`isfinite` then `all` is
    three on XLA:CPU). Jitted: an eager check of a new shape compiles one program,
    not three."""
    return jnp.isfinite(jnp.sum(array - array))


def all_finite_reference(array: Array) -> Bool[Array, ""]:
    return jnp.all(jnp.isfinite(array))


# ---------------------------------------------------------------------------------
# Scatters.


# Slot numbers: the build counts them unsigned where 32 bits hold them.
_Slots = Int[Array, "d m"] | UInt[Array, "d m"]


def move_rows(orders: _Slots, destination: _Slots):
    """`orders[j]` with entry `i` moved to `destination[j, i]` (a permutation of each
    row): one flat scatter, faster on XLA:CPU than a vmapped one."""
    d, _ = orders.shape
    rows = jnp.arange(d, dtype=jnp.int32)[:, None]
    return move_rows_in_place(jnp.zeros_like(orders), orders, rows, destination)


def move_rows_in_place(
    orders: _Slots,
    moving: Int[Array, "r m"] | UInt[Array, "r m"],
    rows: Int[Array, "r *words 1"],
    destination: Int[Array, "r *words width"] | UInt[Array, "r *words width"],
):
    """`orders` with each entry of `moving[r]` written to row `rows[r]` at position
    `destination[r]` (`rows` per word of `width` entries, `destination` per entry, in
    `moving`'s order); the rest of `orders` as it was. One flat scatter into
    `orders`' own buffer, which XLA reuses where it can (a while loop's state)."""
    d, m = orders.shape
    if d * m > jnp.iinfo(orders.dtype).max:
        rows = jnp.broadcast_to(rows, destination.shape).reshape(moving.shape)
        destination = destination.reshape(moving.shape)
        return orders.at[rows, destination].set(moving, unique_indices=True)
    flat = (rows.astype(orders.dtype) * m + destination).ravel()
    moved = orders.ravel().at[flat].set(moving.ravel(), unique_indices=True)
    return moved.reshape(d, m)


def move_rows_reference(orders, destination):
    def move_row(order, to):
        return jnp.zeros_like(order).at[to].set(order, unique_indices=True)

    return jax.vmap(move_row)(orders, destination)


def gather_clamped(array: Array, index: Int[Array, "..."]) -> Array:
    """`array[index]` along the first axis, with the index clamped into range.

    Traces to one gather (and the index's reshape), where `array[index]` adds the
    wrapping of negative indices and `.at[index].get` a reshape of the result (a
    smaller program, so a faster compile); lanes compute moves they then discard, so
    an index may lie outside the array.
    """
    batch = index.ndim
    dimensions = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(batch, batch + array.ndim - 1)),
        collapsed_slice_dims=(0,),
        start_index_map=(0,),
    )
    return lax.gather(
        array,
        lax.expand_dims(index, (batch,)),
        dimensions,
        (1, *array.shape[1:]),
        mode=lax.GatherScatterMode.CLIP,
    )


def gather_clamped_reference(array: Array, index: Int[Array, "..."]) -> Array:
    return array[jnp.clip(index, 0, array.shape[0] - 1)]


# ---------------------------------------------------------------------------------
# Complex products.


def complex_factors(x: Array, backend: str | None = None) -> Array:
    """A complex array prepared for [`kdeqx._backend.complex_product`][]: on the CPU
    the stack `[re, im, re + im]` along a new leading axis, elsewhere `x` itself.

    Prepare an operand once when it takes part in many products. Index the prepared
    array from the right (`x[..., i, :, :]`): its leading axis differs per backend.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu":
        return x
    return jnp.stack([x.real, x.imag, x.real + x.imag])


def complex_product(
    lhs: Array, rhs: Array, dimension_numbers, backend: str | None = None
) -> Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` for complex operands prepared by
    [`kdeqx._backend.complex_factors`][] (the dimension numbers are those of the
    unprepared arrays).

    On the CPU this is three real products (Gauss's trick, as BLAS's `zgemm3m`):
    `(a + ib)(c + id) = (ac - bd) + i((a + b)(c + d) - ac - bd)`, in one batched real
    product. XLA:CPU's complex product runs well below its real throughput, so these
    three are faster than the one (see `benchmarks/operator_series.py`). The rounding
    differs from the reference's (the imaginary part's error is bounded by the norms
    of `a + b` and `c + d`, as for any fast complex product).
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu":
        return lax.dot_general(lhs, rhs, dimension_numbers)
    (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers

    def shifted(dims):
        return tuple(d + 1 for d in dims)

    numbers = (
        (shifted(contract_l), shifted(contract_r)),
        ((0,) + shifted(batch_l), (0,) + shifted(batch_r)),
    )
    ac, bd, total = lax.dot_general(lhs, rhs, numbers)
    return lax.complex(ac - bd, total - ac - bd)


def complex_product_reference(lhs: Array, rhs: Array, dimension_numbers) -> Array:
    return lax.dot_general(lhs, rhs, dimension_numbers)


# ---------------------------------------------------------------------------------
# Compiling small programs quickly.

# XLA:CPU's older loop emitters and LLVM at -O1: for the operator series, a much
# shorter compile for a slightly slower run, a cost worth paying only where compiling
# dominates (see `benchmarks/operator_series.py`).
QUICK_START_OPTIONS = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 1,
}


@ft.cache
def quick_start_options(optimise: bool = True) -> dict[str, object]:
    """Compiler options that trade a little run time for a much shorter compile, for
    programs whose first call is mostly compiling: XLA:CPU options that this jaxlib
    knows (each checked once, on a trivial program), none on other backends.

    `optimise=False`: LLVM at -O0 instead, for code whose compile outweighs its run
    (the operator series' Taylor expansions, whose shorter compile outweighs their
    slower run)."""
    if jax.default_backend() != "cpu":
        return {}
    if not optimise:  # the same options, checked once, at another level
        known = dict(quick_start_options())
        if "xla_backend_optimization_level" in known:
            known["xla_backend_optimization_level"] = 0
        return known
    known = {}
    for name, value in QUICK_START_OPTIONS.items():
        trivial = jax.jit(lambda x: x + 1, compiler_options={name: value})
        try:
            trivial.lower(jnp.zeros((), jnp.float32)).compile()
        except jax.errors.JaxRuntimeError:  # an option this jaxlib does not have
            continue
        known[name] = value
    return known


try:  # private, so looked up once: jax versions without it cannot tell
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:
    _trace_state_clean = None


def outside_any_trace() -> bool:
    """Whether no transformation (`jit`, `vmap`, `grad`, ...) is tracing: only then
    may a `jit` carry compiler options. False where this jax cannot tell."""
    return _trace_state_clean is not None and _trace_state_clean()
