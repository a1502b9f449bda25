"""The figure of docs/kernels.md: each interpolation kernel, and its derivative, along a
line through scattered 2-D data (k = 16), beside the true field.

    python benchmarks/kernels_figure.py   # writes docs/images/kernels.png
"""

import pathlib

import jax
import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import kdeqx


jax.config.update("jax_enable_x64", True)
FIGURE = pathlib.Path(__file__).parents[1] / "docs" / "images" / "kernels.png"
KERNELS = {
    "idw": dict(kernel="idw"),
    "rbf (thin-plate spline)": dict(kernel="rbf"),
    "mls (degree 1)": dict(kernel="mls"),
}


def field(p):
    return np.sin(6 * p[..., 0]) + np.cos(4 * p[..., 1])


def main():
    rng = np.random.default_rng(0)
    points = rng.random((400, 2))
    tree = kdeqx.KDTree(points)
    values = field(points)
    t = np.linspace(0.2, 0.8, 3000)
    line = np.stack([t, 0.35 + 0.3 * t], axis=-1)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(t, field(line), "k", lw=2, alpha=0.3, label="true field")
    for name, options in KERNELS.items():

        def f(x, options=options):
            return tree.interpolate(x, values, k=16, **options)

        values_on_line = np.asarray(jax.jit(f)(line))
        top.plot(t, values_on_line, lw=1, label=name)
        # The derivative as the difference quotient between samples: a jump shows
        # as a spike.
        step = np.linalg.norm(line[1] - line[0])
        bottom.plot(t[1:], np.diff(values_on_line) / step, lw=1, label=name)
    top.set_ylabel("value along the line")
    bottom.set_ylabel("difference quotient along the line")
    bottom.set_xlabel("t")
    top.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(FIGURE, dpi=110)
    print(f"wrote {FIGURE}")


if __name__ == "__main__":
    main()
