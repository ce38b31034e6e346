"""Partial-block prefix-cache hits (built-in ``prefix-partial-hit``) on real gloo worlds: the
reference passes; ``partial-hit-stale-cow`` (bug class 54, vllm#51705) copies a partial hit's
source block found at an earlier admission attempt, rewritten by another request since, and
fails with wrong content at the admission that copies it."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.mark.parametrize("W", [2, 4])
def test_partial_hits_pass_and_a_stale_copy_fails_on_gloo(capsys, W):
    code = main(["run", "prefix-partial-hit", "--dcp", str(W), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report.get("failure")
    code = main(["run", "prefix-partial-hit", "--dcp", str(W), "--inject", "partial-hit-stale-cow", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and not report["passed"]
    f = report["failure"]
    assert (f["kind"], f["step"], f["request_id"]) == ("wrong-content", 7, "doc-b")
