"""``--trace``: the rank's recorder, the traced collectives, the merge into one file, the
path check; and a whole in-process run through ``run_jobs``."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dcpsim.errors import ConfigError
from dcpsim.harness.collectives import run_in_threads
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.trace import (
    NULL_RECORDER,
    TracedCollectives,
    TraceRecorder,
    describe_indices,
    group_tid,
    harness_tid,
    rank_pid,
)
from dcpsim.harness.trace_file import Trace, check_trace_path, merge_traces
from support.helpers import full_rep_spec, make_scenario, mla_spec, request_spec, trace_names, trace_problems


def test_spans_nest_and_carry_their_args():
    rec = TraceRecorder(1, time.monotonic_ns())
    with rec.span("outer", "step") as outer:
        with rec.span("inner", "verify", args={"a": 1}) as inner:
            inner.set(result="pass")
        outer.set(n=2)
    rec.instant("mark", "failure", args={"why": "x"})
    (thread_name, _sort), (inner_e, outer_e, mark) = rec.events[:2], rec.events[2:]
    assert thread_name == dict(name="thread_name", ph="M", pid=2, tid=2000, args={"name": "harness"})
    assert (inner_e["name"], inner_e["args"]) == ("inner", {"a": 1, "result": "pass"})
    assert (outer_e["name"], outer_e["args"]) == ("outer", {"n": 2})
    assert outer_e["ts"] <= inner_e["ts"] and inner_e["ts"] + inner_e["dur"] <= outer_e["ts"] + outer_e["dur"]
    assert mark["ph"] == "i" and mark["ts"] >= outer_e["ts"] + outer_e["dur"]
    assert {e["pid"] for e in rec.events} == {rank_pid(1)} and rec.open == []


def test_the_clock_is_the_machines_monotonic_clock_since_the_origin():
    origin = time.monotonic_ns() - 5_000_000_000  # the world started 5 s ago
    a, b = TraceRecorder(0, origin), TraceRecorder(1, origin)
    now = time.monotonic_ns() - origin
    # two recorders started apart agree with each other and with the monotonic clock
    assert abs(a.now() - now) < 50_000_000 and abs(b.now() - a.now()) < 50_000_000
    assert a.now() > 4_900_000_000


def test_the_null_recorder_records_and_computes_nothing():
    rec = NULL_RECORDER
    with rec.step(object()) as span:  # never looks at the plan
        span.set(result="pass")
        rec.complete("write", "write", 0, args={"x": 1})
        rec.failure(object())
        rec.counter("c", {"v": 1})
    assert rec.events == () and not rec.enabled and rec.write_observer([]) is None


def _gather_under_spans(payload, coll):
    rec = TraceRecorder(coll.rank, payload)
    traced = TracedCollectives(coll, rec)
    with rec.span("verify", "verify"):
        traced.all_gather_tensor(torch.zeros(3 + coll.rank, dtype=torch.int64))
    with rec.span("attention merge", "attention"):
        traced.all_to_all_tensor(torch.zeros((2, 4), dtype=torch.float32))
        traced.all_gather_object({"rank": coll.rank})
    return rec.events, traced.bytes_sent, coll.bytes_sent


def test_collectives_are_slices_with_their_bytes_and_phase():
    per_rank = run_in_threads(_gather_under_spans, time.monotonic_ns(), 2)
    for rank, (events, traced_bytes, inner_bytes) in enumerate(per_rank):
        calls = [e for e in events if e.get("cat") == "collective"]
        assert [(e["name"], e["args"]["phase"]) for e in calls] == [
            ("all_gather", "verify"),
            ("all_to_all", "attention merge"),
            ("all_gather_object", "attention merge"),
        ]
        assert calls[0]["args"]["bytes"] == 8 * (3 + rank) and calls[0]["args"]["shape"] == [3 + rank]
        assert calls[1]["args"]["bytes"] == 32 and calls[1]["args"]["dtype"] == "float32"
        assert sum(e["args"]["bytes"] for e in calls) == traced_bytes == inner_bytes
        counters = [e["args"]["sent"] for e in events if e["ph"] == "C"]
        assert counters[-1] == inner_bytes and counters == sorted(counters)


@pytest.mark.parametrize(
    "index,text",
    [
        ([], "none"),
        ([7], "7"),
        (range(0, 64), "0-63"),
        (range(1, 254, 4), "1-253 every 4"),
        ([0, 1, 2, 3, 8, 9, 10, 11], "0-3, 8-11"),
        ([k for start in range(0, 160, 16) for k in range(start, start + 4)] + [999], "0-3, 16-19, 32-35, 48-51, ..., 999 (11 runs)"),
    ],
)
def test_written_positions_in_short(index, text):
    assert describe_indices(index) == text


def _x(name, ts, dur, rank, tid_offset=0):
    return dict(name=name, cat="c", ph="X", ts=ts, dur=dur, pid=rank_pid(rank), tid=harness_tid(rank) + tid_offset)


def test_the_merge_names_every_rank_and_orders_the_events():
    recs = []
    for rank in range(2):
        rec = TraceRecorder(rank, 0)
        rec.name_thread(group_tid(rank, 0), "group 0: G", 1)
        rec.name_thread(group_tid(rank, 0), "group 0: G", 1)  # named again by a second job
        rec.events += [_x("inner", 6.0, 1.0, rank), _x("outer", 5.0, 9.0, rank), _x("write", 2.0, 1.0, rank, 1)]
        recs.append(rec.events)
    launcher = TraceRecorder(2, 0, thread="launcher")
    launcher.events.append(_x("gloo world of 2 ranks", 0.0, 20.0, 2))
    doc = merge_traces(recs, {"scenario": "s", "lse": float("-inf")}, launcher=launcher.events)
    events = doc["traceEvents"]
    assert trace_problems(doc) == []
    processes, threads = trace_names(doc)
    assert processes == {1: "rank 0", 2: "rank 1", 3: "launcher"}
    assert threads == {(1, 1000): "harness", (1, 1001): "group 0: G", (2, 2000): "harness", (2, 2001): "group 0: G", (3, 3000): "launcher"}
    kinds = [e["ph"] for e in events]
    assert kinds == sorted(kinds, key=lambda ph: ph != "M"), "metadata comes first"
    timed = [(e["name"], e["pid"]) for e in events if e["ph"] == "X"]
    assert timed == [("gloo world of 2 ranks", 3), ("write", 1), ("write", 2), ("outer", 1), ("outer", 2), ("inner", 1), ("inner", 2)]
    assert doc["otherData"] == {"scenario": "s", "lse": "-inf"}
    assert list(doc) == ["traceEvents", "otherData"], "Perfetto would read a displayTimeUnit as the unit of ts"
    json.dumps(doc, allow_nan=False)


def test_the_validator_catches_what_perfetto_would_drop():
    doc = merge_traces(
        [
            [
                _x("a", 0.0, 5.0, 0),
                _x("b", 3.0, 5.0, 0),
                _x("c", 1.0, -1.0, 0),
                dict(name="e", ph="i", ts=1.5, pid=1, tid=1000, args=[1]),
                dict(name="x", cat="c", ph="X", ts=1.0, dur=1.0, pid=1, tid=1007),
                _x("d", 3.0, 1.0, 0, 1),
                _x("d2", 3.0, 0.5, 0, 1),
            ]
        ]
    )
    doc["displayTimeUnit"] = "ms"
    problems = "\n".join(trace_problems(doc))
    assert "b at 3.0 overlaps a" in problems
    assert "(c): dur -1.0" in problems
    assert "(e): no ['cat', 's']" in problems
    assert "thread 1007 of 1 has no thread_name" in problems
    assert "(e): a list at the top level" in problems and "a displayTimeUnit" in problems
    assert "thread 1001 of 1: two slices start at the same ts" in problems


def test_a_bad_trace_path_is_a_config_error_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--trace .*: is a directory"):
        check_trace_path(str(tmp_path))
    plain = tmp_path / "plain.txt"
    plain.write_text("keep me")
    for bad in (plain / "trace.json", tmp_path / "no" / "such" / "dir" / "trace.json"):
        with pytest.raises(ConfigError, match=r"^--trace .*: cannot write the trace there"):
            check_trace_path(str(bad))
    good = tmp_path / "trace.json"
    assert check_trace_path(str(good)) == str(good) and not good.exists(), "the check leaves no file"
    assert check_trace_path(str(plain)) == str(plain) and plain.read_text() == "keep me"


def _small_scenario(W=2):
    layers = {f"l{i}.attn": mla_spec(B=16) for i in range(2)} | {"draft.attn": full_rep_spec(B=16)}
    requests = [request_spec("a", 40, 6), request_spec("b", 20, 4, arrival_step=1)]
    return make_scenario(layers, requests, W=W, I=4, budget=32)


@pytest.mark.parametrize("inject", [None, "interleave-off-by-one"])
def test_an_in_process_run_records_every_step_write_check_and_collective(tmp_path, inject):
    trace = Trace(str(tmp_path / "t.json"))
    (report,) = run_jobs([Job.from_options(_small_scenario(), inject=inject, in_process=True)], trace=trace)
    assert report.passed == (inject is None)
    trace.write({"scenario": "t"})
    doc = json.loads((tmp_path / "t.json").read_text())
    assert trace_problems(doc) == []
    events = doc["traceEvents"]
    processes, threads = trace_names(doc)
    assert processes == {1: "rank 0", 2: "rank 1", 3: "launcher"}
    for rank in range(2):
        mine = [e for e in events if e["pid"] == rank_pid(rank)]
        steps = [e for e in mine if e.get("cat") == "step"]
        assert [e["args"]["step"] for e in steps] == list(range(report.steps))
        assert len([e for e in mine if e["name"] == "verify"]) == report.verifications
        assert sum(e["args"]["bytes"] for e in mine if e.get("cat") == "collective") == report.ranks[rank]["bytes_sent"]
        groups = sorted({tid for pid, tid in threads if pid == rank_pid(rank)} - {harness_tid(rank)})
        assert groups == [group_tid(rank, g) for g in range(len(report.engine["groups"]))]
        for tid in groups:
            writes = [e for e in mine if e["tid"] == tid and e["ph"] != "M"]
            assert len(writes) == report.steps and all(e["name"] == "write" for e in writes)
    failures = [e for e in events if e["ph"] == "i"]
    if inject is None:
        assert failures == []
    else:
        (failure,) = failures
        assert failure["name"] == f"FAIL {report.failure.kind}" and failure["pid"] == rank_pid(0)
        assert failure["args"]["step"] == report.failure.step and failure["args"]["index"] == report.failure.index
        assert failure["args"]["report"][0].startswith("FAIL at step")


def test_write_slices_say_which_positions_each_rank_wrote():
    trace = Trace("unused")
    run_jobs([Job.from_options(_small_scenario(), in_process=True)], trace=trace)
    (rank0, rank1) = ([e for e in evs if e["ph"] == "X"] for evs in trace.per_rank)
    # step 0 writes a's first 32 prompt positions; I = 4 on W = 2 ranks
    sharded = {r: next(e for e in evs if e["tid"] == group_tid(r, 0) and e["args"]["step"] == 0) for r, evs in enumerate((rank0, rank1))}
    assert [sharded[r]["args"]["writes"] for r in range(2)] == [
        [{"request": "a", "slots": 16, "positions": "0-3, 8-11, 16-19, 24-27"}],
        [{"request": "a", "slots": 16, "positions": "4-7, 12-15, 20-23, 28-31"}],
    ]
    replicated = next(e for e in rank1 if e["tid"] == group_tid(1, 1) and e["args"]["step"] == 0)
    assert replicated["args"]["writes"] == [{"request": "a", "slots": 32, "positions": "0-31"}]
    assert replicated["args"]["slots_written"] == 32 and replicated["args"]["requests"] == ["a"]


def test_ranks_that_disagree_are_the_launchers_failure_event(tmp_path, monkeypatch):
    import dcpsim.harness.runner as batch
    from dcpsim.verify.report import Failure, FailureKind

    def disagree(reports):
        merged = reports[0]
        merged.passed, merged.failure = False, Failure(kind=FailureKind.RANKS_DISAGREE, step=3, message="differ")
        return merged

    monkeypatch.setattr(batch, "merge_rank_reports", disagree)
    trace = Trace(str(tmp_path / "t.json"))
    run_jobs([Job.from_options(_small_scenario(), in_process=True)], trace=trace)
    trace.write()
    doc = json.loads((tmp_path / "t.json").read_text())
    assert trace_problems(doc) == []
    (event,) = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert event["name"] == "FAIL ranks-disagree" and event["pid"] == rank_pid(2) and event["args"]["step"] == 3
    assert trace_names(doc)[0][event["pid"]] == "launcher"
