"""A small message-passing network on a ragged batch of point clouds, trained with
optax.

Each training batch is one call of `kdeqx.radius_graph` with `batch=` segment ids:
clouds of different sizes in one array, edges only within a cloud. The network learns
a toy many-body energy per cloud, `sum_i tanh(sum_j exp(-|x_i - x_j|**2))`, from
radial-basis features of the edge lengths: messages summed at each receiver
(`jax.ops.segment_sum`), a per-node readout, summed per cloud. Gradients flow into the
network's parameters through the graph's differentiable distances; the graph is
built inside the jitted training step.

    python examples/message_passing.py            # seconds on a CPU
    KDEQX_FULL=1 python examples/message_passing.py
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kdeqx


FULL = bool(os.environ.get("KDEQX_FULL"))
CLOUDS, LARGEST = (64, 48) if FULL else (16, 24)
STEPS = 2_000 if FULL else 150
CUTOFF, BASIS = 1.5, 8
MAX_EDGES = CLOUDS * LARGEST * LARGEST


def ragged_batch(seed: int):
    """`CLOUDS` clouds of 8 to `LARGEST` points in one array of `CLOUDS * LARGEST`
    rows, with segment ids. Made in numpy: one shape for every batch, so the
    training step compiles once. The padding rows lie far apart, in a segment past
    the last (which `segment_sum` drops): they join no edge and add to no cloud."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(8, LARGEST + 1, CLOUDS)
    batch = np.repeat(np.arange(CLOUDS), sizes)
    points = rng.random((len(batch), 3)) * 2.0
    missing = CLOUDS * LARGEST - len(batch)
    far = 1e3 + 10.0 * np.arange(missing)[:, None] * np.ones(3)
    points = np.concatenate([points, far]).astype(np.float32)
    return jnp.asarray(points), jnp.asarray(np.concatenate([batch, [CLOUDS] * missing]))


def target_energy(points, batch):
    """The toy energy, by brute force within each cloud."""
    same = batch[:, None] == batch[None, :]
    squared = jnp.sum((points[:, None] - points[None]) ** 2, axis=-1)
    density = jnp.sum(jnp.where(same, jnp.exp(-squared), 0), axis=1) - 1
    return jax.ops.segment_sum(jnp.tanh(density), batch, CLOUDS)


class MessagePassing(eqx.Module):
    message: eqx.nn.MLP
    readout: eqx.nn.MLP

    def __init__(self, key):
        keys = jax.random.split(key)
        self.message = eqx.nn.MLP(BASIS, 16, 32, 2, jax.nn.silu, key=keys[0])
        self.readout = eqx.nn.MLP(16, 1, 32, 2, jax.nn.silu, key=keys[1])

    def __call__(self, points, batch):
        graph = kdeqx.radius_graph(points, CUTOFF, MAX_EDGES, batch=batch)
        live = graph.edge_mask()
        lengths = jnp.where(live, graph.distances, CUTOFF)
        centres = jnp.linspace(0, CUTOFF, BASIS)
        features = jnp.exp(-(((lengths[:, None] - centres) / 0.25) ** 2))
        messages = jax.vmap(self.message)(features) * live[:, None]
        n = points.shape[0]
        nodes = jax.ops.segment_sum(messages, graph.receivers, n + 1)[:n]
        energies = jax.vmap(self.readout)(nodes)[:, 0]
        return jax.ops.segment_sum(energies, batch, CLOUDS)


def main():
    model = MessagePassing(jax.random.key(0))
    optimiser = optax.adam(3e-3)
    state = optimiser.init(eqx.filter(model, eqx.is_array))

    def loss(model, points, batch):
        return jnp.mean((model(points, batch) - target_energy(points, batch)) ** 2)

    @eqx.filter_jit
    def step(model, state, points, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, points, batch)
        updates, state = optimiser.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, value

    test_points, test_batch = ragged_batch(10**6)
    first = None
    for i in range(STEPS):
        points, batch = ragged_batch(i)
        model, state, value = step(model, state, points, batch)
        first = float(value) if first is None else first
    test = float(loss(model, test_points, test_batch))
    print(
        f"{STEPS} steps on batches of {CLOUDS} clouds: training loss {first:.3f} -> "
        f"{float(value):.4f}, held-out loss {test:.4f}"
    )
    assert test < first / 5, "the network should learn the toy energy"


if __name__ == "__main__":
    main()
