import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdeqx

from .helpers import count_equations


def _query_size(n):
    tree = eqx.filter_eval_shape(
        kdeqx.KDTree, jax.ShapeDtypeStruct((n, 3), jnp.float32)
    )
    x = jax.ShapeDtypeStruct((64, 3), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda t, x: t.query(x, 8))(tree, x)
    return count_equations(jaxpr.jaxpr)


def _block_query_sizes(n):
    """Equations of a kNN query, a radius count and a ball query on the block
    engine over `n` points (shapes only: nothing runs)."""
    points = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    tree = eqx.filter_eval_shape(lambda p: kdeqx.KDTree(p, engine="blocks"), points)
    x = jax.ShapeDtypeStruct((64, 3), jnp.float32)
    queries = [
        lambda t, x: t.query(x, 8),
        lambda t, x: t.count_ball_point(x, 0.01),
        lambda t, x: t.query_ball_point(x, 0.01, 16),
    ]
    return [count_equations(jax.make_jaxpr(q)(tree, x).jaxpr) for q in queries]


def test_block_engine_programs_do_not_grow_with_n():
    # From 2**17 leaves on, the descent's middle steps are one loop: trees of a
    # few million points and of hundreds of millions descend in the same program.
    assert _block_query_sizes(4_000_000) == _block_query_sizes(140_000_000)


def _build_size(n):
    points = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    return count_equations(jax.make_jaxpr(kdeqx.KDTree)(points).jaxpr)


def test_query_program_does_not_grow_with_n():
    assert _query_size(1_000) == _query_size(100_000) == _query_size(14_000_000)


def test_build_program_does_not_grow_with_n():
    assert _build_size(1_000) == _build_size(100_000) == _build_size(14_000_000)


def test_no_retracing_for_new_data_of_the_same_shape():
    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def build_and_query(points, x):
        return kdeqx.KDTree(points).query(x, 4)

    rng = np.random.default_rng(0)
    for _ in range(3):
        build_and_query(rng.random((100, 2)), rng.random((10, 2)))

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def query(tree, x):
        return tree.query(x, 4)

    for _ in range(3):
        query(kdeqx.KDTree(rng.random((100, 2))), rng.random((10, 2)))


def _graph_sizes(n):
    """Equations of a radius graph, a kNN graph and a neighbour-list update of `n`
    points in a triclinic cell (shapes only: nothing runs)."""
    cell = jnp.array([[3.0, 0, 0], [0.5, 3.0, 0], [0.2, 0.3, 3.0]])
    points = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    radius = jax.make_jaxpr(
        lambda x: kdeqx.radius_graph(x, 1.0, 4 * n, cell=cell, images=1)
    )(points)
    knn = jax.make_jaxpr(lambda x: kdeqx.knn_graph(x, 8, cell=cell))(points)
    return count_equations(radius.jaxpr), count_equations(knn.jaxpr)


def test_graph_programs_do_not_grow_with_n():
    # (Below ~1e3 points the lanes are vmapped queries: another, smaller program.)
    assert _graph_sizes(10_000) == _graph_sizes(100_000) == _graph_sizes(1_000_000)
