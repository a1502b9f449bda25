"""Sorting the edges of each point's row (`kdeqx._backend.sort_edges_in_rows`) by
ranks against XLA's sort, for rows of several widths.

    python benchmarks/row_sorts.py [--entries 3.2e6] [--widths 8 16 32 64 128]

Rows of random receivers and images (`--entries` in all, as a `knn_graph`'s edges),
best of five calls each way, with the compile time of each. The ranks compare every
pair of a row's edges, so they pay `width` times more work than a sort of the row
and win only while rows are narrow: `kdeqx._backend._pairs.RANKED_WIDTH` is the
widest row they take.
"""

import argparse

import jax
import numpy as np
from _timing import best_of, compile_time

from kdeqx import _backend
from kdeqx._backend import _pairs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=float, default=3.2e6)
    parser.add_argument("--widths", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind}; RANKED_WIDTH = {_pairs.RANKED_WIDTH}")
    rng = np.random.default_rng(0)
    for width in args.widths:
        rows = int(args.entries) // width
        receivers = jax.device_put(rng.integers(0, rows, (rows, width), np.int32))
        images = jax.device_put(rng.integers(0, 27, (rows, width), np.int32))
        times = {}
        for name, fn in [
            ("ranks", _pairs.sort_edges_in_rows),
            ("sort", _backend.sort_edges_in_rows_reference),
        ]:
            # Ranks at every width: the constant must not decide for them.
            if name == "ranks":
                _pairs.RANKED_WIDTH, saved = width, _pairs.RANKED_WIDTH
            try:
                compiled = compile_time(lambda fn=fn: jax.jit(fn), receivers, images)
                run = jax.jit(fn)
                run(receivers, images)
                times[name] = (best_of(lambda: run(receivers, images), 5), compiled)
            finally:
                if name == "ranks":
                    _pairs.RANKED_WIDTH = saved
        (ranked, c_ranked), (sorted_, c_sorted) = times["ranks"], times["sort"]
        print(
            f"width {width:4d}, {rows} rows: ranks {ranked:.4f} s, sort "
            f"{sorted_:.4f} s ({ranked / sorted_:.2f}x); compile {c_ranked:.2f} s "
            f"against {c_sorted:.2f} s"
        )


if __name__ == "__main__":
    main()
