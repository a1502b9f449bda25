"""The GPU script runs, and its checks pass, at a small size on the CPU; the benchmark
tables are generated.

A device is lent for minutes at a time (`benchmarks/gpu.py` is prepared to run there
once): a script that fails there wastes the loan, so it is run here first.
"""

import os
import pathlib
import re
import subprocess
import sys


SCRIPT = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu.py"
SMALL = ["--n", "2e4", "--queries", "2e3", "--brute-queries", "1000"]
SMALL += ["--small-n", "1e4", "--series-n", "32", "--pairs-n", "1e4"]
SMALL += ["--local-n", "1e4", "--local-queries", "512"]


def test_gpu_script_runs_and_its_answers_agree():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL],
        # The suite's quicker-to-compile options: the script's answers are checked,
        # not its times, and its compile dominates.
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    # Every comparison the script makes: against brute force (three), the step caps'
    # answers against the chosen one's, the pair count against `count_neighbors` and
    # the local RBF's accuracy against scipy's.
    verdicts = re.findall(r"agrees?(?: with brute force| with scipy)?: (\w+)", output)
    assert verdicts == ["True"] * 6, output
    differences = re.findall(r"max rel diff ([0-9.e+-]+)", output)
    assert len(differences) == 1 and float(differences[0]) < 1e-10, output


def test_benchmark_tables_are_generated_from_the_records():
    """`benchmarks/README.md`'s table and the front page's headline are what
    `benchmarks/table.py` writes from `benchmarks/results.jsonl`."""
    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "table.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
