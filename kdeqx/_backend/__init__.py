"""Backend tuning: every trick that makes the build or a query faster on one backend,
each beside the plain JAX it stands for.

A trick and its `*_reference` give the same answers (bit for bit, unless a docstring
says otherwise); `tests/test_backend.py` checks each pair against each other, so the
rest of the library may use either and means the same thing. The tricks are correct
on every backend; only the lane count and the step cap are chosen per backend.

Unless noted, the choices were made on XLA:CPU; the benchmark named beside a choice
backs it. One module per concept: how many lanes and chunks (`_lanes`), one CPU device
per core (`_cores`), queries split over devices (`_mesh`), integer sorts
(`_sorting`), `(distance, index)` pairs (`_pairs`), reductions (`_reductions`),
scatters and gathers (`_scatters`), complex products (`_complex`), quick compiles
(`_compile`) and size buckets (`_buckets`, imported from there). This package
re-exports the others.
"""

from ._compile import (
    outside_any_trace as outside_any_trace,
    QUICK_START_OPTIONS as QUICK_START_OPTIONS,
    quick_start_options as quick_start_options,
)
from ._complex import (
    complex_factors as complex_factors,
    complex_product as complex_product,
    complex_product_reference as complex_product_reference,
    FULL_PRECISION as FULL_PRECISION,
)
from ._cores import (
    available_cores as available_cores,
    device_per_core_options as device_per_core_options,
    use_every_core as use_every_core,
)
from ._lanes import (
    _ACCELERATOR_FIT_BYTES as _ACCELERATOR_FIT_BYTES,
    ACCELERATOR_STEPS as ACCELERATOR_STEPS,
    BlockShape as BlockShape,
    CPU_FIT_CHUNK as CPU_FIT_CHUNK,
    CPU_LANES as CPU_LANES,
    CPU_STEPS as CPU_STEPS,
    fit_chunk as fit_chunk,
    lane_count as lane_count,
    query_block_shape as query_block_shape,
    step_cap as step_cap,
)
from ._pairs import (
    halves_of_keys as halves_of_keys,
    keys_of_halves as keys_of_halves,
    largest_pairs as largest_pairs,
    lexicographic_less as lexicographic_less,
    pack_pairs as pack_pairs,
    packs_pairs as packs_pairs,
    pair_halves as pair_halves,
    pair_keys_context as pair_keys_context,
    pairs_before as pairs_before,
    pairs_before_reference as pairs_before_reference,
    pairs_minmax as pairs_minmax,
    pairs_of_halves as pairs_of_halves,
    placed_in_rows as placed_in_rows,
    precedes_halves as precedes_halves,
    sort_edges as sort_edges,
    sort_edges_in_rows as sort_edges_in_rows,
    sort_edges_in_rows_reference as sort_edges_in_rows_reference,
    sort_edges_reference as sort_edges_reference,
    sort_index_pairs as sort_index_pairs,
    sort_index_pairs_reference as sort_index_pairs_reference,
    sort_pairs as sort_pairs,
    sort_pairs_reference as sort_pairs_reference,
    unpack_pairs as unpack_pairs,
)
from ._reductions import (
    all_finite as all_finite,
    all_finite_reference as all_finite_reference,
    pick_one_hot as pick_one_hot,
    pick_one_hot_reference as pick_one_hot_reference,
    sum_by_additions as sum_by_additions,
    sum_nonnegative as sum_nonnegative,
    sum_nonnegative_reference as sum_nonnegative_reference,
)
from ._scatters import (
    append_in_order as append_in_order,
    append_in_order_reference as append_in_order_reference,
    axes_at as axes_at,
    axes_at_reference as axes_at_reference,
    flags_before as flags_before,
    gather_clamped as gather_clamped,
    gather_clamped_reference as gather_clamped_reference,
    gathers_rows_faster as gathers_rows_faster,
    move_rows as move_rows,
    move_rows_in_place as move_rows_in_place,
    move_rows_reference as move_rows_reference,
    picked_where as picked_where,
    scatters_element_by_element as scatters_element_by_element,
)
from ._sorting import (
    argsort_keys as argsort_keys,
    argsort_keys_reference as argsort_keys_reference,
    enable_x64_locally as enable_x64_locally,
    float32_sort_keys as float32_sort_keys,
    radix_order as radix_order,
    redone_in_groups as redone_in_groups,
    set_positions as set_positions,
    smallest_first as smallest_first,
    smallest_first_of as smallest_first_of,
    smallest_first_of_reference as smallest_first_of_reference,
    sorts_compile_slowly as sorts_compile_slowly,
)
