"""The fault catalogue, in one process (ranks as threads).

* each fault's engine decision does what its bug class says, checked directly
  against the reference engine beside it (prefix-cache hit lengths,
  kernel-coordinate slots, block-table widths, group geometries, released
  blocks, ring slots);
* each fault is detected on its scenario with the expected failure kind, and
  the same scenario and config passes without the fault.

The selftest that runs the whole catalogue: ``test_selftest_campaign.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.faults import FAULTS, Fault, get_fault
from dcpsim.engine.faults.layout import KernelVirtualBlock
from dcpsim.engine.interface import Engine
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.arith import cdiv
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import PAD, slot_mapping
from dcpsim.model.plan import EventKind, ReqWrite
from dcpsim.scenarios.load import load_scenario
from support.helpers import WRITE_PATH_FAULTS, builtin, geometries, scheduler
from support.helpers import fault_scenario as scenario
from support.helpers import run_fault as run

MINE = WRITE_PATH_FAULTS


def admissions(sc, fault=None) -> dict[str, int]:
    """request id -> prefix-cache hit (tokens) at its first admission with a hit."""
    sched = scheduler(sc, fault)
    hits: dict[str, int] = {}
    for plan in sched.plans():
        for e in plan.events:
            if e.kind is EventKind.ADMITTED and e.prefix_hit:
                hits.setdefault(e.request_id, e.prefix_hit)
    return hits


def _writes_all(positions) -> ReqWrite:
    """One prefill write of ``positions`` (contiguous from 0)."""
    return ReqWrite(0, "r", int(positions[0]), np.zeros(len(positions), dtype=np.int64))


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
    layouts = geometries(sc)
    base = Fault()
    assert isinstance(base, ReferenceEngine)
    # it overrides no decision of the reference engine
    decisions = [n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")]
    assert decisions and all(getattr(Fault, n) is getattr(ReferenceEngine, n) for n in decisions)
    assert base.geometries(sc.layers, sc.config) == layouts
    for lay in base.geometries(sc.layers, sc.config):
        assert lay.block_table_width == lay.group_spec.max_num_blocks_per_req(sc.config, sc.config.max_model_len)
        assert base.num_released_blocks(lay, 1000) == 1000 // lay.manager_block_size


# ----------------------------------------------------------------------------- hooks, one by one


def test_prefix_hash_unit_b_hits_past_the_true_common_prefix():
    # dsv3 at B=16, W=2: one sharded group, hash block = hit unit = 32; a 520-token prefix.
    sc = scenario("dsv3", block_size=16, decode_context_parallel_size=2)
    good = admissions(sc)
    bad = admissions(sc, FAULTS["prefix-hash-unit-B"])
    assert good["chat-1"] == 512 and good["late-0"] == 512  # 16 whole units of 32 <= 520
    # block u keyed by the fingerprint at (u+1)*16-1 matches while (u+1)*16 <= 520, so the
    # 17th unit (512-543) is found although only 520 of its tokens are common
    assert bad["late-0"] == 544 > 520


@pytest.mark.parametrize("W", [2, 4])
def test_compressed_hit_drops_r_stops_inside_a_compressed_block(W):
    # compressed-prefix: a compressed entry covers 64 * W tokens; the fault credits it with its
    # 16 records * W and aligns hits to 16 * W, so sys-1 (300 common tokens) stops short of a
    # whole compressed block, and the group reuses fewer blocks than the hit covers
    sc = scenario("compressed-prefix", decode_context_parallel_size=W)
    good = admissions(sc)
    bad = admissions(sc, FAULTS["compressed-hit-drops-r"])
    assert good["sys-1"] == 300 // (64 * W) * 64 * W
    assert bad["sys-1"] == good["sys-1"] // 4 and bad["sys-1"] % (64 * W)
    assert FAULTS["compressed-hit-drops-r"].applies_to(geometries(sc))
    assert not FAULTS["compressed-hit-drops-r"].applies_to(geometries(scenario("dsv3")))


def test_prefix_hash_unit_b_is_right_where_the_hash_block_is_b():
    # llama-draft: a replicated draft of the same B keeps the GCD (the hash block) at B = 32
    sc = scenario("llama-draft")
    assert admissions(sc) == admissions(sc, FAULTS["prefix-hash-unit-B"])
    assert not FAULTS["prefix-hash-unit-B"].applies_to(geometries(sc))


def test_prefix_hash_unit_b_is_harmless_without_dcp():
    sc = scenario("llama-draft", decode_context_parallel_size=1)
    assert admissions(sc) == admissions(sc, FAULTS["prefix-hash-unit-B"])
    assert not FAULTS["prefix-hash-unit-B"].applies_to(geometries(sc))


def _kernel_geometry(W, I, B, Bk):
    """The sharded MLA group of dsv3 with pages of ``B`` and kernel blocks of ``Bk``."""
    sc = builtin("dsv3", W, I, block_size=B, kernel_block_size=Bk)
    (g,) = geometries(sc)
    assert g.sharded and g.states_per_page == B and g.kernel_block_size == Bk
    assert KernelVirtualBlock().applies_to([g])  # the fault's slots are the ones under test
    return g


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("I", [1, 2, 4, 8, 16])
def test_kernel_virtual_block_equals_the_truth_when_interleave_divides_bk(W, I):
    B, Bk = 64, 16
    g = _kernel_geometry(W, I, B, Bk)
    fault = FAULTS["kernel-virtual-block"]
    row = np.array([3, 9, 5], dtype=np.int64)
    pos = np.arange(len(row) * B * W)
    for r in range(W):
        truth = slot_mapping(pos, row, block_size=B, dcp_size=W, dcp_rank=r, interleave_size=I, kernel_block_size=Bk)
        bug, index = fault.write_slots(g, _writes_all(pos), row, r)
        np.testing.assert_array_equal(index, pos)
        np.testing.assert_array_equal(bug, truth)
        np.testing.assert_array_equal(ReferenceEngine().write_slots(g, _writes_all(pos), row, r)[0], truth)


def test_kernel_virtual_block_with_interleave_above_bk_starves_ranks_and_collides():
    B, Bk, W, I = 64, 16, 2, 64
    g = _kernel_geometry(W, I, B, Bk)
    fault = FAULTS["kernel-virtual-block"]
    row = np.array([3, 9, 5], dtype=np.int64)
    pos = np.arange(len(row) * B * W)
    rank0, _ = fault.write_slots(g, _writes_all(pos), row, 0)
    rank1, _ = fault.write_slots(g, _writes_all(pos), row, 1)
    assert (rank1 == PAD).all()  # "some ranks store nothing"
    assert (rank0 != PAD).all() and len(np.unique(rank0)) < len(rank0)  # "slots collide"


def test_replicated_scaled_by_w_narrows_only_replicated_tables():
    sc = scenario("llama-draft", decode_context_parallel_size=4)
    fault = FAULTS["replicated-scaled-by-w"]
    widths = {
        good.sharded: (bad.block_table_width, good.block_table_width)
        for bad, good in zip(fault.geometries(sc.layers, sc.config), geometries(sc), strict=True)
    }
    assert widths[True] == (cdiv(4096, 32 * 4),) * 2  # sharded: unchanged
    assert widths[False] == (cdiv(4096, 32 * 4), cdiv(4096, 32))  # replicated draft: 32 instead of 128


def test_merge_drops_dcp_replicated_makes_the_draft_group_sharded_silently():
    fault = FAULTS["merge-drops-dcp-replicated"]
    sc = scenario("llama-draft")
    truth = geometries(sc)
    engine = fault.geometries(sc.layers, sc.config)  # no error: the bug is silent
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
    lays = geometries(hybrid)
    assert not fault.applies_to(lays)
    assert [lay.sharded for lay in fault.geometries(hybrid.layers, hybrid.config)] == [lay.sharded for lay in lays]


def test_sliding_window_early_release_frees_one_block_still_in_the_window():
    fault = FAULTS["sliding-window-early-release"]
    reference = ReferenceEngine()
    lays = geometries(scenario("dsv41-hybrid"))
    swa = next(lay for lay in lays if lay.retention is Retention.WINDOW)
    span = swa.manager_block_size  # 64 (replicated)
    first = 300 - 128 + 1  # 173 after 300 committed tokens with a 128-token window
    assert reference.num_released_blocks(swa, first) == first // span == 2
    assert fault.num_released_blocks(swa, first) == 3  # block 2 holds 173..191, still needed
    assert fault.num_released_blocks(swa, 0) == 0
    full = next(lay for lay in lays if lay.retention is not Retention.WINDOW and lay.storage is not Storage.RING)
    assert fault.num_released_blocks(full, first) == reference.num_released_blocks(full, first)


def test_ring_rejected_overwrite_puts_the_first_draft_on_the_true_rows_slot():
    sc = scenario("dsv41-hybrid")
    lays = geometries(sc)
    ring = next(lay for lay in lays if lay.storage is Storage.RING)
    fault = FAULTS["ring-rejected-overwrite"]
    write = ReqWrite(0, "r", 10, np.arange(4, dtype=np.int64) + 100, num_drafts=3)  # rows 10 + drafts 11..13
    row = np.array([2], dtype=np.int64)
    good, index = ReferenceEngine().write_slots(ring, write, row, 0)
    bad, _ = fault.write_slots(ring, write, row, 0)
    C = ring.block_size
    np.testing.assert_array_equal(good, 2 * C + index % C)
    np.testing.assert_array_equal(bad, 2 * C + np.array([10, 10, 11, 12]) % C)
    prefill = ReqWrite(0, "r", 0, np.arange(4, dtype=np.int64))
    np.testing.assert_array_equal(fault.write_slots(ring, prefill, row, 0)[0], ReferenceEngine().write_slots(ring, prefill, row, 0)[0])


# ----------------------------------------------------------------------------- detection, end to end

CASES = [
    # fault, scenario, options, expected failure kind
    ("interleave-off-by-one", "llama-draft", {}, "wrong-content"),
    ("replicated-owner-only", "llama-draft", {}, "wrong-content"),
    ("foreign-block", "llama-draft", {}, "write-violation"),
    ("prefix-hash-unit-B", "dsv3", {"block_size": 16}, "wrong-content"),
    ("prefix-hash-unit-B", "prefix-sharing", {}, "wrong-content"),
    ("compressed-hit-drops-r", "compressed-prefix", {}, "wrong-content"),
    ("compressed-hit-drops-r", "compressed-prefix", {"W": 4}, "wrong-content"),
    ("kernel-virtual-block", "dsv3", {"block_size": 64, "I": 64, "Bk": 16}, "write-violation"),
    ("kernel-virtual-block", "dsv41-hybrid", {"block_size": 64, "I": 64, "Bk": 16}, "write-violation"),
    # the worker's table is narrower than the metadata builder's: caught at step 0, before
    # a long request overflows it
    ("replicated-scaled-by-w", "dsv41-hybrid", {"W": 4}, "attention-metadata"),
    ("replicated-scaled-by-w", "llama-draft", {"W": 4}, "attention-metadata"),
    # the engine takes the replicated draft group for sharded, so its own admission limit counts
    # that group's blocks W times: the admission check (class 53's) sees it before any write
    ("merge-drops-dcp-replicated", "llama-draft", {}, "admission"),
    ("merge-drops-dcp-replicated", "llama-draft", {"W": 4, "I": 16}, "admission"),
    ("sliding-window-early-release", "dsv41-hybrid", {}, "wrong-content"),
    ("ring-rejected-overwrite", "dsv41-hybrid", {}, "write-violation"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fault,name,options,kind", CASES, ids=[f"{c[0]}-{c[1]}-{len(c[2])}" for c in CASES])
def test_fault_is_detected_and_the_same_config_passes_without_it(fault, name, options, kind):
    sc = scenario(name, **options)
    assert FAULTS[fault].applies_to_scenario(sc, geometries(sc))
    clean = run(sc)
    assert clean.passed, clean.failure and clean.failure.lines()
    report = run(sc, fault)
    assert not report.passed
    f = report.failure
    assert f.kind == kind, f.lines()
    if fault == "prefix-hash-unit-B":  # the first bad position lies past the true common prefix
        shared = next(r.shared_prefix_len for r in sc.requests if r.request_id == f.request_id)
        assert f.index >= shared and f.request_id != sc.requests[0].request_id
    if fault == "compressed-hit-drops-r":  # records below the hit that nobody computed
        assert "c4_cache" in f.group and f.index < 300 // 4, f.lines()
    if fault == "replicated-owner-only":
        assert "draft" in f.group and f.expected_owner == "all"
    if fault == "merge-drops-dcp-replicated":  # the draft group's blocks counted as B * W tokens
        assert "draft" in f.group and "x 1 (replicated)" in f.message and "would be admitted" in f.message, f.message
    if fault == "replicated-scaled-by-w":
        assert any("block table width (worker)" in d for d in f.details), f.details
        assert not next(g for g in report.groups if g["name"] == f.group)["sharded"]
    if fault == "sliding-window-early-release":
        assert f.group.startswith("SlidingWindow")
    if fault == "ring-rejected-overwrite":
        assert any("more than once" in d and "compressor_ring" in d for d in f.details)
        assert f.step > 0  # the first speculative step, not the prefill


def test_replicated_scaled_by_w_is_caught_even_where_no_request_outgrows_the_table():
    fault = FAULTS["replicated-scaled-by-w"]
    at2 = scenario("llama-draft")  # W=2: the narrow draft table holds 2048 tokens, long-doc needs 1435
    assert fault.applies_to_scenario(at2, geometries(at2))
    report = run(at2, "replicated-scaled-by-w")  # nothing overflows, yet the table is too narrow
    assert report.failure.kind == "attention-metadata"
    assert any("block table width (worker)" in d for d in report.failure.details)


def test_llama_draft_has_a_sharded_target_and_a_replicated_draft_group():
    sc = load_scenario("llama-draft")
    lays = geometries(sc)
    assert sorted((len(lay.layer_names), lay.sharded) for lay in lays) == [(1, False), (32, True)]
    spec = next(lay for lay in lays if lay.sharded).spec
    assert (spec.num_kv_heads, spec.head_size, spec.block_size) == (8, 128, 32)


@pytest.mark.slow
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


def test_cudagraph_padding_applies_only_where_some_decode_step_is_padded():
    """kv-events-full decodes one request, then two: 1 and 2 tokens are captured sizes, no
    dummy ever runs, so the fault cannot show there and selftest must not expect it to."""
    fault = FAULTS["cudagraph-padding-writes"]
    quiet = scenario("kv-events-full", **fault.needs)
    assert not fault.applies_to_scenario(quiet, geometries(quiet))
    busy = scenario("many-short", **fault.needs)
    assert fault.applies_to_scenario(busy, geometries(busy))
    assert not run(busy, "cudagraph-padding-writes").passed
