"""``python -m dcpsim --help``: plain text (no reStructuredText markup) that lists the exit codes."""

from __future__ import annotations

import re

import pytest

from dcpsim.cli import main


def test_top_level_help_is_plain_text_with_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out
    codes = out[out.index("\nexit codes:\n") :].splitlines()[2:6]
    assert [re.match(r"  (\d)  \S", line).group(1) for line in codes] == ["0", "1", "2", "3"], codes
    assert "harness failure" in codes[3]
