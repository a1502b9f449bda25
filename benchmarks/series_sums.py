"""The operator series' weighted sums over `V`'s planes, written several ways, on
the backend at hand (meant for a TPU, where the planes' layout decides what a step
of the propagators' scan costs).

    python benchmarks/series_sums.py [--n 1024 256] [--order 40] [--hlo FILE]

1. A scan shaped like the propagators' (`K + 1` steps over planes of shape
   `(K + 2, 2, n, n)`): each step sums the rows weighted by scalars and writes one
   new row. The sums as a contraction (`weighted_sums` as the CPU takes it), along
   the rows (`along_rows`, as a TPU takes it), and not at all (the row's write
   alone).
2. `kdeqx.OperatorSeries` (complex64, `H0 + cos(t) H1`, diagonal `X_0`) with the
   propagators' sums as a contraction, along the rows, and along the rows up to
   the step's own alone (in parts, a branch each: `SUMS_IN_PARTS_FROM`): first
   call, steady time (best of 5) and the largest difference from the first.

3. The product at points' sums alone: values at `K + 1` points from `K + 2`
   coefficients, by a contraction with the planes as they are and with the planes
   flattened to `(K + 2, 2 n^2)`, and as one complex contraction.
4. The series with the product at points' sums each of those ways.

With `--hlo`, the compiled program of the series at the largest `n` is written to
FILE.0, FILE.1 and FILE.2, one for each way of section 2.
"""

import argparse
import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from accelerator import first_and_best

import kdeqx
from kdeqx._backend import FULL_PRECISION
from kdeqx.series import _points, _recursion


def scan_like(n, order, sums):
    """The propagators' scan with only the weighted sums and the row writes."""
    length = order + 2

    def run(weights):
        planes = jnp.zeros((length, 2, n, n), jnp.float32).at[0, 0].set(jnp.eye(n))

        def step(planes, k):
            live = jnp.arange(length) < k
            w = jnp.where(live, weights, 0)[None]
            if sums is None:
                total = lax.complex(planes[k - 1, 0], planes[k - 1, 1])
            else:
                total = sums(w, planes)[0]
            new = jnp.stack([total.real, total.imag]) * 0.5
            return lax.dynamic_update_index_in_dim(planes, new, k, 0), None

        return lax.scan(step, planes, jnp.arange(1, length))[0]

    return jax.jit(run)


def section_scan(sizes, order):
    print("1. a scan shaped like the propagators': sums and row writes")
    weights = jnp.asarray(
        np.random.default_rng(0).standard_normal(order + 2), jnp.complex64
    ) * (1 + 0.5j)
    for n in sizes:
        ways = {
            "contraction": _points.weighted_sums,
            "along rows": lambda w, planes: _points.weighted_sums(w, planes, True),
            "writes only": None,
        }
        reference = None
        for name, sums in ways.items():
            run = scan_like(n, order, sums)
            first, best, out = first_and_best(lambda: run(weights), 5)
            if reference is None:
                reference = out
            scale = float(jnp.max(jnp.abs(reference)))
            difference = float(jnp.max(jnp.abs(out - reference))) / scale
            if sums is None:  # another computation: nothing to compare
                difference = 0.0
            print(
                f"  n={n} K={order} {name:>12}: first {first:.2f} s, steady "
                f"{best * 1e3:.2f} ms; relative difference {difference:.1e}"
            )


def hermitian(key, n):
    a, b = jax.random.normal(key, (2, n, n), jnp.float32)
    m = (a + 1j * b) / np.sqrt(2 * n)
    return ((m + m.conj().T) / 2).astype(jnp.complex64)


def driven_series(n, order):
    """`H0 + cos(t) H1` with a diagonal `X_0`, complex64, as `accelerator.py` has it."""
    k0, k1, k2 = jax.random.split(jax.random.key(n), 3)
    h0, h1 = hermitian(k0, n), hermitian(k1, n)
    x0 = jnp.diag(jax.random.normal(k2, (n,))).astype(jnp.complex64)
    return kdeqx.OperatorSeries(lambda t: h0 + jnp.cos(t) * h1, x0, order)


NEVER = 2**31


def series_each_way(series, ways, label, hlo=None):
    """`series` compiled afresh after each `(name, use)` of `ways` (`use()` sets the
    way), timed against the first way's coefficients; with `hlo`, each way's
    compiled program written to `hlo.<index>`."""
    t = jnp.float32(0.3)
    reference = None
    for index, (name, use) in enumerate(ways):
        use()
        jax.clear_caches()
        run = eqx.filter_jit(lambda s, t: s.normalised(t))
        first, best, out = first_and_best(lambda: run(series, t), 5)
        if reference is None:
            reference = out
        if hlo:
            with open(f"{hlo}.{index}", "w") as file:
                compiled = run.lower(series, t).lowered.compile()
                file.write(compiled.as_text() or "")
        difference = float(jnp.max(jnp.abs(out - reference)))
        print(
            f"  {label} {name:>22}: first {first:.2f} s, steady "
            f"{best * 1e3:.2f} ms; max difference {difference:.1e}"
        )


def summing(along, parts_from):
    """The propagators' sums along the rows on the backends `along`, in parts from
    `parts_from` on."""
    _recursion.SUMS_ALONG_ROWS_ON = along
    _recursion.SUMS_IN_PARTS_FROM = parts_from


def section_series(sizes, order, hlo):
    print("2. OperatorSeries, complex64, the propagators' sums each way")
    backend = jax.default_backend()
    ways = [
        ("contraction", ft.partial(summing, (), NEVER)),
        ("along rows", ft.partial(summing, (backend,), NEVER)),
        ("along rows, rows <= m", ft.partial(summing, (backend,), 0)),
    ]
    defaults = _recursion.SUMS_ALONG_ROWS_ON, _recursion.SUMS_IN_PARTS_FROM
    for n in sizes:
        largest = hlo if n == max(sizes) else None
        series_each_way(driven_series(n, order), ways, f"n={n} K={order}", largest)
    summing(*defaults)


def flat_sums(weights, planes, along_rows=False):
    """`weighted_sums` as one contraction of the weights with the planes flattened
    to `(L, 2 n^2)`, a plain matrix product."""
    if along_rows:
        return _points.weighted_sums(weights, planes, True)
    count, n = weights.shape[0], planes.shape[-1]
    real_weights = jnp.concatenate([weights.real, weights.imag])
    flat = planes.reshape(planes.shape[0], -1)
    parts = jnp.dot(real_weights, flat, precision=FULL_PRECISION)
    parts = parts.reshape(2 * count, 2, n, n)
    by_real, by_imag = parts[:count], parts[count:]
    return lax.complex(by_real[:, 0] - by_imag[:, 1], by_real[:, 1] + by_imag[:, 0])


def complex_sums(weights, planes, along_rows=False):
    """`weighted_sums` as one complex contraction of the weights with the planes
    made complex again: the backend's own complex product."""
    if along_rows:
        return _points.weighted_sums(weights, planes, True)
    x = lax.complex(planes[:, 0], planes[:, 1])
    return jnp.tensordot(weights, x, 1, precision=FULL_PRECISION)


def section_points(sizes, order):
    print("3. values at K + 1 points, and back to K + 1 coefficients, each way")
    rng = np.random.default_rng(1)
    length = order + 2
    weights = rng.standard_normal((order + 1, length)) * (1 + 0.3j)
    weights = jnp.asarray(weights, jnp.complex64)
    for n in sizes:
        planes = jnp.asarray(rng.standard_normal((length, 2, n, n)), jnp.float32)
        reference = None
        for name, sums in points_ways().items():
            run = jax.jit(sums)
            first, best, out = first_and_best(lambda: run(weights, planes), 5)
            if reference is None:
                reference = out
            scale = float(jnp.max(jnp.abs(reference)))
            difference = float(jnp.max(jnp.abs(out - reference))) / scale
            print(
                f"  n={n} K={order} contraction {name:>7}: first {first:.2f} s, "
                f"steady {best * 1e3:.2f} ms; relative difference {difference:.1e}"
            )


def section_series_points(sizes, order):
    print("4. OperatorSeries, complex64, the product at points' sums each way")
    original = _points.weighted_sums
    ways = [
        (name, ft.partial(setattr, _points, "weighted_sums", sums))
        for name, sums in points_ways().items()
    ]
    for n in sizes:
        series_each_way(driven_series(n, order), ways, f"n={n} K={order}")
    _points.weighted_sums = original


def points_ways():
    """The product at points' sums: as they are, flattened, and complex."""
    return {"4-D": _points.weighted_sums, "flat": flat_sums, "complex": complex_sums}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--order", type=int, default=40)
    parser.add_argument("--hlo")
    parser.add_argument("--sections", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {FULL_PRECISION}")
    if 1 in args.sections:
        section_scan(args.n, args.order)
    if 2 in args.sections:
        section_series(args.n, args.order, args.hlo)
    if 3 in args.sections:
        section_points(args.n, args.order)
    if 4 in args.sections:
        section_series_points(args.n, args.order)


if __name__ == "__main__":
    main()
