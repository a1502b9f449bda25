import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdeqx

from .helpers import central_difference


@ft.partial(jax.jit, static_argnums=2)
def _weighted_distances(points, x, k=4):
    distances, _ = kdeqx.KDTree(points).query(x, k)
    weights = jnp.arange(1, k + 1, dtype=distances.dtype)
    return jnp.sum(distances * weights)


@pytest.mark.x64
def test_grad_wrt_queries_matches_finite_differences():
    rng = np.random.default_rng(0)
    points = rng.random((200, 3))
    x = rng.random((5, 3))
    grad = jax.grad(_weighted_distances, argnums=1)(points, x)
    reference = central_difference(lambda x: float(_weighted_distances(points, x)), x)
    np.testing.assert_allclose(grad, reference, rtol=1e-6, atol=1e-8)


@pytest.mark.x64
def test_grad_wrt_points_matches_finite_differences():
    rng = np.random.default_rng(1)
    points = rng.random((40, 2))
    x = rng.random((6, 2))
    grad = jax.jit(jax.grad(_weighted_distances))(points, x)
    reference = central_difference(lambda p: float(_weighted_distances(p, x)), points)
    np.testing.assert_allclose(grad, reference, rtol=1e-6, atol=1e-8)
    assert np.abs(grad).sum() > 0


def test_filter_grad_wrt_the_tree_reaches_its_points():
    rng = np.random.default_rng(2)
    tree = kdeqx.KDTree(rng.random((50, 2)))
    x = rng.random((4, 2))

    @eqx.filter_grad
    def loss(tree):
        return tree.query(x, 2)[0].sum()

    grads = loss(tree)
    reference = jax.grad(lambda p: kdeqx.KDTree(p).query(x, 2)[0].sum())(tree.points)
    np.testing.assert_allclose(grads.points, reference)


def test_gradient_at_zero_distance_is_finite():
    points = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    x = points[:2]  # queries exactly on data points (the first also duplicated)
    grad_x, grad_points = jax.grad(_weighted_distances, argnums=(1, 0))(points, x, 3)
    assert np.isfinite(grad_x).all() and np.isfinite(grad_points).all()
    grad_f32 = jax.grad(_weighted_distances, argnums=1)(
        points.astype(np.float32), x.astype(np.float32), 3
    )
    assert np.isfinite(grad_f32).all()


def test_sentinels_carry_no_gradient():
    points = np.array([[0.0, 0.0], [2.0, 0.0]])
    x = np.array([[0.5, 0.0]])

    def loss(x):
        distances, _ = kdeqx.KDTree(points).query(x, 4, distance_upper_bound=1.0)
        return jnp.sum(jnp.where(jnp.isfinite(distances), distances, 0.0))

    np.testing.assert_allclose(jax.grad(loss)(x), [[1.0, 0.0]])


@pytest.mark.x64
def test_second_derivatives_match_the_closed_form():
    """The distances' values come from the walk, their derivatives from the rows: the
    Hessian of `|x - p|` is `(I - u u^T) / |x - p|`, `u` the unit vector."""
    rng = np.random.default_rng(3)
    points = rng.random((300, 3))
    tree = kdeqx.KDTree(points)
    x = rng.random((4, 3))

    def total_distance(xi):
        return tree.query(xi, 3)[0].sum()

    hessians = jax.vmap(jax.hessian(total_distance))(x)
    _, indices = tree.query(x, 3)
    diff = x[:, None, :] - points[np.asarray(indices)]
    distance = np.linalg.norm(diff, axis=-1)
    unit = diff / distance[..., None]
    outer = unit[..., :, None] * unit[..., None, :]
    expected = ((np.eye(3) - outer) / distance[..., None, None]).sum(axis=1)
    np.testing.assert_allclose(hessians, expected, rtol=1e-8, atol=1e-10)
    # The primal output of a forward derivative is differentiable too.
    primal_of_jvp = jax.grad(lambda xi: jax.jvp(total_distance, (xi,), (xi,))[0])
    np.testing.assert_allclose(
        jax.vmap(primal_of_jvp)(x), jax.vmap(jax.grad(total_distance))(x), rtol=1e-12
    )
