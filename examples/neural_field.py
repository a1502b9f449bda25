"""A neural field over a point cloud: trainable features at the points, then an MLP.

The model interpolates a learned feature vector from a KDTree over a fixed point
cloud (`kdeqx.Interpolator`), concatenates it with the coordinates and feeds both to
an `eqx.nn.MLP`: the features carry local detail (here a sharp-edged disc), the MLP
mixes them with the coordinates. We fit a known 2-D function from random
samples with optax's adamw in the standard Equinox way, `eqx.is_inexact_array` as the
filter: the MLP and the feature values train, while the tree (points and search
structure) is held frozen inside the interpolator and stays exactly as built.

    python examples/neural_field.py            # small, well under a minute on CPU
    KDEQX_FULL=1 python examples/neural_field.py

Writes `examples/neural_field.png` (the learned field against the target) when
matplotlib is installed.
"""

import os
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import kdeqx


FULL = bool(os.environ.get("KDEQX_FULL"))
NUM_POINTS = 20_000 if FULL else 1_000
NUM_FEATURES = 16 if FULL else 8
NUM_STEPS = 5_000 if FULL else 1_500
BATCH_SIZE = 1024 if FULL else 256
FIGURE = pathlib.Path(__file__).with_name("neural_field.png")


def target_function(x):
    """Smooth waves plus a sharp-edged disc: the disc is what the features help with."""
    waves = jnp.sin(3 * jnp.pi * x[..., 0]) * jnp.cos(2 * jnp.pi * x[..., 1])
    disc = jnp.where(jnp.sum((x - 0.6) ** 2, axis=-1) < 0.2**2, 1.0, 0.0)
    return waves + disc


class NeuralField(eqx.Module):
    """`f(x) = MLP([x, features(x)])`, features interpolated from a point cloud."""

    features: kdeqx.Interpolator
    mlp: eqx.nn.MLP

    def __init__(self, points, num_features, *, key):
        feature_key, mlp_key = jax.random.split(key)
        tree = kdeqx.KDTree(points)
        n, d = points.shape
        values = 0.1 * jax.random.normal(feature_key, (n, num_features))
        # IDW over a few neighbours: each feature vector acts locally, like a pixel.
        self.features = kdeqx.Interpolator(tree, values, k=4, kernel="idw")
        self.mlp = eqx.nn.MLP(
            d + num_features, "scalar", width_size=64, depth=2, key=mlp_key
        )

    def __call__(self, x):
        """Evaluates the field at one point `x` of shape `(d,)`."""
        return self.mlp(jnp.concatenate([x, self.features(x)]))


def loss_fn(params, static, x, y):
    model = eqx.combine(params, static)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@eqx.filter_jit
def make_step(params, static, opt_state, optimiser, key):
    x = jax.random.uniform(key, (BATCH_SIZE, 2))
    loss, grads = jax.value_and_grad(loss_fn)(params, static, x, target_function(x))
    updates, opt_state = optimiser.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, loss


def grid(size):
    axis = jnp.linspace(0, 1, size)
    return jnp.stack(jnp.meshgrid(axis, axis, indexing="xy"), axis=-1)


@eqx.filter_jit
def evaluate(model, x):
    return jax.vmap(jax.vmap(model))(x)


def save_figure(points, x, learned, target):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the figure")
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    extent = (0, 1, 0, 1)
    panels = [
        ("target", target, "viridis"),
        ("learned", learned, "viridis"),
        ("learned - target", learned - target, "RdBu_r"),
    ]
    for ax, (title, image, cmap) in zip(axes, panels):
        limit = float(jnp.max(jnp.abs(image))) if cmap == "RdBu_r" else None
        shown = ax.imshow(
            image,
            origin="lower",
            extent=extent,
            cmap=cmap,
            vmin=-limit if limit else None,
            vmax=limit,
        )
        fig.colorbar(shown, ax=ax, shrink=0.8)
        ax.set_title(title)
    axes[1].scatter(points[:, 0], points[:, 1], s=0.3, c="white", alpha=0.3)
    fig.suptitle(f"kdeqx neural field: {len(points):,} feature points + MLP")
    fig.savefig(FIGURE, dpi=100)
    print(f"saved {FIGURE}")


def main():
    start = time.perf_counter()
    points_key, model_key, train_key = jax.random.split(jax.random.key(0), 3)
    points = jax.random.uniform(points_key, (NUM_POINTS, 2))
    model = NeuralField(points, NUM_FEATURES, key=model_key)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    print(f"{NUM_POINTS:,} feature points x {NUM_FEATURES}: {num_params:,} parameters")

    schedule = optax.cosine_decay_schedule(3e-3, NUM_STEPS, alpha=0.05)
    optimiser = optax.adamw(schedule, weight_decay=1e-4)
    opt_state = optimiser.init(params)
    losses = []
    for step, key in enumerate(jax.random.split(train_key, NUM_STEPS)):
        params, opt_state, loss = make_step(params, static, opt_state, optimiser, key)
        losses.append(loss)
        # Each batch is fresh random samples, so report a mean over the last steps.
        if step % 100 == 0 or step == NUM_STEPS - 1:
            recent = jnp.mean(jnp.stack(losses[-100:]))
            print(f"step {step:5d}  mean batch loss {recent:.4f}")

    trained = eqx.combine(params, static)
    unchanged = all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(
            jax.tree.leaves(model.features.tree), jax.tree.leaves(trained.features.tree)
        )
    )
    print(f"tree unchanged by training: {unchanged}")
    model = trained
    x = grid(128)
    learned, target = evaluate(model, x), target_function(x)
    rms = jnp.sqrt(jnp.mean((learned - target) ** 2))
    print(f"RMS error on a 128x128 grid: {rms:.3f} (target RMS {jnp.std(target):.3f})")
    print(f"training time {time.perf_counter() - start:.1f}s")
    save_figure(points, x, learned, target)


if __name__ == "__main__":
    main()
