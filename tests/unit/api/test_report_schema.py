"""docs/report.schema.json describes every report document the commands write: validated
against the documents of run (passing, failing, with attention), replay, matrix (a shard),
merge --json-out, selftest, the error document, and ``dcpsim.Report.to_json()``; P/D reports
in tests/dist/test_api_gloo.py (they need gloo). Broken documents fail it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

import dcpsim
from dcpsim.report_file import SCHEMA_VERSION

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "docs" / "report.schema.json"


def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate(doc) -> None:
    jsonschema.Draft202012Validator(schema()).validate(doc)


def test_the_schema_is_a_valid_json_schema_of_the_current_version():
    jsonschema.Draft202012Validator.check_schema(schema())
    assert schema()["$defs"]["schema_version"]["const"] == SCHEMA_VERSION


def test_the_schema_names_every_failure_kind():
    from dcpsim.verify.report import FailureKind

    def enums(node):
        if isinstance(node, dict):
            if "engine-error" in node.get("enum", ()):
                yield node["enum"]
            for value in node.values():
                yield from enums(value)
        elif isinstance(node, list):
            for value in node:
                yield from enums(value)

    found = list(enums(schema()))
    assert found and all(set(e) == {k.value for k in FailureKind} for e in found), found


@pytest.mark.slow
def test_run_and_replay_reports_follow_the_schema(run_json, tmp_path):
    docs = []
    runs = (
        (),
        ("--inject", "interleave-off-by-one", "--interleave", "4"),
        ("--attention",),
        ("--inject", "lse-base-mismatch", "--attention", "--lse-base", "2"),
    )
    for extra in runs:
        code, doc = run_json("run", "dsv3", "--dcp", "2", "--in-process", *extra)
        assert code in (0, 1)
        validate(doc)
        docs.append(doc)
    assert [d["passed"] for d in docs] == [True, False, True, False]
    assert docs[3]["failure"]["kind"] == "attention-mismatch" and docs[2]["attention_checks"] > 0
    path = tmp_path / "failed.json"
    path.write_text(json.dumps(docs[1]), encoding="utf-8")
    code, replayed = run_json("replay", str(path), "--in-process")
    assert code == 1
    validate(replayed)
    validate(dcpsim.run("llama-gqa", dcp=2, in_process=True).to_dict())


@pytest.mark.slow
def test_matrix_merge_and_selftest_documents_follow_the_schema(run_json, tmp_path, capsys):
    shards = []
    for k in (1, 2):
        code, cells = run_json("matrix", "llama-gqa", "--dcp", "1,2", "--interleave", "1,B", "--shard", f"{k}/2", "--in-process")
        assert code == 0
        validate(cells)
        path = tmp_path / f"shard{k}.json"
        path.write_text(json.dumps(cells), encoding="utf-8")
        shards.append(str(path))
    merged = tmp_path / "merged.json"
    assert dcpsim_main(["merge", *shards, "--json-out", str(merged)]) == 0
    assert "merged 2 shards" in capsys.readouterr().out
    validate(json.loads(merged.read_text(encoding="utf-8")))
    code, doc = run_json("selftest", "--fault", "interleave-off-by-one", "--scenario", "dsv3", "--in-process")
    assert code == 0
    validate(doc)


def dcpsim_main(argv: list[str]) -> int:
    from dcpsim.cli import main

    return main(argv)


def test_error_documents_follow_the_schema(run_json):
    code, doc = run_json("run", "no-such-scenario")
    assert code == 2
    validate(doc)


@pytest.mark.parametrize(
    "path, value",
    [
        (("passed",), "yes"),
        (("schema_version",), 2),
        (("failure", "kind"), "wrong-position"),
        (("failure", "holdings", 0, "rank"), -1),
        (("dcp_size",), 0),
        (("verify_mode",), "sometimes"),
    ],
)
def test_a_broken_report_fails_the_schema(path, value):
    doc = json.loads(FAILED_REPORT)
    broken = copy.deepcopy(doc)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    validate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


FAILED_REPORT = json.dumps(
    {
        "schema_version": 1, "scenario": "s", "source": "s.toml", "dcp_size": 2, "interleave_size": 1, "kernel_block_size": None,
        "groups": [{"name": "g", "layers": 1, "storage": "paged", "block_size": 16, "states_per_page": 16, "sharded": True}],
        "passed": False, "steps": 1, "verifications": 1, "verified_indices": 4, "verify_mode": "incremental", "schedule": {"steps": 1},
        "failure": {"kind": "wrong-content", "step": 0, "message": "m", "index": 0, "expected_owner": 0, "expected_slot": 16,
                    "holdings": [{"rank": 0, "slot": 16, "index": 1, "writer": "r", "step": 0}]},
        "ranks": [{"rank": 0, "peak_rss_mb": 1.0, "kv_store_mb": 0.1}],
    }
)  # fmt: skip
"""A small failing run report that follows the schema (each broken copy changes one field)."""
