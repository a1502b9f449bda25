"""The operator recursion X_k = i[H(t), X_{k-1}] + dX_{k-1}/dt, three ways.

    python examples/operator_series.py
    KDEQX_FULL=1 python examples/operator_series.py     # recursion up to k = 8

The question (H = cos(t) sy, X_0 = sx) wrote the recursion with nested `jax.jacfwd`
under `jax.jit(static_argnames="k")`; its compile time grows about threefold per order.
The widely shared fix -- a `lax.scan` whose step takes `jax.jacfwd(lambda t: X_km1)(t)`
of the carried array -- is fast but wrong: that lambda ignores its argument, so every
time derivative is zero. `kdeqx.OperatorSeries` gets the right answer with a compile
time that does not depend on the order.

If matplotlib is installed, the compile times are plotted to
examples/operator_series.png.
"""

import functools as ft
import os
import time

import jax


jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import kdeqx  # noqa: E402


FULL = bool(os.environ.get("KDEQX_FULL"))
MAX_RECURSIVE_K = 8 if FULL else 6

sx = jnp.asarray([[0, 1.0], [1.0, 0]], dtype=complex)
sy = jnp.asarray([[0, -1j], [1j, 0]], dtype=complex)
sz = jnp.asarray([[1.0, 0], [0, -1.0]], dtype=complex)


def hamiltonian(t):
    return jnp.cos(t) * sy


def commutator_herm(a, b):
    """The question's commutator: `AB - (AB)^dagger`, equal to `[A, B]` when both are
    Hermitian."""
    ab = a @ b
    return ab - jnp.swapaxes(ab, -1, -2).conj()


# 1. The question's recursion: right, but each order compiles ~3x longer.
@ft.partial(jax.jit, static_argnames="k")
def recursive(t, k):
    if k == 0:
        return sx

    def previous(t):
        return recursive(t, k - 1)

    dprevious = jax.jacfwd(previous, holomorphic=True)(t)
    return 1j * commutator_herm(hamiltonian(t), previous(t)) + dprevious


# 2. The widely shared scan: fast, and wrong from k = 2 on.
@ft.partial(jax.jit, static_argnames="k")
def wrong_scan(t, k):
    def step(x_km1, _):
        # `lambda t: x_km1` does not depend on t: this derivative is always zero.
        dx = jax.jacfwd(lambda t: x_km1, holomorphic=True)(t)
        x_k = 1j * commutator_herm(hamiltonian(t), x_km1) + dx
        return x_k, x_k

    _, xs = jax.lax.scan(step, sx, None, length=k)
    return jnp.concatenate([sx[None], xs])


def first_call(fn):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return result, time.perf_counter() - start


def main():
    t = jnp.asarray(1.0)
    order = 9

    # 3. kdeqx: X_0 .. X_9 in one call; compile time does not depend on the order.
    series = kdeqx.OperatorSeries(hamiltonian, sx, order=order)
    ours, ours_seconds = first_call(lambda: series(t))
    scan, _ = first_call(lambda: wrong_scan(jnp.asarray(1.0, complex), order))

    print("X_2 at t = 1 (exact: -4 cos^2(t) sx - 2 sin(t) sz):")
    exact = -4 * jnp.cos(t) ** 2 * sx - 2 * jnp.sin(t) * sz
    print("  exact         ", jnp.round(exact.ravel(), 4))
    print("  OperatorSeries", jnp.round(ours[2].ravel(), 4))
    print("  wrong scan    ", jnp.round(scan[2].ravel(), 4))
    print(f"  the scan is off by {float(jnp.max(jnp.abs(scan[2] - exact))):.2f}\n")

    print("first call (trace + compile + run) for X_0 .. X_k at t = 1:")
    print(
        f"{'k':>3} {'recursive jacfwd [s]':>21} {'OperatorSeries [s]':>19} "
        f"{'max |difference|':>17}"
    )
    recursive_seconds, ours_by_k = [], []
    for k in range(1, MAX_RECURSIVE_K + 1):
        x_k, elapsed = first_call(lambda: recursive(jnp.asarray(1.0, complex), k))
        recursive_seconds.append(elapsed)
        # A fresh series per k, so that each first call compiles.
        fresh = kdeqx.OperatorSeries(lambda t: jnp.cos(t) * sy, sx, order=k)
        _, ours_elapsed = first_call(lambda: fresh(t))
        ours_by_k.append(ours_elapsed)
        difference = float(jnp.max(jnp.abs(x_k - ours[k])))
        print(f"{k:>3} {elapsed:>21.3f} {ours_elapsed:>19.3f} {difference:>17.1e}")
    # Geometric mean of the last three ratios: single timings are noisy.
    growth = (recursive_seconds[-1] / recursive_seconds[-4]) ** (1 / 3)
    predicted = recursive_seconds[-1] * growth ** (order - MAX_RECURSIVE_K)
    print(
        f"recursive k = {order}, extrapolated at {growth:.1f}x per order: "
        f"about {predicted:.0f} s (the question measured 63 s)"
    )
    print(f"OperatorSeries, all of k = 0..{order}: {ours_seconds:.3f} s")

    # Large orders: the normalised terms X_k / k! stay finite even in float32.
    large = {}
    for big in [50, 100]:
        series = kdeqx.OperatorSeries(
            lambda t: jnp.cos(t) * sy.astype(jnp.complex64),
            sx.astype(jnp.complex64),
            order=big,
        )
        (mantissa, exponent), elapsed = first_call(
            lambda: series.normalised_frexp(jnp.float32(1.0))
        )
        large[big] = elapsed
        log10 = (jnp.log2(jnp.max(jnp.abs(mantissa[-1]))) + exponent[-1]) * jnp.log10(2)
        print(
            f"OperatorSeries K = {big} in float32: {elapsed:.3f} s, "
            f"|X_{big} / {big}!| = 10^{float(log10):.1f}"
        )

    plot(recursive_seconds, ours_by_k, large)


def plot(recursive_seconds, ours_by_k, large):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ks = list(range(1, len(recursive_seconds) + 1))
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.semilogy(ks, recursive_seconds, "o-", label="recursive nested jacfwd")
    ax.semilogy(
        ks + list(large), ours_by_k + list(large.values()), "s-", label="OperatorSeries"
    )
    ax.set_xscale("log")
    ax.set_xlabel("order k")
    ax.set_ylabel("first call [s]")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(os.path.dirname(__file__), "operator_series.png")
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
