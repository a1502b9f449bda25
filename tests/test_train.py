"""Training an `Interpolator` with the standard Equinox pattern: optax's adam and adamw
(weight decay included) through `eqx.filter(model, eqx.is_inexact_array)` train the
values and the kernel's parameters and leave the tree exactly as built."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kdeqx


def _field(x):
    return jnp.sin(3 * x[..., 0]) + x[..., 1] ** 2


def _train(model, optimiser, x, y, steps):
    state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(
            model
        )
        updates, state = optimiser.update(
            grads, state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(steps):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    return model, losses


_KERNELS = {
    "gaussian": dict(kernel="gaussian", length_scale=0.05),
    "idw": dict(kernel="idw"),
    "rbf": dict(kernel="rbf", rbf="gaussian", epsilon=3.0, smoothing=0.01),
    "mls": dict(kernel="mls"),
}


@pytest.mark.parametrize("optimiser", ["adam", "adamw"])
@pytest.mark.parametrize("kernel", sorted(_KERNELS))
def test_training_moves_values_and_parameters_not_the_tree(kernel, optimiser):
    rng = np.random.default_rng(0)
    points = jnp.asarray(rng.random((300, 2)), jnp.float32)
    tree = kdeqx.KDTree(points)
    model = kdeqx.Interpolator(
        tree, jnp.zeros(300, jnp.float32), k=8, **_KERNELS[kernel]
    )
    x = jnp.asarray(rng.random((200, 2)), jnp.float32)
    y = _field(x)
    # Steps larger than the length scale itself: a raw one could go below zero.
    make = {
        "adam": lambda: optax.adam(0.1),
        "adamw": lambda: optax.adamw(0.1, weight_decay=0.1),
    }[optimiser]
    trained, losses = _train(model, make(), x, y, steps=30)

    assert min(losses) < 0.5 * losses[0]
    before, after = jax.tree.leaves(tree), jax.tree.leaves(trained.tree)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("length_scale", "epsilon"):
        value = getattr(trained, name)
        if value is not None:
            assert np.isfinite(value) and value > 0
    assert np.all(np.asarray(jnp.maximum(trained.smoothing, 0)) >= 0)
    assert np.all(np.isfinite(trained(x)))
    assert not np.array_equal(np.asarray(trained.values), np.asarray(model.values))


def test_the_usual_filter_selects_no_tree_array():
    rng = np.random.default_rng(1)
    points = rng.random((50, 3))
    model = kdeqx.Interpolator(
        kdeqx.KDTree(points), rng.random(50), kernel="gaussian", length_scale=0.3
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    assert jax.tree.leaves(params.frozen_tree) == []
    assert {a.shape for a in jax.tree.leaves(params)} == {(50,), ()}
    # The tree comes back bit for bit, and the layer answers as the tree does.
    for a, b in zip(jax.tree.leaves(model.tree), jax.tree.leaves(kdeqx.KDTree(points))):
        np.testing.assert_array_equal(a, b)
    x = rng.random((7, 3))
    np.testing.assert_allclose(
        model(x),
        kdeqx.KDTree(points).interpolate(
            x, model.values, kernel="gaussian", length_scale=0.3
        ),
        rtol=1e-6,
    )
    np.testing.assert_allclose(model.length_scale, 0.3, rtol=1e-6)
