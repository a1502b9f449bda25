"""From kdeqx's fixed-capacity answers to scipy's shapes, for code ported from scipy.

These run outside `jax.jit`, on concrete arrays, and refuse truncated answers: a
capacity that was too small would otherwise become a silently shorter list.
"""

import numpy as np

from .._custom_types import ArrayLike


def _checked_count(count: ArrayLike, capacity: int, argument: str) -> int:
    count = int(np.asarray(count))
    if count > capacity:
        raise ValueError(
            f"The answer was cut off: {count} found, room for {capacity}; call again "
            f"with a larger `{argument}`."
        )
    return count


def ball_lists(indices: ArrayLike, counts: ArrayLike, *, sort: bool = False) -> list:
    """scipy's lists of neighbours from `query_ball_point` or `query_ball_tree`.

    **Arguments:**

    - `indices`, `counts`: as returned (`(..., m)` and `(...)`).
    - `sort`: `True` orders each list by index, as scipy does for a batch of
        queries (its `return_sorted` default) and for `query_ball_tree`; `False`
        (default) keeps the order of `indices` (nearest first, unless the query
        was asked for `return_sorted=True`).

    **Returns:** for one query, a list of indices; for a batch, a nested list of the
    batch's shape (scipy returns an object array of lists; wrap in
    `np.array(..., dtype=object)` if needed). Raises `ValueError` if some query
    found more than `m` points.
    """
    indices, counts = np.asarray(indices), np.asarray(counts)
    capacity = indices.shape[-1]
    _checked_count(counts.max(initial=0), capacity, "max_neighbors")
    if counts.ndim == 0:
        found = indices[: int(counts)]
        return sorted(found.tolist()) if sort else found.tolist()
    return [
        ball_lists(row, count, sort=sort)
        for row, count in zip(indices, counts, strict=True)
    ]


def pair_array(pairs: ArrayLike, count: ArrayLike) -> np.ndarray:
    """scipy's `query_pairs(..., output_type="ndarray")`: the `(count, 2)` pairs
    `i < j`, here ordered by `i`, then `j`. Raises `ValueError` if `max_pairs` cut
    the answer off."""
    pairs = np.asarray(pairs)
    return pairs[: _checked_count(count, len(pairs), "max_pairs")]


def pair_set(pairs: ArrayLike, count: ArrayLike) -> set[tuple[int, int]]:
    """scipy's `query_pairs(...)` (the default `output_type="set"`): a set of
    `(i, j)` tuples with `i < j`."""
    return {(int(i), int(j)) for i, j in pair_array(pairs, count)}


def to_scipy_sparse(matrix, count: ArrayLike | None = None):
    """A `scipy.sparse.coo_matrix` from `sparse_distance_matrix`'s BCOO matrix
    (scipy's `output_type="coo_matrix"`); its padding is dropped. Pass the returned
    `count` to refuse a matrix that `max_entries` cut off. Needs scipy.

    Pairs at distance 0 are kept as explicit zeros (scipy's `dok_matrix` output
    would drop them; its `coo_matrix` output keeps them).
    """
    import scipy.sparse

    data, indices = np.asarray(matrix.data), np.asarray(matrix.indices)
    rows, cols = indices[:, 0], indices[:, 1]
    stored = (rows < matrix.shape[0]) & (cols < matrix.shape[1])
    if count is not None:
        _checked_count(count, len(data), "max_entries")
    return scipy.sparse.coo_matrix(
        (data[stored], (rows[stored], cols[stored])), shape=matrix.shape
    )


def distance_dict(matrix, count: ArrayLike | None = None) -> dict:
    """scipy's `sparse_distance_matrix(..., output_type="dict")`: `{(i, j): d}`
    from `sparse_distance_matrix`'s BCOO matrix (see `to_scipy_sparse`)."""
    coo = to_scipy_sparse(matrix, count)
    return {
        (int(i), int(j)): float(d)
        for i, j, d in zip(coo.row, coo.col, coo.data, strict=True)
    }
