"""Every example runs, at its small default size, and exits cleanly."""

import os
import pathlib
import subprocess
import sys

import pytest

from .helpers import SUITE_XLA_FLAGS


EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "KDEQX_FULL": ""}
    if env.get("XLA_FLAGS") == SUITE_XLA_FLAGS:  # as users run them: XLA's defaults
        del env["XLA_FLAGS"]
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip(), "an example should print what it shows"
