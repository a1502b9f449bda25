"""Move query points with optax until an interpolated field reaches a target value.

A smooth periodic field is sampled at random points in the unit square and
interpolated with kdeqx (Gaussian kernel over the k nearest points, in a periodic box
so that queries never fall off an edge). A batch of query
points is then trained with Adam on `sum((field(x) - target)**2)`, which pulls every
point onto the level set `field = target`. Gradients flow through the interpolation
into the query coordinates; the tree is never rebuilt.

    python examples/optimize_queries.py            # small, well under a minute on CPU
    KDEQX_FULL=1 python examples/optimize_queries.py
"""

import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import kdeqx


FULL = bool(os.environ.get("KDEQX_FULL"))
NUM_POINTS = 1_000_000 if FULL else 20_000
NUM_QUERIES = 4096 if FULL else 256
NUM_STEPS = 400 if FULL else 200
TARGET = 0.5


def analytic_field(x):
    """The ground truth, in [-1, 1] and periodic with period 1 on both axes."""
    return jnp.sin(2 * jnp.pi * x[..., 0]) * jnp.cos(2 * jnp.pi * x[..., 1])


def make_field(key, num_points):
    points = jax.random.uniform(key, (num_points, 2))
    tree = kdeqx.KDTree(points, box=1.0)
    # A kernel width of about one point spacing: smooth in x, little blurring.
    spacing = num_points**-0.5
    return kdeqx.Interpolator(
        tree, analytic_field(points), k=16, kernel="gaussian", length_scale=spacing
    )


def loss_fn(x, field):
    return jnp.sum((field(x) - TARGET) ** 2)


@eqx.filter_jit
def make_step(x, opt_state, field, optimiser):
    loss, grads = jax.value_and_grad(loss_fn)(x, field)
    updates, opt_state = optimiser.update(grads, opt_state, x)
    x = optax.apply_updates(x, updates)
    # Only for tidiness: the periodic tree would accept unwrapped queries too.
    return jnp.mod(x, 1.0), opt_state, loss


def main():
    field_key, query_key = jax.random.split(jax.random.key(0))
    start = time.perf_counter()
    field = make_field(field_key, NUM_POINTS)
    print(f"interpolating {NUM_POINTS:,} samples of sin(2πx)cos(2πy)")

    x = jax.random.uniform(query_key, (NUM_QUERIES, 2))
    # A decaying step lets the points settle on the level set instead of jittering.
    schedule = optax.cosine_decay_schedule(1e-2, NUM_STEPS, alpha=0.01)
    optimiser = optax.adam(schedule)
    opt_state = optimiser.init(x)
    for step in range(NUM_STEPS):
        x, opt_state, loss = make_step(x, opt_state, field, optimiser)
        if step % 20 == 0 or step == NUM_STEPS - 1:
            print(f"step {step:4d}  loss {loss:.3e}")

    # The optimiser only saw the interpolant; check against the analytic field too.
    # The gap between the two is the interpolation error, not the optimiser's.
    for name, f in [("interpolated", field), ("analytic", analytic_field)]:
        error = jnp.abs(f(x) - TARGET)
        print(
            f"{name:>12} |f(x) - {TARGET}| over {NUM_QUERIES} points: "
            f"median {jnp.median(error):.1e}, max {jnp.max(error):.1e}"
        )
    print(f"total time {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
