"""``dcpsim run --attention`` on real gloo worlds: the merge collectives over gloo
(all-gather, reduce-scatter, all-to-all), verdicts and exit codes."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["run", *argv, "--attention", "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.parametrize(
    "scenario,argv,variants",
    [
        ("dsv41-hybrid", ["--dcp", "4"], ("allgather", "alltoall")),
        ("dsv3", ["--dcp", "3", "--interleave", "16", "--lse-base", "2", "--attention-merge", "alltoall"], ("alltoall",)),
        ("dsv3", ["--dcp", "2", "--attention-merge", "allgather", "--attention-heads", "6"], ("allgather",)),
    ],
)
def test_attention_passes_over_gloo(capsys, scenario, argv, variants):
    code, report = run_json(capsys, scenario, *argv)
    assert code == 0, report["failure"]
    assert report["passed"] and report["failure"] is None
    assert report["attention_checks"] > 100
    assert 0 < report["attention_max_error"] < 1e-5
    for v in ("allgather", "alltoall"):
        assert (report["attention_merges"][v] > 0) == (v in variants)
    assert report["attention_bytes"] > 0
    assert report["replay"]["options"]["attention"] is True


@pytest.mark.parametrize(
    "scenario,fault,argv",
    [
        ("dsv41-hybrid", "empty-shard-lse-zero", ["--dcp", "2"]),
        ("dsv3", "empty-shard-lse-zero", ["--dcp", "4", "--interleave", "16", "--attention-merge", "alltoall"]),
        ("dsv3", "multi-token-local-lens", ["--dcp", "2", "--interleave", "16"]),
    ],
)
def test_attention_faults_exit_1(capsys, scenario, fault, argv):
    code, report = run_json(capsys, scenario, *argv, "--inject", fault)
    assert code == 1
    assert not report["passed"]
    failure = report["failure"]
    assert failure["kind"] == "attention-mismatch"
    assert failure["step"] == 0 and failure["request_id"] == "chat-0"
    assert failure["query_position"] is not None and failure["head"] is not None
    W = report["dcp_size"]
    assert [c["rank"] for c in failure["contributions"]] == list(range(W))
    if fault == "empty-shard-lse-zero":
        assert any(c["keys"] == 0 and c["lse"] == 0.0 for c in failure["contributions"])
