"""Every example runs at its small default size and prints what it claims: each
example's output is checked against the facts it reports (answers equal, the tree
unchanged by training, losses that fall, energy conserved)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from .helpers import environment_with_xla_defaults


EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _losses_fall(output: str) -> None:
    losses = [float(v) for v in re.findall(r"mean batch loss ([0-9.]+)", output)]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 5, losses


def _rms_below_target(output: str) -> None:
    rms, target = map(
        float,
        re.search(r"RMS error .*: ([0-9.]+) \(target RMS ([0-9.]+)\)", output).groups(),
    )  # type: ignore[union-attr]
    assert rms < target / 3


def _interpolated_field_reaches_target(output: str) -> None:
    medians = re.findall(
        r"interpolated \|f\(x\) - [0-9.]+\|.*median ([0-9.e+-]+)", output
    )
    assert medians and float(medians[0]) < 1e-2, output


def _wrong_scan_is_off(output: str) -> None:
    off = float(re.search(r"the scan is off by ([0-9.]+)", output).group(1))  # type: ignore[union-attr]
    assert off > 0.1  # the seed's scan differentiates a constant
    rows = {
        name: [float(v) for v in re.findall(r"-?[0-9]+\.[0-9]*", row)]
        for name, row in re.findall(
            r"^\s+(exact|OperatorSeries)\s+(\[.*\])", output, re.M
        )
    }
    assert len(rows["exact"]) == 8 and rows["exact"] == pytest.approx(
        rows["OperatorSeries"], abs=2e-4
    )


def _md_lost_no_step(output: str) -> None:
    done, requested = re.search(r"(\d+) of (\d+) steps done", output).groups()  # type: ignore[union-attr]
    assert done == requested, output
    reallocations = int(re.search(r"reallocations: (\d+)", output).group(1))  # type: ignore[union-attr]
    assert reallocations >= 1 and output.count("overflowed the list") == reallocations
    assert "steps kept with an overflowed list: 0" in output
    drift = float(re.search(r"largest relative drift ([0-9.e+-]+)", output).group(1))  # type: ignore[union-attr]
    assert drift < 1e-3, drift
    positions, velocities = map(
        float,
        re.search(
            r"positions differ by ([0-9.e+-]+), velocities by ([0-9.e+-]+)", output
        ).groups(),  # type: ignore[union-attr]
    )
    assert positions < 1e-9 and velocities < 1e-9, output


def _sparse_matrix_equal(output: str) -> None:
    got, want, difference = re.search(
        r"entries ([0-9,]+) \(scipy ([0-9,]+)\), largest difference ([0-9.e+-]+)",
        output,
    ).groups()  # type: ignore[union-attr]
    assert got == want and float(difference) < 1e-12, output


def _jraph_batch_of_eight_crystals(output: str) -> None:
    lists = dict(re.findall(r"(n_node|n_edge) \[([0-9, ]+)\]", output))
    n_node, n_edge = (
        [int(v) for v in lists[k].split(",")] for k in ("n_node", "n_edge")
    )
    assert len(n_node) == len(n_edge) == 9 and n_node[-1] == 1, output
    assert len(set(n_node[:-1])) > 1 and min(n_edge[:-1]) > 0, output


# What each example must print (regular expressions), and checks of its numbers.
EXPECTED = {
    "quickstart.py": (
        [r"built a tree over [0-9,]+ points", r"loaded tree answers the same: True"],
        [],
    ),
    "neural_field.py": (
        [r"tree unchanged by training: True", r"RMS error on a 128x128 grid"],
        [_losses_fall, _rms_below_target],
    ),
    "optimize_queries.py": (
        [r"interpolated \|f\(x\)", r"analytic \|f\(x\)"],
        [_interpolated_field_reaches_target],
    ),
    "crystals.py": (
        [
            r"8 crystals of \d+ to \d+ atoms .* one radius_graph call",
            r"edges equal a brute force over each crystal's images: True",
            r"n_node and n_edge equal each crystal's atoms and edges: True",
            r"stress \(8, 3, 3\) .* all finite: True",
        ],
        [_jraph_batch_of_eight_crystals],
    ),
    "lennard_jones.py": ([r"particles, \d+ steps .* relative drift"], []),
    "md_overflow.py": (
        [r"step \d+ overflowed the list", r"same run with capacity [0-9,]+"],
        [_md_lost_no_step],
    ),
    "scipy_port.py": (
        [
            r"query: indices equal: True",
            r"query_ball_point: lists equal: True",
            r"query_ball_point\(return_length=True\): equal: True",
            r"query_pairs: sets equal: True",
            r"count_neighbors: equal: True",
        ],
        [_sparse_matrix_equal],
    ),
    "message_passing.py": ([r"steps on batches of \d+ clouds: training loss"], []),
    "operator_series.py": (
        [r"X_2 at t = 1", r"OperatorSeries K = 100 in float32"],
        [_wrong_scan_is_off],
    ),
}


def test_every_example_is_checked():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


# These run with XLA's defaults, as users run them; the others with the suite's
# quicker-to-compile options, which halve their time (the same answers, checked).
AS_USERS_RUN_THEM = ("quickstart.py", "neural_field.py")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_prints_what_it_shows(name, tmp_path):
    extra = {"MPLBACKEND": "Agg", "KDEQX_FULL": ""}
    env = (
        environment_with_xla_defaults(**extra)
        if name in AS_USERS_RUN_THEM
        else {**os.environ, **extra}
    )
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout
    assert result.returncode == 0, output[-3000:] + result.stderr[-3000:]
    patterns, checks = EXPECTED[name]
    for pattern in patterns:
        assert re.search(pattern, output), (
            f"{name} did not print {pattern!r}:\n{output}"
        )
    for check in checks:
        check(output)
