"""Small dense symmetric systems, batched over leading axes: one per query of a local
interpolation, solved exactly when they are regular and regularised when not.

Measured on XLA:CPU, LAPACK's batched LU (`jnp.linalg.solve`) beats eliminations
written as array operations (masked or unrolled) for systems of 30-40 unknowns.

Known JAX issue (jax 0.10.2, CPU, seen on 2 cores): a program with two independent
batched `jnp.linalg.solve`s of more than about 2,000 systems each can deadlock; the
gradient of a `vmap` over single-query solves is such a program. Take gradients of
the batched call instead (`jax.grad(lambda x: f(x).sum())`: queries are independent),
which keeps every solve within a chunk of `_local._CHUNK` queries.
"""

import jax.lax as lax
import jax.numpy as jnp

from ._custom_types import Array, Bool, Float


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


def _solve_or_regularise(
    matrix: Float[Array, "*batch m m"],
    rhs: Float[Array, "*batch m s"],
    ridge_signs: Float[Array, " m"],
) -> Float[Array, "*batch m s"]:
    """`matrix^-1 rhs`, or for a numerically singular system the solution with
    `sqrt(eps)` times its largest entry times `ridge_signs` added to the diagonal (the
    second factorisation runs only when some system of the batch needs it)."""
    solution, singular = _lu_solve(matrix, rhs)

    def regularised(_):
        ridge = jnp.sqrt(jnp.finfo(matrix.dtype).eps) * _entry_scale(matrix)
        ridge = jnp.where(singular, ridge, 0)[..., None] * ridge_signs
        shifted = matrix + ridge[..., None] * jnp.eye(
            matrix.shape[-1], dtype=ridge.dtype
        )
        retried, _ = _lu_solve(shifted, rhs)
        return jnp.where(singular[..., None, None], retried, solution)

    return lax.cond(jnp.any(singular), regularised, lambda _: solution, None)


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
        return matrix @ vector

    def solve(_, vector):
        return _solve_or_regularise(lax.stop_gradient(matrix), vector, ridge_signs)

    return lax.custom_linear_solve(matvec, rhs, solve, symmetric=True)
