"""The demo of the README's first command, at a small size."""

import kdeqx.__main__ as demo


def test_demo_runs_and_matches_scipy(capsys):
    assert demo.main(["--n", "3000", "--queries", "700", "--k", "4"]) == 0
    out = capsys.readouterr().out
    assert "distances match scipy: True" in out
