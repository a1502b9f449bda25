"""Gathers of rows against gathers of scalars, and a sink's scatters, on this backend
(`kdeqx._backend.gathers_rows_faster`, `kdeqx._engine._traverse.ROW_SLOTS`).

    python benchmarks/gathers.py [--n 1e6] [--m 1.03e7]

An `(n, 3)` table of coordinates read at `m` random rows, as a pair query reads its
pairs' points (`--m` about ten pairs a point): one gather of scalars per axis, as
`kdeqx._backend.axes_at_reference` does, against one gather of `(m, 3)` rows,
`kdeqx._backend.axes_at` with `backend="tpu"`. Then a scatter of a tile's picked
records (`--rows` rows of `ROW_SLOTS` slots, a few records a row, into an array of
`m`) as scalars and as windows of a row, each best of five calls.
"""

import argparse
import functools as ft

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from _timing import best_of

from kdeqx import _backend
from kdeqx._engine._traverse import ROW_SLOTS


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--m", type=float, default=1.03e7)
    parser.add_argument("--rows", type=int, default=15632)
    args = parser.parse_args()
    n, m, rows = int(args.n), int(args.m), args.rows
    print(f"{jax.devices()[0].device_kind}; n = {n}, m = {m}")
    rng = np.random.default_rng(0)
    points = jax.device_put(rng.random((n, 3)).astype(np.float32))
    index = jax.device_put(rng.integers(0, n, m).astype(np.int32))
    for name, fn in [
        ("a gather of scalars per axis", _backend.axes_at_reference),
        ("one gather of rows", ft.partial(_backend.axes_at, backend="tpu")),
    ]:
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(points, index))
        seconds = best_of(lambda: jitted(points, index), repeats=5)
        print(f"  {name:<36}{seconds * 1e3:9.2f} ms")

    # A tile's records, a few a row, picked into slots and written to a sink.
    counts = np.minimum(rng.poisson(3.3, rows), ROW_SLOTS).astype(np.int32)
    first = jnp.asarray(np.cumsum(counts) - counts + m // 10)
    values = jnp.asarray(rng.integers(0, n, (rows, ROW_SLOTS)).astype(np.int32))
    valid = jnp.asarray(np.arange(ROW_SLOTS) < counts[:, None])
    sink = jnp.full(m, -1, jnp.int32)

    @jax.jit
    def scalars(sink, values, valid):
        slot = jnp.where(valid, first[:, None] + jnp.arange(ROW_SLOTS), m)
        return sink.at[slot.reshape(-1)].set(values.reshape(-1), mode="drop")

    windows = lax.ScatterDimensionNumbers(
        update_window_dims=(1,),
        inserted_window_dims=(),
        scatter_dims_to_operand_dims=(0,),
    )

    @jax.jit
    def rows_of_slots(sink, values, valid):
        # Windows overlap past a row's records: those add nothing.
        added = jnp.where(valid, values + 1, 0)
        mode = lax.GatherScatterMode.FILL_OR_DROP
        return lax.scatter_add(sink, first[:, None], added, windows, mode=mode)

    results = []
    for name, fn in [
        (f"{rows * ROW_SLOTS} scalars", scalars),
        (f"{rows} windows of {ROW_SLOTS}", rows_of_slots),
    ]:
        results.append(jax.block_until_ready(fn(sink, values, valid)))
        seconds = best_of(lambda: fn(sink, values, valid), repeats=5)
        print(f"  scatter of {name:<26}{seconds * 1e3:9.2f} ms")
    assert bool(jnp.array_equal(results[0], results[1]))


if __name__ == "__main__":
    main()
