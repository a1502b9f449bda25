"""A scipy script ported to kdeqx: the same calls, no capacities, the same answers.

Each block is a scipy `cKDTree` call beside its kdeqx port. Outside `jax.jit`, the
queries that collect neighbours (`query_ball_point`, `query_pairs`,
`sparse_distance_matrix`) count first and size their own capacity, and a new number
of queries within a size bucket reuses the compiled program.
"""

import os
import time

import jax
import numpy as np
import scipy.spatial

import kdeqx


jax.config.update("jax_enable_x64", True)  # scipy answers in float64; so does this

n = 200_000 if os.environ.get("KDEQX_FULL") else 20_000
rng = np.random.default_rng(0)
points = rng.random((n, 3))
queries = rng.random((1_000, 3))
radius = 0.03

reference = scipy.spatial.cKDTree(points, leafsize=16)
tree = kdeqx.KDTree(points, leafsize=16)  # scipy's keyword names are accepted

# k nearest neighbours
want_d, want_i = reference.query(queries, k=8, workers=-1)
got_d, got_i = tree.query(queries, k=8, workers=-1)
print(
    "query: indices equal:",
    np.array_equal(got_i, want_i),
    "| distances within",
    f"{np.abs(np.asarray(got_d) - want_d).max():.1e}",
)

# Neighbours within a radius, as scipy's lists (sorted by index, as scipy sorts them)
want_lists = reference.query_ball_point(queries, radius)
_, indices, counts = tree.query_ball_point(queries, radius, return_sorted=True)
got_lists = kdeqx.ball_lists(indices, counts)
print(
    "query_ball_point: lists equal:",
    all(g == list(w) for g, w in zip(got_lists, want_lists, strict=True)),
    f"| capacity {indices.shape[-1]} for at most {int(counts.max())} neighbours",
)
lengths = tree.query_ball_point(queries, radius, return_length=True)
print(
    "query_ball_point(return_length=True): equal:",
    np.array_equal(
        lengths, reference.query_ball_point(queries, radius, return_length=True)
    ),
)

# Every pair within the radius, as scipy's set
pairs, _, count = tree.query_pairs(radius)
print(
    "query_pairs: sets equal:",
    kdeqx.pair_set(pairs, count) == reference.query_pairs(radius),
    f"| {int(count):,} pairs",
)

# The sparse distance matrix between two sets
other_points = rng.random((n // 2, 3))
other_reference = scipy.spatial.cKDTree(other_points)
other = kdeqx.KDTree(other_points)
matrix, entries = tree.sparse_distance_matrix(other, radius)
want = reference.sparse_distance_matrix(
    other_reference, radius, output_type="coo_matrix"
)
got = kdeqx.to_scipy_sparse(matrix, entries)
difference = abs(got.tocsr() - want.tocsr()).max() if want.nnz else 0.0
print(
    "sparse_distance_matrix: entries",
    f"{got.nnz:,} (scipy {want.nnz:,}), largest difference {difference:.1e}",
)

# The two-point correlation's pair counts
radii = np.linspace(0.0, 0.1, 6)
print(
    "count_neighbors: equal:",
    np.array_equal(
        tree.count_neighbors(other, radii),
        reference.count_neighbors(other_reference, radii),
    ),
)

# New batch sizes in one size bucket share one compiled program.
times = []
for size in (900, 901, 950, 1000):
    start = time.perf_counter()
    jax.block_until_ready(tree.query(queries[:size], k=8))
    times.append(time.perf_counter() - start)
print(
    "query at 900, 901, 950, 1000 queries (one bucket):",
    ", ".join(f"{t * 1e3:.1f} ms" for t in times),
)
