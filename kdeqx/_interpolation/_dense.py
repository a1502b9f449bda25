"""Small dense symmetric systems, batched over leading axes: one per query of a local
interpolation, solved exactly when they are regular and regularised when not.

On the CPU the systems are solved by Gaussian elimination written as array operations
(`_eliminate_solve`, with LAPACK's pivots), never by jaxlib's LAPACK kernels. Those
kernels split a batch over XLA's intra-op thread pool and block their own pool thread
until the pieces are done; when as many of them as the pool has threads run at once
(two independent batched solves of one program, such as a fit and its gradient, or a
program split over several CPU devices), every thread waits on work that no thread is
left to run, and the program hangs. No batch size, thread setting or transform makes
elimination wait on anything.

On a TPU the same elimination runs with the systems along the lanes
(`_eliminate_in_lanes`): XLA's batched LU there solved a local RBF's systems several
times slower and compiled for far longer (`benchmarks/accelerator.py
--local-solvers`). Elsewhere (GPU) the LU factorisation is XLA's own.
"""

import jax
import jax.lax as lax
import jax.numpy as jnp

from .._backend import FULL_PRECISION
from .._custom_types import Array, Bool, Float


def full_product(a: Array, b: Array) -> Array:
    """`a @ b` at full precision ([`kdeqx._backend.FULL_PRECISION`][])."""
    return jnp.matmul(a, b, precision=FULL_PRECISION)


def _entry_scale(matrix: Float[Array, "*batch m m"]) -> Float[Array, "*batch"]:
    """The size of a matrix's entries: the unit of its pivots and of a ridge."""
    scale = jnp.max(jnp.abs(matrix), axis=(-2, -1))
    return jnp.where(scale > 0, scale, 1)


def _lu_solve(
    matrix: Float[Array, "*batch m m"], rhs: Float[Array, "*batch m s"]
) -> tuple[Float[Array, "*batch m s"], Bool[Array, "*batch"]]:
    """The LU solution, and whether the system is numerically singular: a pivot
    within rounding (`m eps`) of zero relative to the largest entry, or a solution
    that overflowed. An exactly singular system (collinear points under a linear
    term) rarely gives an exactly zero pivot: the rounding of its entries, which
    changes with how XLA compiles them, leaves a pivot of the order of `eps` and a
    finite, meaningless solution."""
    lu, _, permutation = lax.linalg.lu(matrix)
    permuted = jnp.take_along_axis(rhs, permutation[..., None], axis=-2)
    lower = lax.linalg.triangular_solve(
        lu, permuted, left_side=True, lower=True, unit_diagonal=True
    )
    solution = lax.linalg.triangular_solve(lu, lower, left_side=True, lower=False)
    pivots = jnp.abs(jnp.diagonal(lu, axis1=-2, axis2=-1))
    size = matrix.shape[-1]
    tolerance = size * jnp.finfo(matrix.dtype).eps * _entry_scale(matrix)
    singular = jnp.min(pivots, axis=-1) <= tolerance
    return solution, singular | ~jnp.all(jnp.isfinite(solution), axis=(-2, -1))


def _eliminate_solve(
    matrix: Float[Array, "m m"], rhs: Float[Array, "m s"]
) -> tuple[Float[Array, "m s"], Bool[Array, ""]]:
    """As `_lu_solve`, for one system (`vmap` batches it), by Gaussian elimination
    with partial pivoting in array operations: no LAPACK. Rows are not swapped: step
    `j` takes as pivot the unused row of largest magnitude in column `j` (LU's
    pivot) and eliminates the column from the unused rows; back substitution then
    follows the pivot rows in reverse."""
    m = matrix.shape[-1]
    rows = jnp.arange(m)

    def eliminate(j, carry):
        augmented, used, pivot_rows, smallest = carry
        column = augmented[:, j]
        p = jnp.argmax(jnp.where(used, -1, jnp.abs(column))).astype(jnp.int32)
        pivot = column[p]
        used = used | (rows == p)
        factors = jnp.where(used, 0, column / jnp.where(pivot != 0, pivot, 1))
        augmented = augmented - factors[:, None] * augmented[p][None, :]
        smallest = jnp.minimum(smallest, jnp.abs(pivot))
        return augmented, used, pivot_rows.at[j].set(p), smallest

    def substitute(i, solution):
        j = m - 1 - i
        row = augmented[pivot_rows[j]]
        # The unknowns after `j` are known, those before still 0.
        value = (row[m:] - full_product(row[:m], solution)) / row[j]
        return solution.at[j].set(value)

    augmented = jnp.concatenate([matrix, rhs.astype(matrix.dtype)], axis=-1)
    init = (
        augmented,
        jnp.zeros(m, bool),
        jnp.zeros(m, jnp.int32),
        jnp.array(jnp.inf, matrix.dtype),
    )
    augmented, _, pivot_rows, smallest = lax.fori_loop(0, m, eliminate, init)
    solution = lax.fori_loop(0, m, substitute, jnp.zeros_like(augmented[:, m:]))
    tolerance = m * jnp.finfo(matrix.dtype).eps * _entry_scale(matrix)
    singular = smallest <= tolerance
    return solution, singular | ~jnp.all(jnp.isfinite(solution))


def _eliminate_in_lanes(
    matrix: Float[Array, "*batch m m"], rhs: Float[Array, "*batch m s"]
) -> tuple[Float[Array, "*batch m s"], Bool[Array, "*batch"]]:
    """As `_eliminate_solve`, for a whole batch at once with the systems along the
    last axis, where a vector machine keeps its lanes. A row is picked by a mask
    rather than gathered (the pivot row of a step, then of an unknown in the back
    substitution), so each step is a few dense passes over the batch."""
    *batch, m, s = rhs.shape
    augmented = jnp.concatenate([matrix, rhs.astype(matrix.dtype)], axis=-1)
    augmented = jnp.moveaxis(augmented.reshape(-1, m, m + s), 0, -1)
    rows = jnp.arange(m)[:, None]

    def row_of_step(augmented, step_of_row, j):
        return jnp.sum(jnp.where((step_of_row == j)[:, None], augmented, 0), axis=0)

    def eliminate(j, carry):
        augmented, step_of_row, smallest = carry
        column = lax.dynamic_index_in_dim(augmented, j, axis=1, keepdims=False)
        unused = step_of_row < 0
        magnitude = jnp.where(unused, jnp.abs(column), -1)
        largest = jnp.max(magnitude, axis=0)
        # LU's pivot: the first unused row of largest magnitude.
        first = jnp.min(jnp.where(magnitude == largest, rows, m), axis=0)
        step_of_row = jnp.where(rows == first, j, step_of_row)
        pivot_row = row_of_step(augmented, step_of_row, j)
        pivot = lax.dynamic_index_in_dim(pivot_row, j, keepdims=False)
        below = unused & (rows != first)
        factors = jnp.where(below, column / jnp.where(pivot != 0, pivot, 1), 0)
        augmented = augmented - factors[:, None] * pivot_row[None]
        return augmented, step_of_row, jnp.minimum(smallest, jnp.abs(pivot))

    def substitute(i, solution):
        j = m - 1 - i
        row = row_of_step(augmented, step_of_row, j)
        # The unknowns after `j` are known, those before still 0.
        known = jnp.sum(row[:m, None] * solution, axis=0)
        value = (row[m:] - known) / lax.dynamic_index_in_dim(row, j, keepdims=False)
        return lax.dynamic_update_index_in_dim(solution, value, j, axis=0)

    init = (
        augmented,
        jnp.full(augmented.shape[::2], -1, jnp.int32),
        jnp.full(augmented.shape[-1:], jnp.inf, matrix.dtype),
    )
    augmented, step_of_row, smallest = lax.fori_loop(0, m, eliminate, init)
    solution = lax.fori_loop(0, m, substitute, jnp.zeros_like(augmented[:, m:]))
    solution = jnp.moveaxis(solution, -1, 0).reshape(*batch, m, s)
    tolerance = m * jnp.finfo(matrix.dtype).eps * _entry_scale(matrix)
    singular = smallest.reshape(batch) <= tolerance
    return solution, singular | ~jnp.all(jnp.isfinite(solution), axis=(-2, -1))


def solves_by_elimination() -> bool:
    """Whether systems are solved by `_eliminate_solve` rather than an LU
    factorisation: on the CPU, where the factorisation is jaxlib's LAPACK kernel,
    which can deadlock (see the module's docstring)."""
    return jax.default_backend() == "cpu"


def solves_in_lanes() -> bool:
    """Whether systems are solved by `_eliminate_in_lanes`: on a TPU (see the
    module's docstring)."""
    return jax.default_backend() == "tpu"


def _solve(matrix, rhs):
    if solves_in_lanes():
        return _eliminate_in_lanes(matrix, rhs)
    if not solves_by_elimination():
        return _lu_solve(matrix, rhs)
    solve = _eliminate_solve
    for _ in range(matrix.ndim - 2):
        solve = jax.vmap(solve)
    return solve(matrix, rhs)


@jax.custom_batching.custom_vmap
def _solve_or_regularise(
    matrix: Float[Array, "*batch m m"],
    rhs: Float[Array, "*batch m s"],
    ridge_signs: Float[Array, "*#batch m"],
) -> Float[Array, "*batch m s"]:
    """`matrix^-1 rhs`, or for a numerically singular system the solution with
    `sqrt(eps)` times its largest entry times `ridge_signs` added to the diagonal (the
    second factorisation runs only when some system of the batch needs it).

    Under `vmap` the mapped systems are solved as one batch: a vmapped `lax.cond` on a
    per-system predicate becomes a `select` that runs both branches, and the second
    factorisation ran for every system, which made fitting markedly slower (see
    `benchmarks/interpolate.py`)."""
    solution, singular = _solve(matrix, rhs)

    def regularised(_):
        ridge = jnp.sqrt(jnp.finfo(matrix.dtype).eps) * _entry_scale(matrix)
        ridge = jnp.where(singular, ridge, 0)[..., None] * ridge_signs
        shifted = matrix + ridge[..., None] * jnp.eye(
            matrix.shape[-1], dtype=ridge.dtype
        )
        retried, _ = _solve(shifted, rhs)
        return jnp.where(singular[..., None, None], retried, solution)

    return lax.cond(jnp.any(singular), regularised, lambda _: solution, None)


@_solve_or_regularise.def_vmap
def _solve_mapped(axis_size, in_batched, matrix, rhs, ridge_signs):
    def leading(x, batched):
        return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))

    matrix, rhs, ridge_signs = map(leading, (matrix, rhs, ridge_signs), in_batched)
    # Called again, so that an outer `vmap` also lands here.
    return _solve_or_regularise(matrix, rhs, ridge_signs), True


def solve_symmetric(
    matrix: Float[Array, "*batch m m"],
    rhs: Float[Array, "*batch m s"],
    ridge_signs: Float[Array, " m"] | None = None,
) -> Float[Array, "*batch m s"]:
    """Solves symmetric systems, batched.

    A numerically singular system (duplicate points, degenerate polynomial terms) is
    solved with a ridge of `sqrt(eps)` times its largest entry added to its diagonal,
    with the signs `ridge_signs` (default all `+1`; a saddle-point system takes `-1`
    on its constraint rows), so that it has a finite, well-defined solution.

    Differentiated implicitly (`lax.custom_linear_solve`): a gradient costs one more
    solve and stores no factorisation.
    """
    if ridge_signs is None:
        ridge_signs = jnp.ones(matrix.shape[-1], matrix.dtype)

    def matvec(vector):
        return full_product(matrix, vector)

    def solve(_, vector):
        return _solve_or_regularise(lax.stop_gradient(matrix), vector, ridge_signs)

    return lax.custom_linear_solve(matvec, rhs, solve, symmetric=True)
