"""The local fits of `interpolate`: `kernel="rbf"` against scipy's RBFInterpolator with
neighbours, and `kernel="mls"` against closed forms and for continuity."""

import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.interpolate import RBFInterpolator

import kdeqx

from .helpers import central_difference, DTYPES


def _field(points):
    return np.sin(3 * points[:, 0]) + points[:, 1] ** 2


def _data(seed=0, n=200, q=25):
    rng = np.random.default_rng(seed)
    points = rng.random((n, 2))
    return points, _field(points), rng.random((q, 2))


# Every kernel at scipy's default degree and one above; -1 (no polynomial) where the
# kernel is positive definite without one. epsilon where the kernel needs it.
_RBF_CASES = [
    ("thin_plate_spline", None, None),
    ("thin_plate_spline", 2, None),
    ("cubic", None, None),
    ("cubic", 2, None),
    ("quintic", None, None),
    ("linear", None, None),
    ("linear", 1, None),
    ("multiquadric", None, 3.0),
    ("multiquadric", 1, 3.0),
    ("gaussian", None, 5.0),
    ("gaussian", -1, 5.0),
    ("gaussian", 1, 5.0),
    ("inverse_multiquadric", None, 3.0),
    ("inverse_multiquadric", -1, 3.0),
    ("inverse_quadratic", None, 3.0),
    ("inverse_quadratic", 2, 3.0),
]


@pytest.mark.x64
@pytest.mark.parametrize("kernel", ["rbf", "mls"])
def test_fits_do_not_depend_on_the_chunk(monkeypatch, kernel):
    """Queries fitted in chunks of 7 (the last padded) give what one chunk gives, up
    to rounding (float64: a batch of another size may be compiled differently)."""
    from kdeqx import _backend

    points, values, x = _data(q=30)
    tree = kdeqx.KDTree(points)
    fit = eqx.filter_jit(lambda t, x, v: t.interpolate(x, v, k=12, kernel=kernel))
    whole = fit(tree, x, values)
    monkeypatch.setattr(_backend._lanes, "CPU_FIT_CHUNK", 7)  # read when traced
    chunked = eqx.filter_jit(lambda t, x, v: t.interpolate(x, v, k=12, kernel=kernel))
    np.testing.assert_allclose(chunked(tree, x, values), whole, rtol=1e-9)
    assert not np.allclose(whole[:-1], whole[1:])  # distinct answers per query


@pytest.mark.x64
@pytest.mark.parametrize("rbf, degree, epsilon", _RBF_CASES)
def test_rbf_matches_scipy(rbf, degree, epsilon):
    points, values, x = _data()
    out = kdeqx.KDTree(points).interpolate(
        x, values, k=12, kernel="rbf", rbf=rbf, degree=degree, epsilon=epsilon
    )
    expected = RBFInterpolator(
        points,
        values,
        neighbors=12,
        kernel=rbf,
        degree=degree,
        epsilon=1.0 if epsilon is None else epsilon,
    )(x)
    # The kernels with a shape parameter give worse-conditioned local systems.
    rtol = 1e-10 if epsilon is None else 1e-6
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol)


@pytest.mark.x64
def test_rbf_smoothing_scalar_and_per_point_and_features_match_scipy():
    points, values, x = _data(1)
    rng = np.random.default_rng(1)
    features = np.stack([values, rng.random(len(points))], axis=1)
    per_point = rng.random(len(points)) * 1e-2
    tree = kdeqx.KDTree(points)
    for smoothing in (0.3, per_point):
        out = tree.interpolate(x, features, k=10, kernel="rbf", smoothing=smoothing)
        expected = RBFInterpolator(points, features, neighbors=10, smoothing=smoothing)
        np.testing.assert_allclose(out, expected(x), rtol=1e-9, atol=1e-10)


@pytest.mark.x64
def test_rbf_with_duplicates():
    points, values, x = _data(2, n=60)
    points = np.concatenate([points, points[:5]])
    values = np.concatenate([values, values[:5] + 1.0])
    tree = kdeqx.KDTree(points)
    # With smoothing the systems are regular: scipy's answer.
    out = tree.interpolate(x, values, k=10, kernel="rbf", smoothing=0.1)
    expected = RBFInterpolator(points, values, neighbors=10, smoothing=0.1)(x)
    np.testing.assert_allclose(out, expected, rtol=1e-9)
    # Without, scipy raises; kdeqx regularises: finite, and the duplicates share the
    # mean of their values.
    at_duplicates = tree.interpolate(points[:5], values, k=10, kernel="rbf")
    np.testing.assert_allclose(at_duplicates, values[:5] + 0.5, rtol=1e-6)
    elsewhere = tree.interpolate(x, values, k=10, kernel="rbf")
    assert np.all(np.isfinite(elsewhere))


@pytest.mark.x64
def test_rbf_collinear_neighbourhood_is_finite_and_exact_on_the_line():
    t = np.linspace(0, 1, 30)
    points = np.stack([t, 2 * t], axis=1)
    values = np.sin(3 * t)
    tree = kdeqx.KDTree(points)
    out = tree.interpolate(points[3:6], values, k=8, kernel="rbf")
    np.testing.assert_allclose(out, values[3:6], atol=1e-6)
    assert np.all(np.isfinite(tree.interpolate(np.array([[0.5, 0.1]]), values, k=8)))


def _solvers():
    from kdeqx._interpolation._dense import (
        _eliminate_in_lanes,
        _eliminate_solve,
        _lu_solve,
    )

    return {
        "lu": _lu_solve,
        "elimination": _eliminate_solve,
        "lanes": _eliminate_in_lanes,
    }


@pytest.mark.x64
@pytest.mark.parametrize("solver", ["lu", "elimination", "lanes"])
def test_systems_singular_up_to_rounding_count_as_singular(solver):
    """A saddle-point system whose polynomial columns are dependent but for rounding
    (collinear points under a linear term, entries rounded as compiled code may):
    LU finds a tiny pivot rather than zero, and a finite, meaningless solution. It
    must count as singular (and be regularised), as the exactly singular one does."""
    solve = _solvers()[solver]
    t = np.linspace(0.1, 1, 8)
    kernel = np.exp(-20 * (t[:, None] - t[None, :]) ** 2)
    rhs = jnp.asarray(np.concatenate([np.sin(3 * t), np.zeros(3)])[:, None])
    for noise, singular in [(0, True), (4e-16, True), (1e-6, False)]:
        # The third column is twice the second, off by `noise` relative.
        third = 2 * t * (1 + noise * np.sin(7 * t))
        poly = np.stack([np.ones_like(t), t, third], axis=1)
        matrix = np.block([[kernel, poly], [poly.T, np.zeros((3, 3))]])
        solution, flagged = jax.jit(solve)(jnp.asarray(matrix), rhs)
        assert bool(flagged) == singular, noise
        if not singular:  # ill-conditioned (1e12): the residual is what is stable
            assert np.max(np.abs(matrix @ solution - rhs)) < 1e-9


@pytest.mark.parametrize("solver", ["elimination", "lanes"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_eliminate_solves_as_lu(dtype, solver):
    """The solvers that replace XLA's LU (LAPACK's on several CPU devices; on a TPU,
    the systems along the lanes): saddle-point systems with their zero block first
    (the first pivot must come from another row), several right-hand sides, against
    float64 numpy, and a zero pivot found exactly where LU finds one."""
    from kdeqx._interpolation._dense import _lu_solve

    solve = _solvers()[solver]
    if solver == "elimination":
        solve = jax.vmap(solve)
    rng = np.random.default_rng(0)
    m, r = 12, 3
    kernel = rng.standard_normal((40, m - r, m - r)) + 3 * np.eye(m - r)
    poly = rng.standard_normal((40, m - r, r))
    zeros = np.zeros((40, r, r))
    matrix = np.block(
        [[zeros, poly.transpose(0, 2, 1)], [poly, kernel + kernel.transpose(0, 2, 1)]]
    )
    matrix[-1] = 0  # singular: a zero pivot
    rhs = rng.standard_normal((40, m, 2))
    ours, ours_singular = jax.jit(solve)(matrix.astype(dtype), rhs.astype(dtype))
    _, lu_singular = _lu_solve(jnp.asarray(matrix, dtype), jnp.asarray(rhs, dtype))
    np.testing.assert_array_equal(ours_singular, lu_singular)
    assert list(np.flatnonzero(ours_singular)) == [39]
    expected = np.linalg.solve(matrix[:-1], rhs[:-1])
    tolerance = 1e-3 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(ours[:-1], expected, rtol=tolerance, atol=tolerance)


def test_lanes_keep_lu_backward_stable():
    """Ill-conditioned saddle-point systems (random symmetric blocks): the residuals
    of the lanes' elimination stay those of LU with partial pivoting. Eliminating a
    column from the rows already used as well (Gauss-Jordan, no back substitution)
    left residuals of several units on such systems."""
    from kdeqx._interpolation._dense import _eliminate_in_lanes, _lu_solve

    rng = np.random.default_rng(0)
    m = 36
    matrix = rng.standard_normal((200, m, m)).astype(np.float32)
    matrix = matrix + matrix.transpose(0, 2, 1)
    matrix[:, 32:, 32:] = 0
    rhs = rng.standard_normal((200, m, 1)).astype(np.float32)

    def residuals(solve):
        solution, _ = jax.jit(solve)(matrix, rhs)
        product = np.einsum("bij,bjk->bik", matrix.astype(np.float64), solution)
        return np.max(np.abs(product - rhs), axis=(1, 2))

    ours, lu = residuals(_eliminate_in_lanes), residuals(_lu_solve)
    assert np.max(ours) < 4 * np.max(lu)
    assert np.median(ours) < 2 * np.median(lu)


def _factorisations_outside_cond(jaxpr) -> int:
    """How many factorisations a jaxpr runs unconditionally: LU factorisations, or
    the loops of elimination (where the systems are solved by elimination)."""
    count = 0
    for equation in jaxpr.eqns:
        if equation.primitive.name == "cond":
            continue
        count += equation.primitive.name in ("lu", "scan", "while")
        for param in equation.params.values():
            for inner in param if isinstance(param, tuple) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    count += _factorisations_outside_cond(inner)
    return count


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mapped_solves_retry_only_the_batch_that_needs_it(dtype):
    """`solve_symmetric` under `vmap` (as the local fits call it, once per query)
    solves the systems as one batch: as unmapped, the regularised second
    factorisation stays inside the `cond` that skips it, which a vmapped `cond` on
    a per-system predicate would turn into a `select` running both. The results
    equal the batched call's and numpy's, with a singular system among them
    regularised to a finite solution."""
    from kdeqx._interpolation._dense import solve_symmetric

    rng = np.random.default_rng(1)
    half = rng.standard_normal((6, 5, 5))
    matrix = half @ half.transpose(0, 2, 1) + 5 * np.eye(5)
    matrix[2] = np.outer(np.ones(5), np.ones(5))  # rank one: singular
    matrix, rhs = jnp.asarray(matrix, dtype), jnp.asarray(rng.random((6, 5, 1)), dtype)

    mapped = jax.vmap(solve_symmetric)

    def unconditional(fn):
        return _factorisations_outside_cond(jax.make_jaxpr(fn)(matrix, rhs).jaxpr)

    assert unconditional(mapped) == unconditional(solve_symmetric) > 0

    ours, batched = jax.jit(mapped)(matrix, rhs), jax.jit(solve_symmetric)(matrix, rhs)
    np.testing.assert_array_equal(ours, batched)
    assert np.all(np.isfinite(ours[2]))
    regular = np.array([0, 1, 3, 4, 5])
    ours = np.asarray(ours)
    expected = np.linalg.solve(
        np.asarray(matrix, np.float64)[regular], np.asarray(rhs, np.float64)[regular]
    )
    tolerance = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(ours[regular], expected, rtol=tolerance, atol=tolerance)


def test_float32_rbf_on_dense_points_matches_scipy():
    """Dense points (n = 1e6 in the unit cube) give thin-plate entries of ~1e-3
    beside polynomial ones of ~1: no regular system may be mistaken for singular
    (0.5 % were, and their ridge cost errors of 7e-4 against float64 scipy)."""
    rng = np.random.default_rng(1)
    points, x = rng.random((1_000_000, 3)), rng.random((2000, 3))
    values = np.sin(2 * np.pi * points[:, 0]) * np.cos(np.pi * points[:, 1])
    expected = RBFInterpolator(points, values, neighbors=32)(x)
    tree = kdeqx.KDTree(points.astype(np.float32))
    ours = tree.interpolate(
        x.astype(np.float32), values.astype(np.float32), k=32, kernel="rbf"
    )
    np.testing.assert_allclose(ours, expected, atol=1e-5)


@pytest.mark.x64
def test_rbf_k_beyond_n_uses_every_point():
    points, values, x = _data(3, n=9)
    out = kdeqx.KDTree(points).interpolate(x, values, k=50, kernel="rbf")
    expected = RBFInterpolator(points, values, neighbors=50)(x)
    np.testing.assert_allclose(out, expected, rtol=1e-10)


@pytest.mark.x64
def test_rbf_with_the_tpus_solver_matches_scipy_and_its_gradients(monkeypatch):
    """The whole fit with its systems solved along the lanes (a TPU's way), on the
    CPU: scipy's answer, the duplicates' systems regularised to the mean of their
    values, and gradients equal to those of the CPU's elimination."""
    from kdeqx._interpolation import _dense

    points, values, x = _data(2, n=60)
    points = np.concatenate([points, points[:5]])
    values = np.concatenate([values, values[:5] + 1.0])
    tree = kdeqx.KDTree(points)

    def loss(x, values):
        return jnp.sum(tree.interpolate(x, values, k=10, kernel="rbf") ** 2)

    args = (jnp.asarray(x), jnp.asarray(values))
    cpu_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
    jax.clear_caches()  # the solver is chosen when traced
    monkeypatch.setattr(_dense, "solves_in_lanes", lambda: True)
    try:
        out = tree.interpolate(x, values, k=10, kernel="rbf", smoothing=0.1)
        expected = RBFInterpolator(points, values, neighbors=10, smoothing=0.1)(x)
        np.testing.assert_allclose(out, expected, rtol=1e-9)
        at_duplicates = tree.interpolate(points[:5], values, k=10, kernel="rbf")
        np.testing.assert_allclose(at_duplicates, values[:5] + 0.5, rtol=1e-6)
        lanes_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
        for lanes, cpu in zip(lanes_grads, cpu_grads, strict=True):
            np.testing.assert_allclose(lanes, cpu, rtol=1e-6, atol=1e-9)
    finally:
        jax.clear_caches()


def test_rbf_float32_close_to_scipy():
    points, values, x = _data(4)
    out = kdeqx.KDTree(points.astype(np.float32)).interpolate(
        x.astype(np.float32), values.astype(np.float32), k=12, kernel="rbf"
    )
    expected = RBFInterpolator(points, values, neighbors=12)(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.x64
def test_rbf_gradients_match_finite_differences():
    points, values, x = _data(5, n=80, q=3)
    tree = kdeqx.KDTree(points)

    @jax.jit
    def loss(x, values, epsilon, smoothing):
        out = tree.interpolate(
            x,
            values,
            k=10,
            kernel="rbf",
            rbf="multiquadric",
            epsilon=epsilon,
            smoothing=smoothing,
        )
        return jnp.sum(out**2)

    args = (jnp.asarray(x), jnp.asarray(values), 2.0, 0.05)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    for argnum, grad in enumerate(grads):

        def along(a, argnum=argnum):
            changed = list(args)
            changed[argnum] = a
            return loss(*changed)

        expected = central_difference(along, np.asarray(args[argnum], float))
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.x64
def test_rbf_gradient_with_respect_to_points():
    points, values, x = _data(6, n=40, q=3)

    @jax.jit
    def loss(points):
        tree = kdeqx.KDTree(points)
        return jnp.sum(tree.interpolate(x, values, k=8, kernel="rbf") ** 2)

    # The tree is rebuilt at each step, so the neighbour choice is that of `points`
    # (no neighbour changes within the finite-difference step).
    grad = jax.grad(loss)(jnp.asarray(points))
    expected = central_difference(loss, points)
    # The thin-plate spline's third derivative is singular at coincident points:
    # central differences are good to about 1e-5 here.
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kernel, options",
    [("rbf", {}), ("mls", {}), ("mls", {"exact": True, "degree": 2})],
)
def test_gradients_at_data_points_are_finite(kernel, options, dtype):
    points, values, _ = _data(7, n=60)
    points, values = points.astype(dtype), values.astype(dtype)
    tree = kdeqx.KDTree(points)

    @jax.jit  # one program: compiling is what costs here
    def value_and_gradients(x):
        def value(x):
            return tree.interpolate(x, values, k=16, kernel=kernel, **options)

        out, pullback = jax.vjp(value, x)
        return out, pullback(jnp.ones_like(out))[0]

    out, grads = value_and_gradients(jnp.asarray(points[:10]))
    assert np.all(np.isfinite(grads))
    if kernel == "rbf" or options.get("exact"):
        tolerance = 1e-3 if dtype == np.float32 else 1e-6
        np.testing.assert_allclose(out, values[:10], atol=tolerance)


@pytest.mark.x64
@pytest.mark.parametrize("engine", ["walk", "blocks"])
# Every neighbour a copy: the support has no radius left at all.
@pytest.mark.parametrize("copies, dtype", [(6, np.float32), (8, np.float64)])
def test_mls_on_a_repeated_point_is_its_mean_with_finite_gradients(
    copies, dtype, engine
):
    """A query on a point given more often than the support's target count (as a
    lattice's nodes or repeated measurements are) shrinks the support onto the
    copies: the fit is their mean, locally constant, and no derivative divides by
    the vanishing radius (they were NaN)."""
    rng = np.random.default_rng(0)
    base = rng.random((10, 2))
    points = np.concatenate([base, np.repeat(base[:1], copies - 1, axis=0)])
    points = points.astype(dtype)
    # The 6 nearest: the copies of lowest index (ties go to the lower index).
    copies = [0, *range(10, 9 + copies)][:6]
    values = rng.standard_normal(len(points)).astype(dtype)
    tree = kdeqx.KDTree(points, engine=engine)

    def value(x, values, points):
        return kdeqx.KDTree(points, engine=engine).interpolate(
            x, values, k=6, kernel="mls"
        )

    x = points[0]
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(
        value(x, values, points), values[copies].mean(), rtol=rtol
    )
    grad_x, grad_values, grad_points = jax.grad(value, argnums=(0, 1, 2))(
        x, values, points
    )
    fd = central_difference(lambda x: tree.interpolate(x, values, k=6, kernel="mls"), x)
    np.testing.assert_allclose(grad_x, fd, atol=1e-9)
    assert not np.any(grad_x)  # locally constant
    expected = np.zeros(len(points))
    expected[copies] = 1 / len(copies)
    np.testing.assert_allclose(grad_values, expected, rtol=rtol, atol=rtol)
    assert np.isfinite(grad_points).all()


@pytest.mark.x64
@pytest.mark.parametrize("degree", [0, 1, 2])
def test_mls_reproduces_polynomials_of_its_degree(degree):
    rng = np.random.default_rng(8)
    points, x = rng.random((150, 2)), rng.random((20, 2))

    def polynomial(p):
        terms = [np.full(len(p), 0.7), 1.5 * p[:, 0] - p[:, 1], p[:, 0] * p[:, 1]]
        return sum(terms[: degree + 1])

    out = kdeqx.KDTree(points).interpolate(
        x, polynomial(points), k=24, kernel="mls", degree=degree
    )
    np.testing.assert_allclose(out, polynomial(x), atol=1e-6)


def _largest_steps(f, lines, gradients=True, chunk=5_000):
    """For each line, the largest change of `f` (batched over queries) and of its
    derivative along the line between neighbouring samples. Lines are evaluated in
    chunks of one shape: one compiled program for all of them."""

    @jax.jit
    def values_and_slopes(x, direction):
        if not gradients:
            return f(x), None
        # The gradient of the batched call, not a `vmap` of gradients (see
        # `_dense.py`).
        values, pullback = jax.vjp(f, x)
        return values, pullback(jnp.ones_like(values))[0] @ direction

    def largest(line):
        direction = (line[1] - line[0]) / np.linalg.norm(line[1] - line[0])
        parts = np.split(line, len(line) // chunk)
        pieces = [values_and_slopes(part, direction) for part in parts]
        values = np.concatenate([np.asarray(v) for v, _ in pieces])
        if not gradients:
            return np.abs(np.diff(values)).max(), None
        slopes = np.concatenate([np.asarray(g) for _, g in pieces])
        assert np.all(np.isfinite(slopes))
        return np.abs(np.diff(values)).max(), np.abs(np.diff(slopes)).max()

    return [largest(line) for line in lines]


@pytest.mark.x64
@pytest.mark.parametrize("d", [1, 2])
def test_mls_value_and_gradient_are_continuous(d):
    """Along a dense line through the data, the largest change between neighbouring
    samples shrinks in proportion to the step, for the value and for the gradient:
    no jump anywhere, although the neighbour set changes many times. The same
    measure catches the jumps of the local RBF (the test can fail)."""
    rng = np.random.default_rng(9)
    points = rng.random((300, d))
    values = np.sin(5 * points[:, 0]) + (points[:, -1] ** 2 if d > 1 else 0)
    tree = kdeqx.KDTree(points)
    start, stop = np.full(d, 0.4), np.linspace(0.45, 0.47, d)

    def line(samples):
        t = np.linspace(0, 1, samples)[:, None]
        return start + t * (stop - start)

    def steps(kernel):
        def f(x):
            return tree.interpolate(x, values, k=16, kernel=kernel)

        # Fine enough to resolve the gradient's steepest turns (where a point enters
        # the support of a small neighbourhood), which are steep but continuous.
        lines = line(2_000), line(20_000)
        return _largest_steps(f, lines, gradients=kernel == "mls", chunk=2_000)

    coarse, fine = steps("mls")
    for coarse_step, fine_step in zip(coarse, fine):
        assert fine_step < 0.2 * coarse_step  # tenfold finer: about tenfold smaller
    if d == 2:  # on this segment the 2-D local RBF's neighbour set changes
        rbf_coarse, rbf_fine = steps("rbf")
        assert rbf_fine[0] > 0.5 * rbf_coarse[0]  # a jump does not shrink


@pytest.mark.x64
def test_mls_gradient_matches_finite_differences():
    points, values, x = _data(10, n=120, q=4)
    tree = kdeqx.KDTree(points)

    @jax.jit
    def loss(x, values):
        return jnp.sum(tree.interpolate(x, values, k=16, kernel="mls") ** 2)

    grads = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(values))
    np.testing.assert_allclose(
        grads[0],
        central_difference(lambda a: loss(a, values), x),
        rtol=1e-5,
        atol=1e-8,
    )
    np.testing.assert_allclose(
        grads[1],
        central_difference(lambda a: loss(x, a), values),
        rtol=1e-5,
        atol=1e-8,
    )


@pytest.mark.x64
@pytest.mark.parametrize("kernel", ["rbf", "mls"])
def test_local_fits_in_a_periodic_box_see_the_images(kernel):
    """In a periodic box, the fit near the boundary equals the fit from an open tree
    over the data with its images on every side."""
    rng = np.random.default_rng(11)
    points = rng.random((150, 2))
    values = np.cos(2 * np.pi * points[:, 0]) * np.sin(2 * np.pi * points[:, 1])
    shifts = np.array([(i, j) for i in (-1, 0, 1) for j in (-1, 0, 1)], float)
    tiled = (points[None] + shifts[:, None]).reshape(-1, 2)
    x = np.array([[0.01, 0.5], [0.99, 0.98], [0.5, 0.003]])
    periodic = kdeqx.KDTree(points, box=1.0).interpolate(x, values, k=14, kernel=kernel)
    open_tree = kdeqx.KDTree(tiled).interpolate(
        x, np.tile(values, 9), k=14, kernel=kernel
    )
    np.testing.assert_allclose(periodic, open_tree, rtol=1e-9, atol=1e-12)


def test_interpolator_trains_local_kernels_and_maps():
    points, values, x = _data(12, n=100)
    points, values, x = (a.astype(np.float32) for a in (points, values, x))
    model = kdeqx.Interpolator(
        kdeqx.KDTree(points),
        values,
        k=12,
        kernel="rbf",
        rbf="gaussian",
        epsilon=4.0,
        smoothing=0.01,
    )

    @eqx.filter_jit
    def loss(model, x):
        return jnp.mean((model(x) - 1.0) ** 2)

    grads = eqx.filter_grad(loss)(model, x)
    for grad in (grads.values, grads.log_epsilon, grads.smoothing):
        assert np.all(np.isfinite(grad)) and np.any(grad != 0)
    batched = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, x.reshape(5, 5, 2))
    np.testing.assert_allclose(batched.reshape(-1), eqx.filter_jit(model)(x), rtol=1e-6)
    mls = kdeqx.Interpolator(kdeqx.KDTree(points), values, k=12, kernel="mls")
    assert np.all(np.isfinite(eqx.filter_grad(loss)(mls, x).values))


def test_bad_local_fit_arguments_raise():
    points, values, x = _data(13, n=30)
    tree = kdeqx.KDTree(points)
    # A ValueError, or the test run's type checker's TypeError first.
    with pytest.raises((ValueError, TypeError), match="rbf|cubical"):
        tree.interpolate(x, values, kernel="rbf", rbf="cubical")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epsilon"):
        tree.interpolate(x, values, kernel="rbf", rbf="gaussian")
    with pytest.raises(ValueError, match="epsilon"):
        tree.interpolate(x, values, kernel="rbf", epsilon=-1.0)
    with pytest.raises(ValueError, match="At least 6 neighbours"):
        tree.interpolate(x, values, k=5, kernel="rbf", degree=2)
    with pytest.raises(ValueError, match="degree"):
        tree.interpolate(x, values, kernel="rbf", degree=-2)
    with pytest.raises(ValueError, match="smoothing"):
        tree.interpolate(x, values, kernel="rbf", smoothing=-0.1)
    with pytest.raises(ValueError, match="smoothing"):
        tree.interpolate(x, values, kernel="rbf", smoothing=np.zeros(3))
    with pytest.raises(ValueError, match="Euclidean"):
        tree.interpolate(x, values, kernel="mls", p=1)
    with pytest.raises(ValueError, match="degree 0, 1 or 2"):
        tree.interpolate(x, values, kernel="mls", degree=3)
    with pytest.raises(ValueError, match="k >= 2"):
        tree.interpolate(x, values, kernel="mls", k=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tree.interpolate(x, values, kernel="rbf", degree=0)
    assert any("should not be below 1" in str(w.message) for w in caught)


# Homogeneous kernels with smoothing scaled as the kernel, so that the interpolant is
# the same at every scale; a shape parameter scaled inversely; TPS of degree 0, whose
# systems keep the `c**2 log(c) r**2` term of the scale.
_SCALED_CASES = [
    ("thin_plate_spline", None, None, 1e-3, 2),
    ("thin_plate_spline", 0, None, 0.0, 2),
    ("cubic", None, None, 1e-3, 3),
    ("quintic", None, None, 1e-6, 5),
    ("linear", None, None, 1e-2, 1),
    ("gaussian", None, 5.0, 1e-3, 0),
]


@pytest.mark.x64
@pytest.mark.parametrize("rbf, degree, epsilon, smoothing, power", _SCALED_CASES)
def test_rbf_far_from_unit_coordinates_matches_scipy(
    rbf, degree, epsilon, smoothing, power
):
    points, values, x = _data(3)
    # Far below the unit: there the kernel's entries are tiny and the smoothing
    # counts only if it is converted right.
    c = 2.0**-200
    options = dict(kernel=rbf, degree=degree, smoothing=smoothing * c**power)
    if epsilon is not None:
        options["epsilon"] = epsilon / c
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degree 0 for TPS: as scipy, a warning
        out = kdeqx.KDTree(points * c).interpolate(
            x * c,
            values,
            k=12,
            kernel="rbf",
            rbf=rbf,
            **{key: value for key, value in options.items() if key != "kernel"},
        )
        expected = RBFInterpolator(points * c, values, neighbors=12, **options)(x * c)
        unscaled = RBFInterpolator(
            points,
            values,
            neighbors=12,
            **{
                **options,
                "smoothing": smoothing,
                **({"epsilon": epsilon} if epsilon is not None else {}),
            },
        )(x)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    if degree != 0:  # TPS of degree 0 is not scale invariant, in scipy either
        np.testing.assert_allclose(out, unscaled, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["rbf", "mls"])
def test_float32_local_fits_far_from_unit_coordinates(kernel):
    # Squared float32 distances overflow beyond ~1e19 and underflow below ~1e-19:
    # the fits run in a unit near their neighbourhood's size.
    points, values, x = (a.astype(np.float32) for a in _data(4))
    expected = kdeqx.KDTree(points).interpolate(x, values, k=12, kernel=kernel)
    for shift in (-100, 100):
        c = np.float32(2.0**shift)
        out = kdeqx.KDTree(points * c).interpolate(x * c, values, k=12, kernel=kernel)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["rbf", "mls"])
def test_local_fits_compile_without_lapack_kernels(kernel):
    """No LAPACK kernel in a local fit's value or gradient on the CPU: jaxlib's
    kernels wait on XLA's thread pool and hang when two run at once (`_dense.py`)."""
    points = jnp.asarray(np.random.default_rng(0).random((500, 3)), jnp.float32)
    tree = kdeqx.KDTree(points)
    x = points[:64] + 0.01

    def loss(x, values):
        return kdeqx.Interpolator(tree, values, k=8, kernel=kernel)(x).sum()

    for fn in (loss, jax.grad(loss), jax.grad(loss, argnums=1)):
        program = jax.jit(fn).lower(x, points[:, 0]).compile().as_text()
        assert 'custom_call_target="lapack' not in program


_HANG_SCENARIO = """
import jax, jax.numpy as jnp, numpy as np, kdeqx
rng = np.random.default_rng(0)
points = jnp.asarray(rng.random((20_000, 3)), jnp.float32)
for kernel in ("rbf", "mls"):
    model = kdeqx.Interpolator(
        kdeqx.KDTree(points), jnp.sum(points**2, 1), k=16, kernel=kernel
    )
    gradient = jax.jit(lambda m, x: jax.grad(lambda x: m(x).sum())(x))
    for q in (1536, 2048):
        x = jnp.asarray(rng.random((q, 3)), jnp.float32)
        for _ in range(6):
            assert bool(jnp.all(jnp.isfinite(gradient(model, x))))
print("done")
"""


def test_jitted_local_fit_gradient_returns():
    """The scenario that hung: a jitted gradient through `kernel="rbf"` over 1,536 to
    2,048 queries (one chunk, whose fit and gradient solved side by side), called
    repeatedly; in a child process, so that a hang fails the test at its time limit
    instead of stopping the suite."""
    result = subprocess.run(
        [sys.executable, "-c", _HANG_SCENARIO],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")
