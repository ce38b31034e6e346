"""``dsv32-sparse`` with ``--attention`` on real gloo worlds (semantics section 14): the
indexer's keys gathered over gloo, every rank's top-k agreeing with the checker's, and the
merged sparse attention equal to the float64 reference over the selected keys."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DEADLINE = 1200
"""Seconds: a run takes 6-7 s of CPU a rank at W = 2, but 80-120 s of wall time on a 2-core
machine at a load average of 20 (the default deadline of 90 s kills it there)."""


@pytest.mark.parametrize("W", [2, 4])
def test_dsv32_sparse_passes_with_attention(capsys, W):
    code = main(["run", "dsv32-sparse", "--dcp", str(W), "--attention", "--json", "--deadline", str(DEADLINE)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["failure"]
    assert report["attention_checks"] > 40
    assert 0 < report["attention_max_error"] < 1e-5
    assert report["engine"]["decisions"]["select_topk"] == "reference"


def test_a_replicated_indexer_passes_too(capsys, tmp_path):
    """SGLang's choice, the indexer-K cache replicated (``dcp_replicated = true``)."""
    from dcpsim.scenarios.registry import builtin_scenario_path

    text = builtin_scenario_path("dsv32-sparse").read_text()
    text = text.replace("index_n_heads = 64\n", "index_n_heads = 64\ndcp_replicated = true\n")
    text = text.replace('name = "dsv32-sparse"', 'name = "dsv32-sparse-replicated-indexer"')
    path = tmp_path / "sparse.toml"
    path.write_text(text)
    code = main(["run", str(path), "--dcp", "2", "--attention", "--json", "--deadline", str(DEADLINE)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["failure"]
    assert "Indexer" in json.dumps(report) and report["attention_checks"] > 40
