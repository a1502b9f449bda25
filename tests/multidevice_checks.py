"""The multi-device checks: run by `tests/test_sharded.py` and
`tests/test_split_queries.py` in a fresh process with 4 simulated CPU devices, as
`pytest tests/multidevice_checks.py`, whose report they read. JAX fixes its device
count when it starts, so these cannot run in the suite's own processes (there, this
file is not collected, and run alone it skips)."""

import contextlib
import functools as ft
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest


NUM_DEVICES = 4
_COLLECTIVE = re.compile(
    r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\("
)

# float64 on, as these checks were written; every annotation in kdeqx is checked by
# the suite's `--jaxtyping-packages` option.
pytestmark = [
    pytest.mark.x64,
    pytest.mark.skipif(jax.device_count() < NUM_DEVICES, reason="needs 4 CPU devices"),
]

# Each query is one `jax.jit` program: eager calls would compile every small validation
# op separately, on every device, which costs more than the queries.

# Each query is one `jax.jit` program: eager calls would compile every small validation
# op separately, on every device, which costs more than the queries.


@ft.partial(jax.jit, static_argnames=("k", "options"))
def _answers(tree, x, bounds, values, radii, k, options):
    """kNN, interpolation and counts in one program (compiling is what costs)."""
    return (
        tree.query(x, k, distance_upper_bound=bounds),
        tree.interpolate(x, values, **dict(options)),
        tree.count_ball_point(x, radii),
    )


def _run_compiled(fn, *args):
    """`fn(*args)`, and `(result type, collective)` of each collective it runs."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled(*args), _COLLECTIVE.findall(compiled.as_text())


def _assert_same(ours, ref, exact=True):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


_QUERIES = {
    "query": lambda t, x: t.query(x, 4),
    "count_ball_point": lambda t, x: t.count_ball_point(x, 0.1),
    "query_ball_point": lambda t, x: t.query_ball_point(x, 0.1, 8),
    "interpolate": lambda t, x: t.interpolate(x, t.points[:, 0], k=4),
}


def _every_query(tree, x):  # one program: compiling is what costs
    return {name: fn(tree, x) for name, fn in _QUERIES.items()}


_ONE_DEVICE = {}


def _replicated_tree_and_queries(axis_type_name: str):
    """A tree replicated over a 4-device mesh, queries split over it, and the answers
    of the same tree and queries on one device."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import kdeqx

    if not _ONE_DEVICE:
        rng = np.random.default_rng(0)
        tree = kdeqx.KDTree(rng.random((1000, 3)).astype(np.float32))
        x = rng.random((64, 3)).astype(np.float32)
        _ONE_DEVICE.update(
            tree=tree,
            x=x,
            answers=jax.jit(_every_query)(tree, x),
            gradient=jax.jit(jax.grad(_distances_and_field))(x, tree),
        )
    axis_type = getattr(AxisType, axis_type_name)
    mesh = jax.make_mesh((NUM_DEVICES,), ("q",), axis_types=(axis_type,))
    by_rows = NamedSharding(mesh, P("q"))
    tree = jax.device_put(_ONE_DEVICE["tree"], NamedSharding(mesh, P()))
    x = jax.device_put(_ONE_DEVICE["x"], by_rows)
    return mesh, by_rows, tree, x, _ONE_DEVICE["answers"]


def _assert_split_like_queries(out, by_rows, reference):
    for name in _QUERIES:
        for leaf in jax.tree.leaves(out[name]):
            assert leaf.sharding.is_equivalent_to(by_rows, leaf.ndim), (name, leaf)
        _assert_same(out[name], reference[name], exact=name != "interpolate")


def test_shard_map_queries():
    """A replicated tree, queries split by `jax.shard_map`: no communication at all."""
    from jax.sharding import PartitionSpec as P

    mesh, by_rows, tree, x, reference = _replicated_tree_and_queries("Explicit")
    # `check_vma=False`: `eqx.error_if`'s host callback is not provably the same on
    # every device.
    split = jax.shard_map(
        _every_query,
        mesh=mesh,
        in_specs=(P(), P("q")),
        out_specs=P("q"),
        check_vma=False,
    )
    out, collectives = _run_compiled(split, tree, x)
    assert collectives == [], collectives
    _assert_split_like_queries(out, by_rows, reference)
    print(f"shard_map: {', '.join(_QUERIES)} split, no collectives, equal")


def _check_jit_queries(axis_type: str):
    mesh, by_rows, tree, x, reference = _replicated_tree_and_queries(axis_type)
    out, collectives = _run_compiled(_every_query, tree, x)
    print(f"jit {axis_type}: collectives {collectives}")
    # Scalar all-reduces may remain: a `vmap`ped `while_loop` runs while any query, on
    # any device, is unfinished.
    assert all(op != "all-gather" for _, op in collectives), collectives
    _assert_split_like_queries(out, by_rows, reference)
    # Gradients with respect to the split queries come back split and equal.
    grad = jax.jit(jax.grad(_distances_and_field))(x, tree)
    assert grad.sharding.is_equivalent_to(by_rows, grad.ndim), grad.sharding
    _assert_same(grad, _ONE_DEVICE["gradient"], exact=False)


def _distances_and_field(x, tree):
    return tree.query(x, 4)[0].sum() + tree.interpolate(x, tree.points, k=4).sum()


def test_jit_queries():
    """A replicated tree, split queries, plain `jax.jit`: the queries stay split."""
    _check_jit_queries("Auto")


def test_jit_queries_explicit():
    """The same on a mesh with explicit axes (the default of `jax.make_mesh`)."""
    _check_jit_queries("Explicit")


def _lattice(rng, n, d):
    """Shuffled integer lattice points: exact distances, and ties everywhere."""
    side = int(np.ceil(n ** (1 / d))) + 1
    grid = np.stack(np.meshgrid(*[np.arange(side)] * d, indexing="ij"), -1)
    return grid.reshape(-1, d)[:n][rng.permutation(n)]


_CASES = {}


def _case(name: str):
    """`(sharded, tree, points, x, rng)` for one data set, built once per process.

    - `f32-lattice`: float32, n = 1003 (not divisible by 4), exact distance ties.
    - `f64-periodic`: float64, n = 1000 (divisible by 4), a periodic box, queries of
        shape (5, 8, 3) in and around the box.
    - `f64-tiny`: float64, n = 3 < 4: only the replicated left-over tree.
    """
    if name not in _CASES:
        import kdeqx
        from kdeqx._tree._sharded import ShardedKDTree

        mesh = jax.make_mesh((NUM_DEVICES,), ("shards",))
        rng = np.random.default_rng(sum(map(ord, name)))
        box = None
        if name == "f32-lattice":
            points = _lattice(rng, 1003, 3).astype(np.float32)
            x = rng.integers(0, 9, (40, 3)) + 0.5 * rng.integers(0, 2, (40, 3))
            # and on data points: interpolation gives the coincident points' mean
            x = np.concatenate([x, points[:5]]).astype(np.float32)
        elif name == "f64-periodic":
            box = 1.0
            points, x = rng.random((1000, 3)), 1.2 * rng.random((5, 8, 3)) - 0.1
        else:
            points, x = rng.random((3, 3)), rng.random((40, 3))
        sharded = ShardedKDTree(points, mesh, box=box)
        _CASES[name] = (sharded, kdeqx.KDTree(points, box=box), points, x, rng)
    return _CASES[name]


def test_sharded_tree():
    """kNN (ties, sentinels, bounds), interpolation and counts equal to one tree's."""
    # k = 300 > 1000 // 4, the points per device: every device runs out of points.
    for name, k, options in [
        ("f32-lattice", 8, (("k", 8),)),
        ("f64-periodic", 300, (("kernel", "gaussian"), ("length_scale", 0.05))),
        ("f64-tiny", 8, (("k", 2), ("power", 1.0))),
    ]:
        sharded, tree, points, x, rng = _case(name)
        batch = x.shape[:-1]
        # Lattice bounds and radii hit lattice distances exactly: the bound is strict,
        # the ball closed.
        scale = 2.0 if name == "f32-lattice" else 0.2
        bounds = np.round(scale * rng.random(batch), 1)
        bounds = np.where(rng.random(batch) < 0.3, np.inf, bounds).astype(x.dtype)
        radii = np.round(scale * rng.random(batch), 1).astype(x.dtype)
        values = rng.standard_normal((len(points), 2)).astype(x.dtype)
        if name == "f64-periodic":
            values = values[:, 0]
        args = (x, bounds, values, radii, k, options)
        (ours_knn, ours_field, ours_count) = _answers(sharded, *args)
        (ref_knn, ref_field, ref_count) = _answers(tree, *args)
        _assert_same(ours_knn, ref_knn)
        _assert_same(ours_field, ref_field, exact=False)
        _assert_same(ours_count, ref_count)
        print(f"{name} k={k}: kNN, interpolation and counts equal")


def test_sharded_blocks_engine():
    """A `ShardedKDTree` whose devices search with the block engine answers as one
    tree that walks: kNN (lattice ties, bounds) and radius counts."""
    import kdeqx
    from kdeqx._tree._sharded import ShardedKDTree

    _, tree, points, x, rng = _case("f32-lattice")
    mesh = jax.make_mesh((NUM_DEVICES,), ("shards",))
    sharded = ShardedKDTree(points, mesh, engine="blocks")
    assert sharded.leftover.engine == "blocks"
    bounds = np.round(2.0 * rng.random(len(x)), 1).astype(x.dtype)
    radii = np.round(2.0 * rng.random(len(x)), 1).astype(x.dtype)
    ours, ref = (
        (
            t.query(x, k=8, distance_upper_bound=bounds),
            t.count_ball_point(x, radii),
        )
        for t in (sharded, tree)
    )
    _assert_same(ours, ref)
    assert isinstance(tree, kdeqx.KDTree) and tree.engine == "walk"
    print("blocks engine on every device: kNN and counts equal")


def test_sharded_communication():
    """Only candidates (and unsplit queries) travel; points never do."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import kdeqx
    from kdeqx._tree._sharded import ShardedKDTree

    mesh = jax.make_mesh((NUM_DEVICES,), ("shards",))
    rng = np.random.default_rng(3)
    points = rng.random((1000, 3), np.float32)
    x = rng.random((64, 3), np.float32)
    by_rows = NamedSharding(mesh, P("shards"))

    # Points already split over the devices are never gathered.
    sharded, collectives = _run_compiled(
        lambda p: ShardedKDTree(p, mesh), jax.device_put(points, by_rows)
    )
    assert collectives == [], collectives
    assert sharded.shards.points.sharding.spec[0] == "shards"

    def query(t, x):
        return t.query(x, 5)

    # Split queries are gathered (every device searches every query), then each device
    # contributes its 64 x 5 (distance, index) candidates to one all-gather.
    out, collectives = _run_compiled(query, sharded, jax.device_put(x, by_rows))
    expected = {"f32[64,3]{1,0}", "f32[4,64,5]{2,1,0}", "s32[4,64,5]{2,1,0}"}
    assert {shape for shape, _ in collectives} == expected, collectives
    assert all(leaf.sharding.is_fully_replicated for leaf in out)
    tree = kdeqx.KDTree(points)
    _assert_same(out, jax.jit(query)(tree, x))

    _, collectives = _run_compiled(lambda t, x: t.count_ball_point(x, 0.1), sharded, x)
    assert [op for _, op in collectives] == ["all-reduce"], collectives

    # Gradients with respect to the queries, and to the values (which travel with the
    # candidates), under `jit`.
    @jax.jit
    @ft.partial(jax.grad, argnums=(1, 2))
    def gradients(t, x, values):
        return t.query(x, 5)[0].sum() + t.interpolate(x, values, k=4).sum()

    values = rng.random(1000, np.float32)
    for ours, ref in zip(
        gradients(sharded, x, values), gradients(tree, x, values), strict=True
    ):
        np.testing.assert_allclose(ours, ref, atol=1e-5)
    print("communication: candidates only; gradients equal")


@ft.partial(jax.jit, static_argnames="capacity")
def _ball(tree, x, radii, capacity):
    return tree.query_ball_point(x, radii, capacity)


def test_sharded_ball_and_interpolator():
    """`query_ball_point` (capacities that truncate and that hold every neighbour),
    its communication and gradients, and `Interpolator` over a `ShardedKDTree`, equal
    to one tree's."""
    import kdeqx

    # Capacities that truncate (3) and that hold every neighbour (64).
    for name, capacities in [
        ("f32-lattice", (3, 64)),
        ("f64-periodic", (64,)),
        ("f64-tiny", (3,)),
    ]:
        sharded, tree, points, x, rng = _case(name)
        scale = 2.0 if name == "f32-lattice" else 0.2
        radii = np.round(scale * rng.random(x.shape[:-1]), 1).astype(x.dtype)
        for capacity in capacities:
            ours, ref = (
                _ball(sharded, x, radii, capacity),
                _ball(tree, x, radii, capacity),
            )
            _assert_same(ours, ref)
        if capacities[0] == 3 and len(points) > 3:  # it truncated some queries
            assert np.any(ours[2] > 3)
        values = rng.standard_normal(len(points)).astype(x.dtype)
        interpolate = eqx.filter_jit(lambda model, x: model(x))
        _assert_same(
            interpolate(kdeqx.Interpolator(sharded, values, k=4), x),
            interpolate(kdeqx.Interpolator(tree, values, k=4), x),
            exact=False,
        )
        print(f"{name}: query_ball_point and Interpolator equal")

    sharded, tree, points, x, rng = _case("f32-lattice")
    # Every device's candidates are all-gathered, its counts all-reduced: nothing else.
    _, collectives = _run_compiled(
        lambda t, x: t.query_ball_point(x, 1.5, 6), sharded, x
    )
    q = len(x)
    assert sorted(collectives) == [
        (f"f32[4,{q},6]{{2,1,0}}", "all-gather"),
        (f"s32[4,{q},6]{{2,1,0}}", "all-gather"),
        (f"s32[{q}]{{0}}", "all-reduce"),
    ], collectives

    @jax.jit
    @jax.grad
    def ball_distances(x, t):
        distances = t.query_ball_point(x, 1.5, 6)[0]
        return jnp.where(jnp.isfinite(distances), distances, 0).sum()

    x = x + np.float32(0.25)  # off the lattice: distances differentiable
    np.testing.assert_allclose(
        ball_distances(x, sharded), ball_distances(x, tree), atol=1e-5
    )
    print("query_ball_point: candidates gathered, counts reduced; gradients equal")


@contextlib.contextmanager
def _compiles():
    """The names of the programs XLA compiles within the block."""
    import jax._src.monitoring as monitoring

    compiled = []

    def listener(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        monitoring.unregister_event_duration_listener(listener)


def test_cpu_split():
    """A `KDTree` on a CPU with 4 devices splits large query batches over them, with
    the answers and gradients of one device, eagerly, under `jit` and under `vmap`."""
    from scipy.interpolate import RBFInterpolator

    import kdeqx
    from kdeqx._backend import _mesh
    from kdeqx._backend._mesh import shared_with_cpu_devices

    rng = np.random.default_rng(7)
    points = rng.random((3000, 3)).astype(np.float32)
    x = rng.random((1001 * 3, 3)).astype(np.float32).reshape(1001, 3, 3)  # padded
    bounds = rng.choice([np.inf, 0.05], x.shape[:-1]).astype(np.float32)
    radii = rng.uniform(0, 0.1, x.shape[:-1]).astype(np.float32)
    values = rng.standard_normal((3000, 2)).astype(np.float32)
    split = kdeqx.KDTree(points)
    one = kdeqx.KDTree(points, split_queries=False)

    def answers(t, x):
        return (
            t.query(x, 5, distance_upper_bound=bounds),
            t.query(x, 40),
            t.count_ball_point(x, radii),
            t.query_ball_point(x, radii, 8),
            t.query_ball_point(x, 0.1, 64),
            t.interpolate(x, values, k=4),
        )

    ours, reference = jax.jit(answers)(split, x), jax.jit(answers)(one, x)
    _assert_same(ours[:5], reference[:5])
    _assert_same(ours[5], reference[5], exact=False)
    distances = ours[0][0]
    assert len(distances.sharding.device_set) == NUM_DEVICES, distances.sharding
    assert len(reference[0][0].sharding.device_set) == 1
    _assert_same(split.query(x, 5), one.query(x, 5))  # eagerly
    # Queries the caller committed to one device: put beside the tree, not refused.
    _assert_same(split.query(jax.device_put(x, jax.devices()[1]), 5), one.query(x, 5))
    # Eagerly, a tree goes to every device as aliases of its one buffer per array;
    # a small one (here 0.1 MB) stays as it is, unless forced.
    arrays = [a for a in jax.tree.leaves(split) if eqx.is_array(a)]
    assert shared_with_cpu_devices(split) is split
    _mesh._SHARE_FROM_BYTES, large = 0, _mesh._SHARE_FROM_BYTES
    shared = shared_with_cpu_devices(split)
    _mesh._SHARE_FROM_BYTES = large
    for ours, original in zip(jax.tree.leaves(shared), arrays, strict=True):
        assert len(ours.sharding.device_set) == NUM_DEVICES, ours.sharding
        pointers = {s.data.unsafe_buffer_pointer() for s in ours.addressable_shards}
        assert pointers == {original.unsafe_buffer_pointer()}
    traced = jax.jit(lambda t: shared_with_cpu_devices(t).points.sum())
    np.testing.assert_allclose(traced(split), points.sum(), rtol=1e-5)  # as given

    # Eager calls compile once (an eager `shard_map` used to compile on every call).
    def eagerly():
        jax.block_until_ready(
            (
                split.query(x, 5),
                split.count_ball_point(x, radii),
                split.query_ball_point(x, radii, 8),
            )
        )

    eagerly()
    with _compiles() as compiled:
        eagerly()
    assert compiled == [], compiled
    # Too few queries to be worth splitting: one device.
    small = split.query(x[:10], 5)[0]
    assert len(small.sharding.device_set) == 1, small.sharding

    def loss(x, t):
        return t.query(x, 5)[0].sum() + t.interpolate(x, values, k=4).sum()

    # Local fits on several devices solve without LAPACK, which could deadlock here
    # (two devices in its kernels at once): scipy's local RBF and one device's.
    many = rng.random((8192, 3)).astype(np.float32)
    rbf = jax.jit(lambda t: t.interpolate(many, values[:, 0], k=12, kernel="rbf"))
    ours = rbf(split)
    np.testing.assert_allclose(ours, rbf(one), rtol=1e-4, atol=1e-4)
    expected = RBFInterpolator(points, values[:, 0], neighbors=12)(many)
    np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-3)
    mls = jax.jit(lambda t: t.interpolate(many, values, k=12, kernel="mls"))
    # (float32 moving least squares rounds differently as compiled: ~1e-3 at worst)
    np.testing.assert_allclose(mls(split), mls(one), rtol=1e-3, atol=2e-3)

    # Pair counts: split too, with the answers of one device (1001 rows, not
    # divisible by 4: padded). (Pair searches stay on one device.)
    other = kdeqx.KDTree(points[:1001])

    def between(t, o):
        counts = t.count_neighbors(o, jnp.array([0.02, 0.05, 0.1]))
        weighted = t.count_neighbors(o, 0.05, weights=(None, values[:1001, 0]))
        return counts, weighted

    ours, reference = jax.jit(between)(split, other), jax.jit(between)(one, other)
    _assert_same(ours[0], reference[0])
    np.testing.assert_allclose(ours[1], reference[1], rtol=1e-5)

    grad = jax.jit(jax.grad(loss))
    expected = grad(x, one)
    # Some entries cancel far below the terms they sum, which two programs may
    # round differently: their rounding is that of the largest.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(grad(x, split), expected, rtol=1e-5, atol=1e-6 * scale)
    # The tree is replicated into the split: its cotangents are summed back.
    grad_points = eqx.filter_jit(eqx.filter_grad(lambda t, x: loss(x, t)))
    np.testing.assert_allclose(
        grad_points(split, x).points, grad_points(one, x).points, rtol=1e-4, atol=1e-4
    )
    stacked = np.stack([points, points[::-1]])
    trees = jax.vmap(kdeqx.KDTree)(stacked)
    trees_one = jax.vmap(ft.partial(kdeqx.KDTree, split_queries=False))(stacked)
    batched = jax.vmap(lambda t: t.query(x, 5))
    _assert_same(batched(trees), batched(trees_one))
    print("cpu split: answers, gradients and vmap equal to one device")


def test_sharded_pairs():
    """`query_pairs` (with and without overflow), `sparse_distance_matrix` (a sharded
    tree's points as the rows) and weighted `count_neighbors` (a sharded tree as the
    other), equal to one tree's (float32 is `check_cpu_split`'s; the left-over tree
    alone, `f64-tiny`, is the other checks')."""
    for name in ("f64-periodic",):
        sharded, tree, points, _, rng = _case(name)
        r = 0.1
        pairs = eqx.filter_jit(lambda t, capacity: t.query_pairs(r, capacity))
        everything = pairs(tree, 8000)
        _assert_same(pairs(sharded, 8000), everything, exact=False)
        # Cut off: the same count, and pairs that are real (which ones may differ).
        kept, _, count = pairs(sharded, 5)
        assert int(count) == int(everything[2])
        real = {tuple(p) for p in np.asarray(everything[0]).tolist()}
        assert {tuple(p) for p in np.asarray(kept).tolist()} <= real
        matrix = eqx.filter_jit(lambda a, b: a.sparse_distance_matrix(b, r, 8000))
        ours, ref = matrix(sharded, tree), matrix(tree, tree)
        _assert_same((ours[0].indices, ours[1]), (ref[0].indices, ref[1]))
        np.testing.assert_allclose(ours[0].data, ref[0].data, rtol=1e-6)
        weights = rng.random(len(points)).astype(points.dtype)
        radii = jnp.asarray([0.0, r / 2, r], points.dtype)
        counts = eqx.filter_jit(
            lambda a, b, w: (
                a.count_neighbors(b, radii),
                a.count_neighbors(b, radii, weights=(None, w)),
            )
        )
        _assert_same(
            counts(tree, sharded, weights), counts(tree, tree, weights), exact=False
        )
        print(f"{name}: pairs, sparse matrix and counts equal")
