"""The fault catalogue and the selftest logic, in one process (ranks as threads).

Three layers:

* each fault's engine hook does what its bug class says, checked directly
  (prefix-cache hit lengths, kernel-coordinate slots, block-table widths,
  engine layouts, released blocks, ring slots), with the correct engine
  beside it;
* each fault is detected on its scenario with the expected failure kind, and
  the same scenario and config passes without the fault;
* the selftest plan, verdict and table, including the ways it must fail (a
  fault that changes nothing is "missed", a broken baseline is a false
  positive, an unknown run option is an error).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcpsim.cli import main
from dcpsim.faults import FAULTS, Fault, _kernel_coordinate_slots, get_fault
from dcpsim.group_layout import RING, WINDOW
from dcpsim.layout import PAD, slot_mapping
from dcpsim.runtime.collectives import run_in_threads
from dcpsim.scenario_file import load_scenario
from dcpsim.scheduler.scheduler import Scheduler
from dcpsim.selftest import (
    BASELINE,
    DETECTED,
    ERROR,
    FALSE_POSITIVE,
    MISSED,
    NOT_APPLICABLE,
    PASS,
    Row,
    UnknownOption,
    apply_options,
    canonical_options,
    config_text,
    fault_status,
    format_table,
    plan_selftest,
    run_plan,
    verdict,
)
from dcpsim.simulation import Job, build_layouts, merge_rank_reports, prepare, run_rank
from dcpsim.specs import cdiv

MINE = [
    "interleave-off-by-one",
    "replicated-owner-only",
    "foreign-block",
    "prefix-hash-unit-B",
    "kernel-virtual-block",
    "replicated-scaled-by-w",
    "merge-drops-dcp-replicated",
    "sliding-window-early-release",
    "ring-rejected-overwrite",
]
SMALL = ["dsv3", "dsv41-hybrid", "llama-draft"]


def scenario(name, **options):
    sc, job = apply_options(load_scenario(name), options)
    assert not job
    return sc


def run(sc, fault=None):
    prepare(sc)
    reports = run_in_threads(run_rank, Job(sc, inject=fault), sc.config.decode_context_parallel_size)
    return merge_rank_reports(reports)


def admissions(sc, fault=None) -> dict[str, int]:
    """request id -> prefix-cache hit (tokens) at its first admission with a hit."""
    sched = Scheduler(sc, build_layouts(sc), fault)
    hits: dict[str, int] = {}
    for plan in sched.plans():
        for e in plan.events:
            if "prefix-cache hit of" in e:
                rid = e.split()[1]
                hits.setdefault(rid, int(e.split("hit of ")[1].split()[0]))
    return hits


# ----------------------------------------------------------------------------- registry


def test_every_fault_is_registered_with_a_bug_class_and_description():
    for name in MINE:
        fault = FAULTS[name]
        assert fault.name == name and get_fault(name) is fault
        assert fault.description and fault.bug_class, name
    numbered = {FAULTS[n].bug_class.split(".")[0] for n in MINE if FAULTS[n].bug_class[0].isdigit()}
    assert {"1", "2", "5", "6", "7", "8", "9", "10"} <= numbered


def test_base_fault_is_the_correct_engine():
    sc = scenario("llama-draft", decode_context_parallel_size=4)
    layouts = build_layouts(sc)
    base = Fault()
    assert base.engine_layouts(sc, layouts) is layouts
    for lay in layouts:
        assert base.block_table_width(lay, sc.config) == lay.group_spec.max_num_blocks_per_req(sc.config, sc.config.max_model_len)
        assert base.num_released_blocks(lay, 1000) == 1000 // lay.manager_block_size


# ----------------------------------------------------------------------------- hooks, one by one


def test_prefix_hash_unit_b_hits_past_the_true_common_prefix():
    # llama-draft: B=32, W=2, hash unit 64; the requests share a 420-token prefix.
    sc = scenario("llama-draft")
    good = admissions(sc)
    bad = admissions(sc, FAULTS["prefix-hash-unit-B"])
    assert good["chat-1"] == 384 and good["late-0"] == 384  # 6 whole units of 64 <= 420
    # keyed by the fingerprint at (u+1)*32-1, unit u matches while (u+1)*32 <= 420, i.e. u <= 12;
    # chat-1 (700 tokens) may hit up to (700-1)//64 = 10 units, but chat-0 has 8 registered then
    assert bad["chat-1"] > 420 and bad["chat-1"] % 64 == 0
    assert bad["late-0"] > 420


def test_prefix_hash_unit_b_is_harmless_without_dcp():
    sc = scenario("llama-draft", decode_context_parallel_size=1)
    assert admissions(sc) == admissions(sc, FAULTS["prefix-hash-unit-B"])
    assert not FAULTS["prefix-hash-unit-B"].applies_to(build_layouts(sc))


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("I", [1, 2, 4, 8, 16])
def test_kernel_virtual_block_equals_the_truth_when_interleave_divides_bk(W, I):
    B, Bk = 64, 16
    row = np.array([3, 9, 5], dtype=np.int64)
    pos = np.arange(len(row) * B * W)
    for r in range(W):
        truth = slot_mapping(pos, row, block_size=B, dcp_size=W, dcp_rank=r, interleave_size=I, kernel_block_size=Bk)
        bug = _kernel_coordinate_slots(pos, row, page=B, kernel=Bk, dcp_size=W, rank=r, interleave=I)
        np.testing.assert_array_equal(bug, truth)


def test_kernel_virtual_block_with_interleave_above_bk_starves_ranks_and_collides():
    B, Bk, W, I = 64, 16, 2, 64
    row = np.array([3, 9, 5], dtype=np.int64)
    pos = np.arange(len(row) * B * W)
    rank0 = _kernel_coordinate_slots(pos, row, page=B, kernel=Bk, dcp_size=W, rank=0, interleave=I)
    rank1 = _kernel_coordinate_slots(pos, row, page=B, kernel=Bk, dcp_size=W, rank=1, interleave=I)
    assert (rank1 == PAD).all()  # "some ranks store nothing"
    assert (rank0 != PAD).all() and len(np.unique(rank0)) < len(rank0)  # "slots collide"


def test_replicated_scaled_by_w_narrows_only_replicated_tables():
    sc = scenario("llama-draft", decode_context_parallel_size=4)
    fault = FAULTS["replicated-scaled-by-w"]
    widths = {lay.sharded: (fault.block_table_width(lay, sc.config), Fault().block_table_width(lay, sc.config))
              for lay in build_layouts(sc)}
    assert widths[True] == (cdiv(4096, 32 * 4),) * 2  # sharded: unchanged
    assert widths[False] == (cdiv(4096, 32 * 4), cdiv(4096, 32))  # replicated draft: 32 instead of 128


def test_merge_drops_dcp_replicated_makes_the_draft_group_sharded_silently():
    fault = FAULTS["merge-drops-dcp-replicated"]
    sc = scenario("llama-draft")
    truth = build_layouts(sc)
    engine = fault.engine_layouts(sc, truth)  # no error: the bug is silent
    assert [lay.name for lay in engine] == [lay.name for lay in truth]
    draft = [k for k, lay in enumerate(truth) if "draft" in lay.name]
    assert len(draft) == 1
    d = draft[0]
    assert truth[d].replicated and engine[d].sharded
    assert (truth[d].manager_block_size, engine[d].manager_block_size) == (32, 64)
    other = 1 - d
    assert engine[other] == truth[other]
    # a replicated sliding window is not touched (dropping the flag there would be refused loudly)
    hybrid = scenario("dsv41-hybrid")
    lays = build_layouts(hybrid)
    assert not fault.applies_to(lays)
    assert [lay.sharded for lay in fault.engine_layouts(hybrid, lays)] == [lay.sharded for lay in lays]


def test_sliding_window_early_release_frees_one_block_still_in_the_window():
    fault = FAULTS["sliding-window-early-release"]
    lays = build_layouts(scenario("dsv41-hybrid"))
    swa = next(lay for lay in lays if lay.retention == WINDOW)
    span = swa.manager_block_size  # 64 (replicated)
    first = 300 - 128 + 1  # 173 after 300 committed tokens with a 128-token window
    assert Fault().num_released_blocks(swa, first) == first // span == 2
    assert fault.num_released_blocks(swa, first) == 3  # block 2 holds 173..191, still needed
    assert fault.num_released_blocks(swa, 0) == 0
    full = next(lay for lay in lays if lay.retention != WINDOW and lay.storage != RING)
    assert fault.num_released_blocks(full, first) == Fault().num_released_blocks(full, first)


def test_scheduler_marks_the_draft_rows_of_each_write():
    sc = scenario("dsv41-hybrid")
    k = sc.config.num_speculative_tokens
    seen = 0
    for plan in Scheduler(sc, build_layouts(sc)).plans():
        for w in plan.writes:
            assert 0 <= w.num_drafts <= k
            if w.num_drafts:
                assert len(w.contents) == 1 + w.num_drafts  # decode: the true token, then drafts
                seen += 1
    assert seen > 50


def test_ring_rejected_overwrite_puts_the_first_draft_on_the_true_rows_slot():
    from dcpsim.runtime.model_runner import ModelRunner
    from dcpsim.scheduler.plan import ReqWrite
    from dcpsim.scheduler.scheduler import pool_sizes

    sc = scenario("dsv41-hybrid")
    lays = build_layouts(sc)
    ring = next(lay for lay in lays if lay.storage == RING)
    runner = ModelRunner(lays, pool_sizes(sc, lays), sc.config, 0, max_num_reqs=2)
    write = ReqWrite(0, "r", 10, np.arange(4, dtype=np.int64) + 100, num_drafts=3)  # rows 10 + drafts 11..13
    row = np.array([2], dtype=np.int64)
    good, index, _ = Fault().slots_for(runner, ring, write, row)
    bad, _, _ = FAULTS["ring-rejected-overwrite"].slots_for(runner, ring, write, row)
    C = ring.block_size
    np.testing.assert_array_equal(good, 2 * C + index % C)
    np.testing.assert_array_equal(bad, 2 * C + np.array([10, 10, 11, 12]) % C)
    prefill = ReqWrite(0, "r", 0, np.arange(4, dtype=np.int64))
    np.testing.assert_array_equal(FAULTS["ring-rejected-overwrite"].slots_for(runner, ring, prefill, row)[0],
                                  Fault().slots_for(runner, ring, prefill, row)[0])


# ----------------------------------------------------------------------------- detection, end to end

CASES = [
    # fault, scenario, options, expected failure kind
    ("interleave-off-by-one", "llama-draft", {}, "wrong-content"),
    ("replicated-owner-only", "llama-draft", {}, "wrong-content"),
    ("foreign-block", "llama-draft", {}, "write-violation"),
    ("prefix-hash-unit-B", "dsv3", {"block_size": 16}, "wrong-content"),
    ("prefix-hash-unit-B", "llama-draft", {}, "wrong-content"),
    ("kernel-virtual-block", "dsv3", {"block_size": 64, "I": 64, "Bk": 16}, "write-violation"),
    ("kernel-virtual-block", "dsv41-hybrid", {"block_size": 64, "I": 64, "Bk": 16}, "write-violation"),
    ("replicated-scaled-by-w", "dsv41-hybrid", {"W": 4}, "block-table-overflow"),
    ("replicated-scaled-by-w", "llama-draft", {"W": 4}, "block-table-overflow"),
    ("merge-drops-dcp-replicated", "llama-draft", {}, "wrong-content"),
    ("merge-drops-dcp-replicated", "llama-draft", {"W": 4, "I": 16}, "wrong-content"),
    ("sliding-window-early-release", "dsv41-hybrid", {}, "wrong-content"),
    ("ring-rejected-overwrite", "dsv41-hybrid", {}, "write-violation"),
]


@pytest.mark.parametrize("fault,name,options,kind", CASES, ids=[f"{c[0]}-{c[1]}-{len(c[2])}" for c in CASES])
def test_fault_is_detected_and_the_same_config_passes_without_it(fault, name, options, kind):
    sc = scenario(name, **options)
    assert FAULTS[fault].applies_to_scenario(sc, build_layouts(sc))
    clean = run(sc)
    assert clean.passed, clean.failure and clean.failure.lines()
    report = run(sc, fault)
    assert not report.passed
    f = report.failure
    assert f.kind == kind, f.lines()
    if fault == "prefix-hash-unit-B":  # the first bad position lies past the true common prefix
        shared = max(r.shared_prefix_len for r in sc.requests)
        assert f.index >= shared and f.request_id != "chat-0"
    if fault in ("merge-drops-dcp-replicated", "replicated-owner-only"):
        assert "draft" in f.group and f.expected_owner == "all"
    if fault == "replicated-scaled-by-w":
        assert "long" in f.request_id and "block table has" in f.message
        assert not next(g for g in report.groups if g["name"] == f.group)["sharded"]
    if fault == "sliding-window-early-release":
        assert f.group.startswith("SlidingWindow")
    if fault == "ring-rejected-overwrite":
        assert any("more than once" in d and "compressor_ring" in d for d in f.details)
        assert f.step > 0  # the first speculative step, not the prefill


def test_replicated_scaled_by_w_does_not_apply_where_no_request_outgrows_the_table():
    fault = FAULTS["replicated-scaled-by-w"]
    at2 = scenario("llama-draft")  # W=2: the draft table holds 2048 tokens, long-doc needs 1435
    assert fault.applies_to(build_layouts(at2))  # the geometry has a replicated group...
    assert not fault.applies_to_scenario(at2, build_layouts(at2))  # ...but no request outgrows it
    assert run(at2, "replicated-scaled-by-w").passed  # and indeed nothing overflows


def test_llama_draft_has_a_sharded_target_and_a_replicated_draft_group():
    sc = load_scenario("llama-draft")
    lays = build_layouts(sc)
    assert sorted((len(lay.layer_names), lay.sharded) for lay in lays) == [(1, False), (32, True)]
    spec = next(lay for lay in lays if lay.sharded).spec
    assert (spec.num_kv_heads, spec.head_size, spec.block_size) == (8, 128, 32)


@pytest.mark.parametrize("W", [1, 2, 4, 8])
@pytest.mark.parametrize("I", [1, 16, 32])
def test_llama_draft_passes_and_exercises_the_workload(W, I):
    sc = scenario("llama-draft", W=W, I=I)
    report = run(sc)
    assert report.passed, report.failure and report.failure.lines()
    s = report.schedule
    assert s["finished"] == s["requests"] == 6
    assert s["preemptions"] >= 1 and s["reused_blocks"] > 0 and s["prefix_hit_tokens"] > 0
    assert report.verifications == report.steps
    hits = admissions(sc)
    unit = 32 * W
    assert all(0 < h <= 420 and h % unit == 0 for rid, h in hits.items() if rid != "long-doc")


# ----------------------------------------------------------------------------- selftest: planning


def test_plan_runs_each_fault_where_it_applies():
    plan = plan_selftest(MINE, SMALL, dry_run=False)
    where = {}
    for c in plan.cases:
        where.setdefault(c.fault, set()).add(c.scenario)
    assert where["prefix-hash-unit-B"] == {"dsv3", "llama-draft"}  # dsv41-hybrid: prefix caching off
    assert where["merge-drops-dcp-replicated"] == {"llama-draft"}
    assert where["sliding-window-early-release"] == {"dsv41-hybrid"}
    assert where["ring-rejected-overwrite"] == {"dsv41-hybrid"}
    assert where["replicated-scaled-by-w"] == {"dsv41-hybrid", "llama-draft"}
    assert where["replicated-owner-only"] == {"dsv41-hybrid", "llama-draft"}
    assert where["kernel-virtual-block"] == where["foreign-block"] == set(SMALL)
    assert where[BASELINE] == set(SMALL)
    # every config a fault runs in is also a baseline config on every scenario
    fault_cfgs = {c.options for c in plan.cases if c.fault != BASELINE}
    base = {(c.scenario, c.options) for c in plan.cases if c.fault == BASELINE}
    assert {(s, o) for s in SMALL for o in fault_cfgs | {()}} == base
    kv = next(c for c in plan.cases if c.fault == "kernel-virtual-block")
    assert dict(kv.options) == {"block_size": 64, "cp_kv_cache_interleave_size": 64, "kernel_block_size": 16}
    assert plan.resolved[("dsv3", kv.options)][2] == "W=2 I=64 B=64 Bk=16"


def test_apply_options_aliases_config_fields_and_unknown_options():
    sc, job = apply_options(load_scenario("dsv3"), {"dcp": 4, "B": 16, "enable_prefix_caching": False, "paranoid": True})
    assert sc.config.decode_context_parallel_size == 4 and not sc.config.enable_prefix_caching
    assert {s.block_size for s in sc.layers.values()} == {16}
    assert job == {"paranoid": True}
    with pytest.raises(UnknownOption, match="warp_drive"):
        apply_options(load_scenario("dsv3"), {"warp_drive": 9})
    opts = canonical_options({"Bk": 16, "I": 64})
    assert opts == (("cp_kv_cache_interleave_size", 64), ("kernel_block_size", 16))
    assert config_text(apply_options(load_scenario("dsv3"), dict(opts))[0], opts) == "W=2 I=64 Bk=16"


class _NoOp(Fault):
    name = "no-op"
    bug_class = "none: changes nothing"
    description = "a fault that forgets to break anything"


class _Nowhere(Fault):
    name = "nowhere"
    bug_class = "none"
    description = "applies to nothing"

    def applies_to(self, layouts):
        return False


class _OddOption(Fault):
    name = "odd-option"
    bug_class = "none"
    description = "needs an option nobody knows"
    needs = {"warp_drive": True}


def test_a_fault_that_applies_nowhere_is_listed_not_applicable(monkeypatch):
    monkeypatch.setitem(FAULTS, "nowhere", _Nowhere())
    plan = plan_selftest(["nowhere"], ["dsv3"], dry_run=False)
    assert [(c.fault, c.options) for c in plan.cases] == [(BASELINE, ())]  # the scenario's own config only
    assert [(r.fault, r.outcome) for r in plan.rows] == [("nowhere", NOT_APPLICABLE)]
    rows = run_plan(plan, in_process=True)
    assert fault_status(rows, "nowhere") == NOT_APPLICABLE
    assert verdict(rows, ["nowhere"])[0]


def test_an_unknown_run_option_is_an_error_row(monkeypatch):
    monkeypatch.setitem(FAULTS, "odd-option", _OddOption())
    plan = plan_selftest(["odd-option"], ["dsv3"], dry_run=False)
    assert [(r.fault, r.outcome) for r in plan.rows] == [("odd-option", ERROR)]
    assert "warp_drive" in plan.rows[0].report
    assert not verdict(plan.rows, ["odd-option"])[0]


def test_a_fault_that_breaks_nothing_is_missed_and_fails_selftest(monkeypatch, capsys):
    monkeypatch.setitem(FAULTS, "no-op", _NoOp())
    code = main(["selftest", "--in-process", "--fault", "no-op", "--scenario", "llama-draft"])
    out = capsys.readouterr().out
    assert code == 1
    assert "no-op" in out and MISSED in out and "not detected: no-op" in out


def test_a_broken_baseline_is_a_false_positive(monkeypatch, capsys):
    broken = FAULTS["foreign-block"]
    monkeypatch.setitem(FAULTS, BASELINE, broken)
    code = main(["selftest", "--in-process", "--fault", "interleave-off-by-one", "--scenario", "llama-draft", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and not doc["passed"]
    base = [r for r in doc["rows"] if r["fault"] == BASELINE]
    assert base and all(r["outcome"] == FALSE_POSITIVE and r["kind"] == "write-violation" for r in base)
    assert doc["faults"] == {"interleave-off-by-one": DETECTED}


# ----------------------------------------------------------------------------- selftest: verdict and table


def _row(fault, outcome, scenario="s", kind=None):
    return Row(fault, scenario, "W=2 I=1", outcome, kind=kind, report="FAIL at step 0: x" if kind else "")


@pytest.mark.parametrize(
    "rows,passed",
    [
        ([_row("a", DETECTED, kind="k"), _row(BASELINE, PASS)], True),
        ([_row("a", DETECTED, "s1", "k"), _row("a", MISSED, "s2"), _row(BASELINE, PASS)], True),  # detected somewhere
        ([_row("a", MISSED), _row(BASELINE, PASS)], False),
        ([_row("a", ERROR), _row(BASELINE, PASS)], False),
        ([_row("a", NOT_APPLICABLE), _row(BASELINE, PASS)], True),
        ([_row("a", DETECTED, kind="k"), _row(BASELINE, FALSE_POSITIVE, kind="k")], False),
        ([_row("a", DETECTED, kind="k"), _row(BASELINE, ERROR)], False),
    ],
)
def test_verdict(rows, passed):
    ok, lines = verdict(rows, ["a"])
    assert ok is passed
    assert lines[-1].startswith("selftest PASSED" if passed else "selftest FAILED")


def test_fault_status_prefers_detection():
    rows = [_row("a", ERROR, "s1"), _row("a", DETECTED, "s2", "k"), _row("b", ERROR), _row("c", MISSED), _row("c", ERROR)]
    assert [fault_status(rows, n) for n in "abc"] == [DETECTED, ERROR, MISSED]


def test_table_has_one_aligned_line_per_row():
    rows = [_row("interleave-off-by-one", DETECTED, "dsv3", "wrong-content"), _row(BASELINE, PASS, "llama-draft")]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:4] == ["fault", "scenario", "config", "result"]
    assert len(lines) == 4
    assert lines[2].startswith("interleave-off-by-one") and "[wrong-content] FAIL at step 0" in lines[2]
    assert lines[3].startswith("(baseline)") and lines[3].rstrip().endswith(PASS)
    col = lines[0].index("result")
    assert lines[2][col:].startswith(DETECTED) and lines[3][col:].startswith(PASS)


def test_list_shows_every_registered_fault_with_its_bug_class(capsys):
    assert main(["selftest", "--list"]) == 0
    out = capsys.readouterr().out
    for name, fault in FAULTS.items():
        if name != BASELINE:
            assert f"\n{name}\n" in f"\n{out}" and fault.bug_class in out
    assert main(["selftest", "--list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_name = {e["name"]: e for e in doc["faults"]}
    assert set(by_name) == set(FAULTS) - {BASELINE}
    assert by_name["merge-drops-dcp-replicated"]["runs"] == [{"scenario": "llama-draft", "config": "W=2 I=1"}]
    assert by_name["kernel-virtual-block"]["needs"] == {"kernel_block_size": 16}


def test_unknown_fault_or_scenario_is_a_usage_error(capsys):
    assert main(["selftest", "--fault", "no-such-bug"]) == 2
    assert "unknown fault 'no-such-bug'" in capsys.readouterr().err
    assert main(["selftest", "--scenario", "no-such-scenario"]) == 2
    assert "not a built-in scenario" in capsys.readouterr().err


def test_selftest_in_process_detects_every_registered_fault_on_the_small_scenarios(capsys):
    """Every registered fault (the attention ones too, once registered) on dsv3, dsv41-hybrid
    and llama-draft: each is detected wherever it runs, and every baseline passes."""
    args = ["selftest", "--in-process", "--json"] + [a for s in SMALL for a in ("--scenario", s)]
    code = main(args)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc["summary"]
    assert set(doc["faults"]) == set(FAULTS) - {BASELINE}
    assert set(doc["faults"].values()) == {DETECTED}
    faults = [r for r in doc["rows"] if r["fault"] != BASELINE]
    assert faults and all(r["outcome"] == DETECTED and r["report"].startswith("FAIL at step") for r in faults)
    base = [r for r in doc["rows"] if r["fault"] == BASELINE]
    assert len(base) >= 4 * len(SMALL) and all(r["outcome"] == PASS for r in base)
