"""The PCP flags: sizes refused with the rule (exit 2), ``layout --pcp``, the matrix axis."""

from __future__ import annotations

import json

import pytest

from dcpsim.campaigns import matrix as mx
from dcpsim.cli import main


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--pcp", "2", "--dcp", "3"],
            "decode_context_parallel_size 3 with prefill_context_parallel_size 2 and "
            "tensor_parallel_size 1: with PCP, DCP must be off (1), span the PCP axis (2) or "
            "span the whole TP x PCP grid (2); valid sizes are [1, 2]",
        ),
        (["--tp", "6", "--dcp", "4"], "tensor_parallel_size 6 must be divisible by decode_context_parallel_size 4"),
        (["--pcp", "0"], "prefill_context_parallel_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_sizes_are_a_usage_error_naming_the_file_and_the_rule(capsys, argv, message):
    assert main(["run", "dsv3", "--in-process", *argv]) == 2
    err = capsys.readouterr().err
    assert "dsv3.toml: " in err and message in err


def test_run_reports_the_grid(capsys):
    assert main(["run", "glm-pcp2-dcp2", "--in-process", "--tp", "2", "--dcp", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["prefill_context_parallel_size"], doc["tensor_parallel_size"], doc["dcp_size"]) == (2, 2, 4)
    assert [r["dcp_rank"] for r in doc["ranks"]] == [0, 2, 1, 3]  # tp_rank * pcp + pcp_rank


def test_layout_shows_which_pcp_rank_computes_each_position(capsys):
    assert main(["layout", "--dcp", "2", "--block-size", "8", "--positions", "0:20", "--pcp", "2", "--json"]) == 0
    pcp = json.loads(capsys.readouterr().out)["pcp"]
    assert pcp["chunks"] == {"0": [[0, 5], [15, 20]], "1": [[5, 10], [10, 15]]}
    assert pcp["computed_by"] == [0] * 5 + [1] * 10 + [0] * 5
    assert main(["layout", "--dcp", "2", "--block-size", "8", "--positions", "0:5", "--pcp", "2"]) == 0
    text = capsys.readouterr().out
    assert "not split: too short for 4 chunks of 2 with DCP on" in text and "    *****" in text
    assert main(["layout", "--dcp", "1", "--block-size", "8", "--positions", "0:8", "--pcp", "2", "--prefill-start", "2"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[-1] == "    ..001111"  # the row 2..7: 4 chunks of 2; rank 0: 2-3 (its chunk 3 is empty)
    assert "  pcp rank 0: 2..3" in text and "  pcp rank 1: 4..5, 6..7" in text


def test_the_matrix_has_a_pcp_axis():
    cells = mx.expand(["dsv3"], dcps=(1, 2, 3, 4), interleaves=("1",), pcps=(1, 2), dry_run=False)
    status = {c.cell.id: c.status for c in cells}
    assert status["dsv3-dcp3-il1-bs64-pcp2"] == "skipped" and status["dsv3-dcp3-il1-bs64-pcp1"] == "pending"
    four = next(c for c in cells if c.cell.id == "dsv3-dcp4-il1-bs64-pcp2")
    assert (four.scenario.config.tp_size, four.scenario.config.world_size) == (2, 4)
    assert [c.cell.group for c in cells if c.status == "pending"][-1] == "dsv3-dcp4-pcp2"
