import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial import cKDTree

import kdeqx

from .helpers import central_difference, DTYPES


def _idw_reference(points, values, x, k, power):
    """numpy brute force: sort all distances, weight the k nearest by 1/d**power."""
    d = np.linalg.norm(x[:, None, :] - points[None], axis=-1)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    dk = np.take_along_axis(d, order, 1)
    out = []
    for row, dist in zip(order, dk):
        if (dist == 0).any():
            out.append(values[row[dist == 0]].mean(0))
        else:
            w = dist**-power
            out.append((w[:, None] * values[row].reshape(k, -1)).sum(0) / w.sum())
    return np.stack(out).reshape(len(x), *values.shape[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("power", [1.0, 2.0, 3.5])
def test_idw_matches_numpy_brute_force(power, dtype):
    rng = np.random.default_rng(0)
    points = rng.random((400, 3)).astype(dtype)
    values = rng.standard_normal((400, 2)).astype(dtype)
    x = rng.random((30, 3)).astype(dtype)
    out = kdeqx.KDTree(points).interpolate(x, values, k=6, power=power)
    reference = _idw_reference(
        points.astype(np.float64),
        values.astype(np.float64),
        x.astype(np.float64),
        6,
        power,
    )
    rtol = 2e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(out, reference, rtol=rtol, atol=rtol)
    assert out.dtype == dtype


@pytest.mark.x64
def test_idw_against_scipy_query_and_numpy_weights():
    rng = np.random.default_rng(1)
    points, values, x = rng.random((1000, 2)), rng.random(1000), rng.random((50, 2))
    d, i = cKDTree(points).query(x, 8)
    w = 1 / d**2
    expected = (w * values[i]).sum(1) / w.sum(1)
    np.testing.assert_allclose(kdeqx.KDTree(points).interpolate(x, values), expected)


def test_query_on_data_points_gives_the_mean_of_coincident_values():
    points = np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    values = np.array([1.0, 3.0, 10.0, 20.0])
    tree = kdeqx.KDTree(points)
    out = tree.interpolate(np.array([[0.0, 0.0], [1.0, 0.0]]), values, k=3)
    np.testing.assert_allclose(out, [2.0, 10.0])

    def loss(x, values):
        return tree.interpolate(x, values, k=3).sum()

    gx, gv = jax.grad(loss, argnums=(0, 1))(jnp.zeros((1, 2)), values)
    assert np.isfinite(gx).all() and np.isfinite(gv).all()
    np.testing.assert_allclose(gv, [0.5, 0.5, 0.0, 0.0])


def test_tiny_distances_do_not_overflow():
    points = np.array([[0.0], [1.0]], np.float32)
    out = kdeqx.KDTree(points).interpolate(
        np.array([[1e-30]], np.float32), np.array([1.0, 2.0]), k=2
    )
    np.testing.assert_allclose(out, [1.0])


@pytest.mark.parametrize("kernel", ["idw", "gaussian"])
def test_weighted_means_scale_with_their_gradients(kernel):
    """float32 data near 1e-30, whose squared distances and length scales underflow,
    and near 1e30, whose squares overflow: the same values as at unit scale, and
    the gradients of unit scale divided by the scale (they were NaN, or zero)."""
    rng = np.random.default_rng(3)
    points, x = rng.random((40, 2)), rng.random((6, 2))
    values = np.linspace(-1, 1, 40).astype(np.float32)

    @jax.jit
    def value_and_gradients(points, x, length_scale):
        def value(x, length_scale):
            tree = kdeqx.KDTree(points)
            options = {"length_scale": length_scale} if kernel == "gaussian" else {}
            return tree.interpolate(x, values, k=6, kernel=kernel, **options).sum()

        return jax.value_and_grad(value, argnums=(0, 1))(x, length_scale)

    def at(scale):
        scale = np.float32(scale)
        return value_and_gradients(
            (points * scale).astype(np.float32),
            (x * scale).astype(np.float32),
            np.float32(0.3) * scale,
        )

    unit, (unit_x, unit_length) = at(1.0)
    for scale in (1e-30, 1e30):
        value, (grad_x, grad_length) = at(scale)
        np.testing.assert_allclose(value, unit, rtol=1e-4)
        np.testing.assert_allclose(grad_x * scale, unit_x, rtol=1e-3, atol=1e-4)
        if kernel == "gaussian":
            np.testing.assert_allclose(grad_length * scale, unit_length, rtol=1e-3)


def test_gaussian_far_beyond_its_length_scale_takes_the_nearest():
    """Distances of 1e25 length scales (their squares overflow float32): the
    nearest point's value, with finite gradients."""
    points = np.array([[0.0], [1.0], [3.0]], np.float32)
    values = np.array([1.0, 2.0, 4.0], np.float32)
    tree = kdeqx.KDTree(points)

    def value(x):
        return tree.interpolate(x, values, k=3, kernel="gaussian", length_scale=1e-25)

    x = np.array([[0.8]], np.float32)
    np.testing.assert_allclose(value(x), [2.0])
    assert np.isfinite(jax.grad(lambda x: value(x).sum())(x)).all()


@pytest.mark.x64
@pytest.mark.parametrize("kernel", ["idw", "gaussian"])
def test_interpolator_grads_match_finite_differences(kernel):
    rng = np.random.default_rng(2)
    points = rng.random((60, 2))
    tree = kdeqx.KDTree(points)
    model = kdeqx.Interpolator(
        tree, rng.standard_normal(60), k=5, kernel=kernel, length_scale=0.2
    )
    x = rng.random((4, 2))

    @eqx.filter_jit
    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    grads = eqx.filter_grad(loss)(model, x)
    numeric = central_difference(
        lambda v: float(loss(eqx.tree_at(lambda m: m.values, model, v), x)),
        np.asarray(model.values),
    )
    np.testing.assert_allclose(grads.values, numeric, rtol=1e-6, atol=1e-9)
    grad_x = jax.grad(lambda x: loss(model, x))(x)
    np.testing.assert_allclose(
        grad_x,
        central_difference(lambda x: float(loss(model, x)), x),
        rtol=1e-5,
        atol=1e-8,
    )


@pytest.mark.x64
def test_gradient_wrt_points():
    rng = np.random.default_rng(3)
    points, values, x = rng.random((30, 2)), rng.random(30), rng.random((3, 2))

    @jax.jit
    def f(points):
        return kdeqx.KDTree(points).interpolate(x, values, k=4).sum()

    np.testing.assert_allclose(
        jax.grad(f)(points),
        central_difference(lambda p: float(f(p)), points),
        rtol=1e-5,
        atol=1e-8,
    )


@pytest.mark.x64
def test_gaussian_kernel_matches_reference():
    rng = np.random.default_rng(4)
    points, values, x = rng.random((300, 2)), rng.random((300, 3)), rng.random((20, 2))
    out = kdeqx.KDTree(points).interpolate(
        x, values, k=10, kernel="gaussian", length_scale=0.1
    )
    d, i = cKDTree(points).query(x, 10)
    w = np.exp(-(d**2) / (2 * 0.1**2))
    expected = (w[..., None] * values[i]).sum(1) / w.sum(1)[:, None]
    np.testing.assert_allclose(out, expected, rtol=1e-10)


def test_vmap_over_trees_and_partition_for_training():
    rng = np.random.default_rng(5)
    points = rng.random((3, 100, 2))
    values = rng.random((3, 100))
    x = rng.random((3, 7, 2))
    trees = jax.vmap(kdeqx.KDTree)(points)
    out = jax.vmap(lambda t, v, x: t.interpolate(x, v, k=4))(trees, values, x)
    for b in range(3):
        expected = kdeqx.KDTree(points[b]).interpolate(x[b], values[b], k=4)
        np.testing.assert_allclose(out[b], expected)
    model = kdeqx.Interpolator(kdeqx.KDTree(points[0]), values[0])
    trainable = eqx.tree_at(
        lambda m: m.values, jax.tree.map(lambda _: False, model), replace=True
    )
    params, static = eqx.partition(model, trainable)
    assert [a.shape for a in jax.tree.leaves(params)] == [(100,)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpolation_errors(dtype):
    tree = kdeqx.KDTree(np.zeros((5, 2), dtype))
    with pytest.raises(ValueError, match=r"one row per point, shape \(5, \.\.\.\)"):
        tree.interpolate(np.zeros(2, dtype), np.zeros(4))
    with pytest.raises(ValueError, match="`values` must be finite"):
        tree.interpolate(np.zeros(2, dtype), np.array([0, 0, np.nan, 0, 0]))
    with pytest.raises(ValueError, match="length_scale"):
        tree.interpolate(np.zeros(2, dtype), np.zeros(5), kernel="gaussian")
    # The runtime type checker of the test suite may reject the Literal first.
    with pytest.raises((ValueError, TypeError), match="kernel"):
        kdeqx.Interpolator(tree, np.zeros(5), kernel="cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty tree"):
        kdeqx.KDTree(np.zeros((0, 2))).interpolate(np.zeros(2), np.zeros(0))


_KERNEL_FORMS = [
    (dict(kernel="idw", power=3.0), kdeqx.IDW(3.0)),
    (dict(kernel="gaussian", length_scale=0.2), kdeqx.Gaussian(0.2)),
    (
        dict(kernel="rbf", rbf="gaussian", epsilon=3.0, smoothing=0.01),
        kdeqx.RBF("gaussian", epsilon=3.0, smoothing=0.01),
    ),
    (dict(kernel="rbf"), kdeqx.RBF()),
    (dict(kernel="mls", degree=2), kdeqx.MLS(2)),
]


@pytest.mark.parametrize("options, module", _KERNEL_FORMS, ids=lambda v: str(v)[:20])
def test_kernel_modules_answer_as_their_names_and_keywords(options, module):
    rng = np.random.default_rng(11)
    points, values, x = rng.random((200, 2)), rng.random(200), rng.random((9, 2))
    tree = kdeqx.KDTree(points)
    by_name = tree.interpolate(x, values, k=12, **options)
    by_module = tree.interpolate(x, values, k=12, kernel=module)
    np.testing.assert_array_equal(by_name, by_module)
    layer = kdeqx.Interpolator(tree, values, k=12, kernel=module)
    np.testing.assert_allclose(layer(x), by_name, rtol=1e-5, atol=1e-6)
    assert type(layer.kernel_module) is type(module)


def test_options_beside_a_kernel_module_raise():
    tree = kdeqx.KDTree(np.random.default_rng(0).random((20, 2)))
    x, values = np.zeros((1, 2)), np.zeros(20)
    with pytest.raises(ValueError, match="go into the kernel module"):
        tree.interpolate(x, values, kernel=kdeqx.Gaussian(0.1), length_scale=0.2)
    with pytest.raises(ValueError, match="power"):
        kdeqx.IDW(-1.0)
    with pytest.raises(ValueError, match="degree"):
        kdeqx.MLS(3)
