"""Live progress of the long commands, on stderr: plain lines when not on a terminal (as
under pytest), a rich live display on one; stdout keeps the result (one JSON document
under ``--json``)."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from dcpsim.cli import main
from dcpsim.cli.progress import ProgressView, live_console

SECONDS = r"\(\d+\.\d\d s\)"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_view_prints_one_line_per_event():
    out = io.StringIO()
    with ProgressView("matrix", 2, stream=out) as view:
        view.done("a PASS (0.10 s)")
        view.waiting("waiting 5.0 s for 1 of 2 ranks: rank 1 at step 3 (write)")
        view.status("only on the live display")
        view.done("b FAIL (0.20 s): why", ok=False)
        view.note("a note")
    assert out.getvalue().splitlines() == [
        "[1/2] a PASS (0.10 s)",
        "dcpsim: waiting 5.0 s for 1 of 2 ranks: rank 1 at step 3 (write)",
        "[2/2] b FAIL (0.20 s): why",
        "a note",
    ]


def test_live_view_on_a_terminal_draws_a_bar_and_prints_each_run_above_it():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with ProgressView("selftest", 3, console=console) as view:
        view.done("first detected (0.10 s)")
        view.waiting("waiting 5.0 s for 2 of 2 ranks: ranks 0, 1 at step 12 (verify)")
        view.done("second FALSE POSITIVE (0.20 s)", ok=False)
        view.done("third pass (0.30 s)")
    text = out.getvalue()
    assert "\x1b[" in text and "━" in text, "a coloured bar"
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    for line in ("[1/3] first detected (0.10 s)\n", "[2/3] second FALSE POSITIVE (0.20 s)\n", "[3/3] third pass (0.30 s)\n"):
        assert line in plain
    assert "selftest" in plain and "3/3" in plain
    assert "ranks 0, 1 at step 12 (verify)" in plain, "the waiting message is the bar's status"
    assert "\x1b[1;31m[2/3] second FALSE POSITIVE" in text, "a bad run in bold red"


def test_the_live_display_needs_two_terminals_and_rich(monkeypatch):
    assert live_console(_Tty(), _Tty()) is not None
    assert live_console(io.StringIO(), _Tty()) is None, "stdout piped: plain lines"
    assert live_console(_Tty(), io.StringIO()) is None, "stderr piped: plain lines"
    monkeypatch.setitem(sys.modules, "rich.console", None)  # rich not installed
    assert live_console(_Tty(), _Tty()) is None


def test_matrix_prints_each_cell_as_it_ends_and_keeps_one_json_document(capsys):
    code = main(["matrix", "dsv3", "--dcp", "2", "--interleave", "1,16", "--in-process", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    cells = json.loads(captured.out)
    assert [c["cell"] for c in cells] == ["dsv3-dcp2-il1-bs64", "dsv3-dcp2-il16-bs64"]
    err = captured.err.splitlines()
    assert err[0] == "matrix: 2 cells, 2 to run, 0 skipped"
    assert re.fullmatch(rf"\[1/2\] dsv3-dcp2-il1-bs64 PASS {SECONDS}", err[1]), err
    assert re.fullmatch(rf"\[2/2\] dsv3-dcp2-il16-bs64 PASS {SECONDS}", err[2]), err
    printed = [float(re.search(r"\((\S+) s\)", line).group(1)) for line in err[1:3]]
    # the line shows 2 decimals, the JSON 3: both round the same measured time
    assert all(abs(p - c["seconds"]) <= 0.0051 for p, c in zip(printed, cells, strict=True)), (printed, cells)


def test_selftest_prints_each_run_as_it_ends(capsys):
    code = main(["selftest", "--in-process", "--fault", "interleave-off-by-one", "--scenario", "llama-draft", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    doc = json.loads(captured.out)
    lines = captured.err.splitlines()
    assert len(lines) == len(doc["rows"]) == 2
    assert re.fullmatch(rf"\[1/2\] interleave-off-by-one on llama-draft \(W=2 I=1\): detected \[wrong-content\] {SECONDS}", lines[0]), lines
    assert re.fullmatch(rf"\[2/2\] \(baseline\) on llama-draft \(W=2 I=1\): pass {SECONDS}", lines[1]), lines


@pytest.mark.slow
def test_fuzz_prints_each_example_then_each_smaller_failing_one(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DCPSIM_CACHE", str(tmp_path / "cache"))
    assert main(["fuzz", "--examples", "3", "--seed", "4"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line[:6] for line in lines] == ["[1/3] ", "[2/3] ", "[3/3] "], lines
    assert all(re.fullmatch(rf"\[\d/3\] fuzz-\S+ W=\d I=\d+ k=\d: \d+ requests?, \d+ tokens?: pass {SECONDS}", line) for line in lines), (
        lines
    )
    assert captured.out.startswith("fuzz: no failing schedule in 3 random examples")

    code = main(["fuzz", "--inject", "interleave-off-by-one", "--examples", "50", "--in-process", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    err = captured.err.splitlines()
    first_fail = next(k for k, line in enumerate(err) if line.endswith(")") and ": FAIL (" in line)
    assert err[first_fail + 1] == f"fuzz: example {first_fail + 1} fails; shrinking it"
    shrunk = [line for line in err if line.startswith("shrunk to fuzz-")]
    assert shrunk and ": 1 request, " in shrunk[-1], shrunk
    assert "FAIL at step" in captured.out
