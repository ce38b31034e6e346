"""``dcpsim run --trace FILE`` on real gloo worlds (and threads): the file's structure, its
tracks, and event counts and bytes that agree with the run's report."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from dcpsim.harness.trace import group_tid, harness_tid, rank_pid
from support.helpers import run_json, trace_names, trace_problems

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def traced_run(capsys, tmp_path, *argv) -> tuple[int, dict, dict]:
    path = tmp_path / "trace.json"
    code, report = run_json(capsys, "run", *argv, "--trace", str(path))
    return code, report, json.loads(path.read_text())


def by_rank(doc, world: int, **match) -> list[list[dict]]:
    """Each rank's events (not metadata) whose fields equal ``match``."""
    out = [[] for _ in range(world)]
    for e in doc["traceEvents"]:
        if e["ph"] != "M" and e["pid"] <= world and all(e.get(k) == v for k, v in match.items()):
            out[e["pid"] - 1].append(e)
    return out


@pytest.mark.parametrize("mode", ["gloo", "in-process"])
def test_a_passing_run_traces_every_step_write_check_and_collective(capsys, tmp_path, mode):
    W = 3
    code, report, doc = traced_run(
        capsys, tmp_path, "dsv41-hybrid", "--dcp", str(W), "--interleave", "16", *(["--in-process"] if mode == "in-process" else [])
    )
    assert code == 0, report["failure"]
    assert trace_problems(doc) == []
    processes, threads = trace_names(doc)
    assert processes == {rank_pid(r): f"rank {r}" for r in range(W)} | {rank_pid(W): "launcher"}
    groups = report["engine"]["groups"]
    for rank in range(W):
        assert threads[(rank_pid(rank), harness_tid(rank))] == "harness"
        for g, group in enumerate(groups):
            assert threads[(rank_pid(rank), group_tid(rank, g))].startswith(f"group {g}: {group['name']} (")

    steps = by_rank(doc, W, cat="step")
    for rank in range(W):
        assert [e["args"]["step"] for e in steps[rank]] == list(range(report["steps"]))
    assert [len(v) for v in by_rank(doc, W, name="verify")] == [report["verifications"]] * W
    assert not any(by_rank(doc, W, ph="i")), "a passing run has no failure event"

    # bytes: every collective of a rank adds up to what the report says it sent
    collectives = by_rank(doc, W, cat="collective")
    for rank in range(W):
        assert sum(e["args"]["bytes"] for e in collectives[rank]) == report["ranks"][rank]["bytes_sent"]
    assert sum(e["args"]["bytes"] for e in collectives[0] if e["args"]["phase"] == "verify") == report["bytes_gathered"]
    assert {(e["name"], e["args"]["phase"]) for e in collectives[0]} == {("all_gather", "verify")}

    # one clock: no rank leaves a collective before every rank has entered it
    for calls in zip(*collectives):
        assert max(e["ts"] for e in calls) <= min(e["ts"] + e["dur"] for e in calls) + 1000, calls

    # writes: one slice per group and step; a paged sharded group's positions are split
    # across the ranks, a paged replicated group's are written on every rank
    tokens = {e["args"]["step"]: e["args"]["tokens"] for e in steps[0]}
    for g in range(len(groups)):
        slots = defaultdict(list)
        for rank in range(W):
            writes = [e for e in by_rank(doc, W, tid=group_tid(rank, g))[rank]]
            assert [e["args"]["step"] for e in writes] == list(range(report["steps"]))
            for e in writes:
                assert e["args"]["slots_written"] == sum(w["slots"] for w in e["args"]["writes"])
                slots[e["args"]["step"]].append(e["args"]["slots_written"])
        name = threads[(rank_pid(0), group_tid(0, g))]
        if "(paged, sharded)" in name:
            assert all(sum(per_rank) == tokens[step] for step, per_rank in slots.items()), name
        elif "(paged, replicated)" in name:
            assert all(per_rank == [tokens[step]] * W for step, per_rank in slots.items()), name


def test_an_injected_bug_gives_exactly_one_failure_event_with_the_reports_details(capsys, tmp_path):
    code, report, doc = traced_run(capsys, tmp_path, "dsv41-hybrid", "--dcp", "2", "--inject", "interleave-off-by-one")
    assert code == 1
    assert trace_problems(doc) == []
    failures = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert len(failures) == 1
    (event,) = failures
    failure = report["failure"]
    assert event["name"] == f"FAIL {failure['kind']}" and event["cat"] == "failure"
    assert event["pid"] == rank_pid(0) and event["tid"] == harness_tid(0)
    for key in ("kind", "step", "group", "request_id", "index", "expected_owner", "expected_slot", "further_bad"):
        assert event["args"][key] == failure[key], key
    steps = by_rank(doc, 2, cat="step")
    assert [len(s) for s in steps] == [report["steps"]] * 2
    (verify,) = by_rank(doc, 2, name="verify")[0]
    assert verify["args"]["result"] == failure["kind"]
    assert verify["ts"] + verify["dur"] <= event["ts"]


def test_attention_merges_are_traced_with_their_bytes(capsys, tmp_path):
    code, report, doc = traced_run(capsys, tmp_path, "llama-draft", "--dcp", "2", "--attention")
    assert code == 0, report["failure"]
    assert trace_problems(doc) == []
    for rank, calls in enumerate(by_rank(doc, 2, cat="collective")):
        phases = defaultdict(int)
        for e in calls:
            phases[e["args"]["phase"]] += e["args"]["bytes"]
        assert set(phases) == {"verify", "attention merge", "attention check"}
        assert phases["attention merge"] + phases["attention check"] == report["attention_bytes"]
        assert sum(phases.values()) == report["ranks"][rank]["bytes_sent"]
        merges = {e["name"] for e in calls if e["args"]["phase"] == "attention merge"}
        assert merges == {"all_gather", "reduce_scatter", "all_to_all"}  # alternate: both variants
    assert [len(v) for v in by_rank(doc, 2, name="attention check")] == [report["steps"]] * 2
    assert [len(v) for v in by_rank(doc, 2, name="attention compute")] == [report["steps"]] * 2
