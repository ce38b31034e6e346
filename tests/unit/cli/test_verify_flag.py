"""``--verify {incremental,full}`` on run, matrix and replay: the mode reaches the checker and
the report says which it was and how many full sweeps it made."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main
from dcpsim.harness.job import Job
from dcpsim.harness.replay import replay_record
from support.helpers import builtin, run_json


@pytest.mark.parametrize("mode", ["incremental", "full"])
def test_run_reports_its_mode_and_full_sweeps(capsys, mode):
    code, doc = run_json(capsys, "run", "llama-draft", "--dcp", "2", "--in-process", "--verify", mode)
    assert code == 0 and doc["verify_mode"] == mode
    if mode == "full":
        assert doc["full_sweeps"] == doc["verifications"] == doc["steps"]
    else:
        assert 1 <= doc["full_sweeps"] < doc["verifications"]
    assert doc["replay"]["options"]["verify"] == mode


def test_incremental_reads_fewer_indices_and_says_so_in_the_text(capsys):
    assert main(["run", "llama-draft", "--dcp", "2", "--in-process", "--verify", "full"]) == 0
    full = capsys.readouterr().out
    assert main(["run", "llama-draft", "--dcp", "2", "--in-process"]) == 0
    incremental = capsys.readouterr().out

    def indices(text):
        line = next(x for x in text.splitlines() if x.strip().startswith("verified:"))
        return int(line.split(",")[1].split()[0])

    assert "--verify full (" in full and "--verify incremental (" in incremental
    assert indices(incremental) < indices(full)


def test_a_bad_mode_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "llama-draft", "--verify", "sometimes"])
    assert exc.value.code == 2 and "--verify" in capsys.readouterr().err


def test_replay_keeps_the_recorded_mode_unless_told(tmp_path, capsys):
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"replay": replay_record(Job.from_options(builtin("llama-draft", 2), verify="full"))}))
    code, doc = run_json(capsys, "replay", str(report), "--in-process")
    assert code == 0 and doc["verify_mode"] == "full"
    code, doc = run_json(capsys, "replay", str(report), "--in-process", "--verify", "incremental")
    assert code == 0 and doc["verify_mode"] == "incremental"


def test_matrix_takes_the_flag(capsys):
    assert main(["matrix", "llama-draft", "--dcp", "2", "--interleave", "1", "--in-process", "--json", "--verify", "full"]) == 0
    (cell,) = json.loads(capsys.readouterr().out)
    assert cell["report"]["verify_mode"] == "full"
    assert cell["report"]["full_sweeps"] == cell["report"]["verifications"]


def test_a_replay_with_an_unknown_mode_is_exit_2(tmp_path, capsys):
    record = replay_record(Job.from_options(builtin("llama-draft", 2)))
    record["options"]["verify"] = "sometimes"
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"replay": record}))
    assert main(["replay", str(report)]) == 2
    assert "verify must be one of incremental, full" in capsys.readouterr().err
