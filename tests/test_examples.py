"""Every example runs, at its small default size, and exits cleanly."""

import pathlib
import subprocess
import sys

import pytest

from .helpers import environment_with_xla_defaults


EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environment_with_xla_defaults(MPLBACKEND="Agg", KDEQX_FULL=""),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip(), "an example should print what it shows"
