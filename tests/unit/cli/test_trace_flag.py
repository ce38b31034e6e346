"""``run --trace FILE`` with a path it cannot write: exit 2, the flag named, no rank started."""

from __future__ import annotations

import json

import pytest

import dcpsim.harness.runner
from dcpsim.cli import main
from dcpsim.harness.job import Job
from dcpsim.harness.replay import replay_record
from support.helpers import builtin


@pytest.fixture
def no_world(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a world was started")

    monkeypatch.setattr(dcpsim.harness.runner, "run_jobs", refuse)


@pytest.mark.parametrize(
    "where,message",
    [
        (".", "is a directory; give a file name, such as"),
        ("plain.txt/trace.json", "cannot write the trace there (Not a directory)"),
        ("missing/trace.json", "cannot write the trace there (No such file or directory)"),
    ],
)
def test_a_bad_trace_path_is_exit_2_before_any_rank_starts(tmp_path, capsys, no_world, where, message):
    (tmp_path / "plain.txt").write_text("x")
    path = tmp_path / where
    assert main(["run", "llama-draft", "--dcp", "2", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dcpsim: error: --trace {path}: ") and message in err


def test_under_json_the_error_is_one_json_document(tmp_path, capsys, no_world):
    assert main(["run", "llama-draft", "--trace", str(tmp_path), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 2 and doc["error"]["message"].startswith(f"--trace {tmp_path}: is a directory")


def test_replay_takes_the_flag_too(tmp_path, capsys, no_world):
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"replay": replay_record(Job.from_options(builtin("llama-draft", 2)))}))
    assert main(["replay", str(report), "--trace", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"dcpsim: error: --trace {tmp_path}: is a directory")
