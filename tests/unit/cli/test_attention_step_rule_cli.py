"""``--attention-max-step-keys``: the attention check's step rule from the command line, in the
report and in its replay record; a bad value is exit 2 before any rank starts."""

from __future__ import annotations

import json

from dcpsim.cli import main
from dcpsim.harness.replay import job_from_record


def test_a_small_step_budget_skips_checks_and_replays_with_the_same_rule(run_json, tmp_path):
    code, doc = run_json("run", "dsv3", "--dcp", "2", "--attention", "--attention-max-step-keys", "64", "--in-process")
    assert code == 0 and doc["passed"]
    assert doc["attention"]["max_step_keys"] == 64
    assert doc["attention_skipped_checks"] > 0 and doc["attention_checks"] > 0
    assert doc["attention_checked_steps"] < doc["steps"]
    assert job_from_record(doc["replay"], "r").attention.max_step_keys == 64
    code, full = run_json("run", "dsv3", "--dcp", "2", "--attention", "--in-process")
    assert code == 0 and full["attention_skipped_checks"] == 0, "the default checks every step of dsv3"
    assert full["attention_checks"] == doc["attention_checks"] + doc["attention_skipped_checks"]


def test_a_step_budget_below_one_is_exit_2(capsys):
    assert main(["run", "dsv3", "--dcp", "2", "--attention", "--attention-max-step-keys", "0", "--json"]) == 2
    captured = capsys.readouterr()
    assert "attention_max_step_keys must be an integer >= 1, got 0" in captured.err
    assert json.loads(captured.out)["exit_code"] == 2
