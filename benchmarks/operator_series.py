"""The operator recursion X_k = i[H, X_{k-1}] + dX_{k-1}/dt: the question's recursive
nested `jacfwd` against `kdeqx.OperatorSeries`, in one run, then its cost at physics
sizes.

    python benchmarks/operator_series.py [--sections 1 2 3 4 5 6] [--repeats 20]
        [--sizes 4 32 128 256 1024] [--orders 10 40 100] [--budget 120]

Sections 1-4 use the question's problem, H = cos(t) sy, X_0 = sx, t = 1.

1. The question's code, verbatim in substance (`jax.jit(static_argnames="k")`, each
   level a `jacfwd(holomorphic=True)` of the level below, complex t): the first call
   for k = 1..K, in order, as the question ran it.
2. `OperatorSeries` in float32 and float64 for K = 9, 20, 50, 100: the first call of
   the jitted `normalised_frexp` (trace + compile + run), the steady run time (best of
   `--repeats`), the jaxpr size, and the largest relative error of `X_k / k!` against
   the closed form `z_k = exp(-2i sin t) d^k/dt^k exp(2i sin t)` evaluated in float64.
3. The recursive X_k against OperatorSeries' X_k for the k the recursion reached.
4. An `eqx.nn.MLP` generator and its gradient.
5. Physics sizes (float64): a driven Hamiltonian H(t) = H0 + cos(t) H1 (random
   Hermitian, norm about 1) with a diagonal X_0, for n in `--sizes` and K in
   `--orders`: the first call (after a warm-up on another problem) and the steady run
   of `series.normalised(t)` on the factored path; the steady run of the general path
   (`factored=False`) and its largest difference from the factored one; and the lower
   bound, K commutators `1j * (H0 @ X - X @ H0)` with the constant H0 in one jitted
   `lax.scan`. Then an MLP generator with no factored form (its output is the
   matrix), against the same bound. A measurement whose time, extrapolated as K^2
   from the previous order at the same n, exceeds `--budget` seconds
   (`--factored-budget` for the factored path) is skipped and says so; one that
   takes over 20 s is run once.
6. Section 5's driven series and its bound timed alternately, `--repeats` times each,
   best of each: the run/bound ratio without the drift between separate runs.
7. Section 5's driven series with its Cauchy product computed directly (`O(K^2)`
   products) and from values at points on circles (`O(K)`, the default where the
   direct product is large), the choice forced each way, each under a `jit` of its
   own (no quick start): first calls, steady runs
   timed alternately (best of `--repeats`, one run each past 20 s), and their
   largest relative difference per order.

Times are on a shared CPU with every core given to XLA (nothing here has a native
peer to match cores against): they move with the machine's load (printed).
"""

import argparse
import functools as ft
import math
import os
import time

import equinox as eqx
import jax


jax.config.update("jax_enable_x64", True)

import jax.extend.core as jex  # noqa: E402
import jax.lax as lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kdeqx  # noqa: E402
from kdeqx.series import _recursion  # noqa: E402


# --- The question's formulation -------------------------------------------------------

SX = jnp.asarray([[0, 1.0], [1.0, 0]], dtype=complex)
SY = jnp.asarray([[0, -1j], [1j, 0]], dtype=complex)


def conj_op(a):
    return jnp.swapaxes(a, -1, -2).conj()


def commutator_herm(a, b):
    comm = a @ b
    return comm - conj_op(comm)


def question_h(t):
    return jnp.cos(t) * SY


def question_x0(t):
    return SX


@ft.partial(jax.jit, static_argnames="k")
def my_func(t, k):
    if k == 0:
        return question_x0(t)

    def x_km1(t):
        return my_func(t, k - 1)

    return 1j * commutator_herm(question_h(t), x_km1(t)) + jax.jacfwd(
        x_km1, holomorphic=True
    )(t)


# --- Helpers --------------------------------------------------------------------------


def timed(fn):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return result, time.perf_counter() - start


def best_of(fn, repeats):
    return min(timed(fn)[1] for _ in range(repeats))


def count_equations(jaxpr):
    return len(jaxpr.eqns) + sum(count_equations(j) for j in jex.subjaxprs(jaxpr))


def closed_form(t, order):
    """X_k / k! = Re(c_k) sx + Im(c_k) sz, c_k the Taylor coefficients of
    exp(2i (sin(t + s) - sin t)), by the scalar recurrence for exp in float64."""
    sin_derivatives = [np.sin(t), np.cos(t), -np.sin(t), -np.cos(t)]
    g = np.array(
        [
            2j * sin_derivatives[m % 4] * math.exp(-math.lgamma(m + 1))
            for m in range(order + 1)
        ]
    )
    c = np.zeros(order + 1, complex)
    c[0] = 1.0
    for m in range(1, order + 1):
        j = np.arange(1, m + 1)
        c[m] = np.sum(j * g[j] * c[m - j]) / m
    sx = np.array([[0, 1], [1, 0]], complex)
    sz = np.array([[1, 0], [0, -1]], complex)
    return c.real[:, None, None] * sx + c.imag[:, None, None] * sz


def max_relative_error(got, expected):
    error = np.max(np.abs(got - expected), axis=(-2, -1))
    scale = np.max(np.abs(expected), axis=(-2, -1))
    return float(np.max(error / scale))


class MLPGenerator(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t):
        return self.mlp(t).reshape(3, 3)


def mlp_series(order):
    key = jax.random.key(0)
    mlp = eqx.nn.MLP("scalar", 9, 16, 2, jax.nn.softplus, dtype=jnp.float32, key=key)
    observable = jnp.diag(jnp.arange(3.0, dtype=jnp.float32))
    return kdeqx.OperatorSeries(MLPGenerator(mlp), observable, order)


def loss(series, t):
    return jnp.sum(jnp.abs(series.normalised(t)) ** 2)


def series_for(dtype, order):
    complex_dtype = jnp.complex64 if dtype == jnp.float32 else jnp.complex128
    sx = jnp.asarray(SX, complex_dtype)
    sy = jnp.asarray(SY, complex_dtype)
    return kdeqx.OperatorSeries(lambda t: jnp.cos(t) * sy, sx, order=order)


# --- Main -----------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-recursive-k", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--sections", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 32, 128, 256, 1024])
    parser.add_argument("--orders", type=int, nargs="+", default=[10, 40, 100])
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--factored-budget", type=float, default=300.0)
    args = parser.parse_args()

    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    print("load average at start: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    recursive = {}
    if 1 in args.sections:
        recursive = question_recursion(args)
    if 2 in args.sections:
        question_series(args)
    if 3 in args.sections and recursive:
        against_recursion(args, recursive)
    if 4 in args.sections:
        other_workloads(args)
    if 5 in args.sections:
        physics_sizes(args)
    if 6 in args.sections:
        interleaved_ratios(args)
    if 7 in args.sections:
        points_against_direct(args)
    print("load average at end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


def question_recursion(args):
    t = jnp.asarray(1, dtype=complex)

    print("\n1. The question's recursive nested jacfwd (complex128), first call per k")
    print(f"{'k':>3} {'first call [s]':>15}")
    recursive, seconds = {}, []
    for k in range(1, args.max_recursive_k + 1):
        recursive[k], first = timed(lambda: my_func(t, k))
        seconds.append(first)
        print(f"{k:>3} {first:>15.3f}")
    growth = (seconds[-1] / seconds[-3]) ** 0.5
    print(
        f"total {sum(seconds):.1f} s; over the last orders each costs {growth:.1f}x "
        "the one before"
    )

    return recursive


def question_series(args):
    print("\n2. kdeqx.OperatorSeries, H = cos(t) sy, X_0 = sx, t = 1")
    print(
        "first call of series.normalised_frexp(t): wall and CPU seconds (trace + "
        "compile + run; after one\nwarm-up call on another problem); steady run time "
        "through the method and inside a jax.jit;\nerror of X_k / k! against the "
        "float64 closed form"
    )
    # One call on another problem first, so that one-off process start-up costs
    # (first use of tracing machinery) are not charged to K = 9.
    jax.block_until_ready(series_for(jnp.float32, 2).normalised(jnp.float32(0.5)))
    header = (
        f"{'dtype':>8} {'K':>4} {'first [s]':>10} {'CPU [s]':>8} {'run [ms]':>9} "
        f"{'in jit [ms]':>12} {'eqns':>5} {'max rel err':>12} {'|X_K/K!|':>9} "
        f"{'finite':>7}"
    )
    print(header)
    for dtype in [jnp.float32, jnp.float64]:
        time_ = jnp.asarray(1.0, dtype)
        for order in [9, 20, 50, 100]:
            series = series_for(dtype, order)
            cpu = time.process_time()
            (mantissa, exponent), first = timed(lambda: series.normalised_frexp(time_))
            cpu = time.process_time() - cpu
            run = best_of(lambda: series.normalised_frexp(time_), args.repeats)
            jitted = jax.jit(lambda t, series=series: series.normalised_frexp(t))
            jax.block_until_ready(jitted(time_))
            run_jit = best_of(lambda: jitted(time_), args.repeats)
            equations = count_equations(jax.make_jaxpr(jitted)(time_).jaxpr)
            scale = np.ldexp(1.0, np.asarray(exponent))[:, None, None]
            got = np.asarray(mantissa, np.complex128) * scale
            error = max_relative_error(got, closed_form(1.0, order))
            finite = bool(np.all(np.isfinite(mantissa)))
            size = np.max(np.abs(got[-1]))
            print(
                f"{jnp.dtype(dtype).name:>8} {order:>4} {first:>10.3f} {cpu:>8.3f} "
                f"{run * 1e3:>9.3f} {run_jit * 1e3:>12.3f} {equations:>5} "
                f"{error:>12.2e} {size:>9.1e} {str(finite):>7}"
            )
    # The plain X_k / k! in float32 at K = 100: finite, flushed to zero below 1e-38.
    plain = series_for(jnp.float32, 100).normalised(jnp.float32(1.0))
    print(
        "float32 normalised(t) at K = 100: all finite "
        f"{bool(jnp.all(jnp.isfinite(plain)))}; zero from k = "
        f"{int(np.argmax(np.max(np.abs(np.asarray(plain)), axis=(1, 2)) == 0))} "
        "(below float32's smallest normal number; normalised_frexp keeps them)"
    )


def against_recursion(args, recursive):
    print("\n3. Recursive X_k against OperatorSeries X_k (complex128)")
    k_max = args.max_recursive_k
    ours = np.asarray(series_for(jnp.float64, k_max)(jnp.float64(1.0)))
    for k in range(1, k_max + 1):
        difference = np.max(np.abs(np.asarray(recursive[k]) - ours[k]))
        print(
            f"k = {k}: max |difference| = {difference:.1e}, |X_k| = "
            f"{np.max(np.abs(ours[k])):.2e}"
        )


def other_workloads(args):
    print(
        "\n4. Other workloads in float32: first call (trace, compile, run), steady run"
    )
    for order in [20, 100]:
        series = mlp_series(order)
        time_ = jnp.float32(0.3)
        _, first = timed(lambda: series.normalised(time_))
        run = best_of(lambda: series.normalised(time_), args.repeats)
        print(
            f"eqx.nn.MLP generator (3 x 3, softplus, depth 2), K = {order}: "
            f"first {first:.3f} s, run {run * 1e3:.3f} ms"
        )
        loss_grad = eqx.filter_jit(eqx.filter_grad(loss))
        _, first = timed(lambda: loss_grad(series, time_))
        run = best_of(lambda: loss_grad(series, time_), args.repeats)
        print(
            f"  its gradient w.r.t. the MLP's parameters, K = {order}: "
            f"first {first:.3f} s, run {run * 1e3:.3f} ms"
        )


# --- Section 5: physics sizes ---------------------------------------------------------


def hermitian(key, n):
    """A random Hermitian matrix of spectral norm about 1."""
    a, b = jax.random.normal(key, (2, n, n), jnp.float64)
    m = (a + 1j * b) / np.sqrt(2 * n)
    return (m + m.conj().T) / 2


def driven_problem(n):
    k0, k1, k2 = jax.random.split(jax.random.key(n), 3)
    h0, h1 = hermitian(k0, n), hermitian(k1, n)
    x0 = jnp.diag(jax.random.normal(k2, (n,), jnp.float64)).astype(complex)
    return h0, h1, x0


def driven_series(problem, order, factored=True):
    h0, h1, x0 = problem
    return kdeqx.OperatorSeries(
        lambda t: h0 + jnp.cos(t) * h1, x0, order, factored=factored
    )


class MatrixMLP(eqx.Module):
    """A generator whose matrix is an MLP's output: no factored form."""

    mlp: eqx.nn.MLP
    n: int = eqx.field(static=True)

    def __call__(self, t):
        m = self.mlp(t).reshape(self.n, self.n)
        return (m + m.T) / (2 * self.n)


def mlp_problem(n):
    key = jax.random.key(n + 1)
    mlp = eqx.nn.MLP("scalar", n * n, 32, 2, jnp.tanh, dtype=jnp.float64, key=key)
    return MatrixMLP(mlp, n), driven_problem(n)[2]


def commutators(h, x, order):
    """The lower bound: K commutators with a constant generator."""

    def step(x, _):
        return 1j * (h @ x - x @ h), None

    return lax.scan(step, x, None, length=order)[0]


def steady(fn, repeats):
    """Best of a few runs after one (which is also the answer when it took > 20 s)."""
    result, first = timed(fn)
    if first > 20:
        return result, first, 1
    runs = max(2, min(repeats, int(10 / max(first, 1e-4))))
    return result, min(first, best_of(fn, runs)), runs + 1


class Extrapolation:
    """Each measurement's time at the previous order of the same size, scaled as
    K^2, against the budget."""

    def __init__(self, budget, factored_budget):
        self.budgets = {"factored": factored_budget}
        self.budget, self.last = budget, {}

    def estimate(self, key, order):
        if key not in self.last:
            return 0.0
        previous_order, seconds = self.last[key]
        return seconds * (order / previous_order) ** 2

    def allows(self, key, order):
        return self.estimate(key, order) <= self.budgets.get(key[0], self.budget)

    def record(self, key, order, seconds):
        self.last[key] = (order, seconds)


def physics_sizes(args):
    print(
        "\n5. Physics sizes, float64, series.normalised(t): H(t) = H0 + cos(t) H1 "
        "(random Hermitian,\nnorm ~1), X_0 diagonal; factored path (first call after "
        "a warm-up, steady run), general path\n(factored=False, steady), lower bound "
        "(K commutators with constant H0, one jitted scan)"
    )
    warm = kdeqx.OperatorSeries(lambda t: jnp.sin(t) * SY, SX, 2)
    jax.block_until_ready(warm.normalised(jnp.float64(0.1)))
    header = (
        f"{'n':>5} {'K':>4} {'terms':>7} {'first [s]':>10} {'run [s]':>9} "
        f"{'general [s]':>12} {'bound [s]':>10} {'run/bound':>10} "
        f"{'general/run':>12} {'max diff':>9}"
    )
    print(header)
    budget = Extrapolation(args.budget, args.factored_budget)
    t = jnp.float64(0.3)
    for n in args.sizes:
        problem = driven_problem(n)
        bound = jax.jit(commutators, static_argnums=2)
        for order in args.orders:
            row = f"{n:>5} {order:>4}"
            if not budget.allows(("factored", n), order):
                estimate = budget.estimate(("factored", n), order)
                print(f"{row}  skipped: estimated {estimate:.0f} s per call")
                continue
            series = driven_series(problem, order)
            terms = series.factored_terms()
            fast, first = timed(lambda: series.normalised(t))
            _, run, _ = steady(lambda: series.normalised(t), args.repeats)
            budget.record(("factored", n), order, run)
            _, bound_run, _ = steady(
                lambda: bound(problem[0], problem[2], order), args.repeats
            )
            general, difference = "skipped", ""
            if budget.allows(("general", n), order):
                general_series = driven_series(problem, order, factored=False)
                slow, general_run, _ = steady(
                    lambda: general_series.normalised(t), args.repeats
                )
                budget.record(("general", n), order, general_run)
                difference = (
                    f"{max_relative_error(np.asarray(fast), np.asarray(slow)):.1e}"
                )
                general = f"{general_run:.4g}"
                ratio = f"{general_run / run:.1f}"
            else:
                ratio = ""
            print(
                f"{row} {str(terms):>7} {first:>10.3f} {run:>9.4g} {general:>12} "
                f"{bound_run:>10.4g} {run / bound_run:>10.1f} {ratio:>12} "
                f"{difference:>9}"
            )

    print(
        "\nMLP generator with no factored form (H = sym(reshape(MLP(t)))/n, width 32, "
        "depth 2, tanh), X_0 diagonal"
    )
    print(
        f"{'n':>5} {'K':>4} {'terms':>12} {'first [s]':>10} {'run [s]':>9} "
        f"{'bound [s]':>10} {'run/bound':>10}"
    )
    bound = jax.jit(commutators, static_argnums=2)
    for n in args.sizes:
        generator, x0 = mlp_problem(n)
        h0 = driven_problem(n)[0]
        for order in args.orders:
            if not budget.allows(("mlp", n), order):
                estimate = budget.estimate(("mlp", n), order)
                print(
                    f"{n:>5} {order:>4}  skipped: estimated {estimate:.0f} s per call"
                )
                continue
            series = kdeqx.OperatorSeries(generator, x0, order)
            _, first = timed(lambda: series.normalised(t))
            _, run, _ = steady(lambda: series.normalised(t), args.repeats)
            budget.record(("mlp", n), order, run)
            _, bound_run, _ = steady(lambda: bound(h0, x0, order), args.repeats)
            terms = str(series.factored_terms())
            print(
                f"{n:>5} {order:>4} {terms:>12} {first:>10.3f} {run:>9.4g} "
                f"{bound_run:>10.4g} {run / bound_run:>10.1f}"
            )


def interleaved_ratios(args):
    """The series and its bound timed alternately, best of `--repeats` each: the
    ratio that section 5 reports, without the drift between separate runs."""
    print(
        "\n6. Section 5's driven series against its bound, run alternately (best of "
        f"{args.repeats} each)"
    )
    print(f"{'n':>5} {'K':>4} {'series [s]':>11} {'bound [s]':>10} {'run/bound':>10}")
    t = jnp.float64(0.3)
    bound = jax.jit(commutators, static_argnums=2)
    for n in args.sizes:
        problem = driven_problem(n)
        for order in args.orders:
            series = driven_series(problem, order)
            run_series = lambda: series.normalised(t)  # noqa: E731
            run_bound = lambda: bound(problem[0], problem[2], order)  # noqa: E731
            best = [math.inf, math.inf]
            for _ in range(args.repeats):
                for i, fn in enumerate((run_series, run_bound)):
                    best[i] = min(best[i], timed(fn)[1])
            print(
                f"{n:>5} {order:>4} {best[0]:>11.4g} {best[1]:>10.4g} "
                f"{best[0] / best[1]:>10.2f}"
            )


def points_against_direct(args):
    """The driven series with the product at points forced on and off."""
    print(
        "\n7. Section 5's driven series, Cauchy product direct against at points "
        f"(best of {args.repeats} each, alternately)"
    )
    print(
        f"{'n':>5} {'K':>4} {'first direct':>13} {'first points':>13} "
        f"{'direct [s]':>11} {'points [s]':>11} {'speed-up':>9} {'max diff':>9}"
    )
    t = jnp.float64(0.3)
    names = ("POINTS_FROM_WORK", "POINTS_FROM_WORK_SMALL")
    defaults = {name: getattr(_recursion, name) for name in names}
    for n in args.sizes:
        problem = driven_problem(n)
        for order in args.orders:
            runs, firsts, values = [], [], []
            for work in (math.inf, 0):
                # Traces are cached by the series' structure, which holds no
                # threshold: each variant is traced and compiled afresh, in a
                # program of its own (a jitted function of its own), so that the
                # second does not replace the first in the cache.
                jax.clear_caches()
                for name in names:
                    setattr(_recursion, name, work)
                series = driven_series(problem, order)
                jitted = eqx.filter_jit(lambda s: s.normalised(t))
                run = ft.partial(jitted, series)
                value, first = timed(run)
                runs.append(run)
                firsts.append(first)
                values.append(np.asarray(value))
            for name, value in defaults.items():
                setattr(_recursion, name, value)
            best = [math.inf, math.inf]
            repeats = 1 if max(firsts) > 20 else args.repeats
            for _ in range(repeats):
                for i, run in enumerate(runs):
                    best[i] = min(best[i], timed(run)[1])
            difference = max_relative_error(values[1], values[0])
            print(
                f"{n:>5} {order:>4} {firsts[0]:>13.3f} {firsts[1]:>13.3f} "
                f"{best[0]:>11.4g} {best[1]:>11.4g} {best[0] / best[1]:>9.2f} "
                f"{difference:>9.1e}"
            )


if __name__ == "__main__":
    main()
