"""The Qwen3-Next hybrid (replicated Gated DeltaNet states + sharded full attention) on real
gloo worlds: it passes at W = 2 and 4 in both Mamba cache modes, and each Mamba fault ends
in exit 1 with its failure kind."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["run", "qwen3-next-hybrid", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize("dcp", [2, 4])
def test_qwen3_next_passes_on_gloo(capsys, dcp, mode):
    code, report = run_json(capsys, "--dcp", str(dcp), "--interleave", "16", "--mamba-cache-mode", mode)
    assert code == 0, report["failure"]
    assert len(report["ranks"]) == dcp and report["verifications"] == report["steps"]
    state = next(g for g in report["engine"]["groups"] if g["name"].startswith("Mamba"))
    attention = next(g for g in report["engine"]["groups"] if g["name"].startswith("FullAttention"))
    assert not state["sharded"] and attention["sharded"]
    # never scaled by W: one block per request (none, 8192 tokens) or per 560 tokens (align)
    assert state["manager_block_size"] == (8192 if mode == "none" else 560)
    assert state["block_table_width"] == (3 if mode == "none" else 15 + 2)
    assert attention["manager_block_size"] == 560 * dcp
    sched = report["schedule"]
    assert sched["finished"] == sched["requests"] == 7 and sched["preemptions"] >= 2


@pytest.mark.parametrize(
    "fault,argv,kind",
    [
        ("mamba-block-size-scaled-by-w", ["--mamba-cache-mode", "align", "--block-size", "16"], "write-violation"),
        ("dcp-transform-on-replicated", [], "wrong-content"),
    ],
)
def test_mamba_faults_fail_on_gloo(capsys, fault, argv, kind):
    code, report = run_json(capsys, "--dcp", "2", "--inject", fault, *argv)
    assert code == 1 and report["failure"]["kind"] == kind
    assert report["failure"]["group"].startswith("Mamba[")
