"""An override nested hundreds deep (Hydra's grammar recurses once per bracket) is refused in
one line with exit 2 by every command that takes overrides, not a RecursionError traceback."""

from __future__ import annotations

import pytest

DEEP = "train.steps=" + "[" * 600 + "]" * 600


@pytest.mark.parametrize("command", [[], ["estimate"], ["fit", "--budget", "1G"],
                                     ["data", "show"], ["lengths"], ["-m"]])
def test_a_deeply_nested_override_is_one_line_and_exit_2(command, capsys):
    from memlab.cli.main import main

    assert main([*command, DEEP]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nested too deeply to parse (1212 characters)" in err
    assert "Traceback" not in err
