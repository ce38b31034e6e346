"""The checker, end to end in one process: ranks as threads over ``ThreadCollectives``.

First the built-in scenarios must pass under many DCP configurations. Then the
write path (or a rank's block table, or the per-rank oracle) is broken with
monkeypatch, and the run must fail with the expected kind and a report that
names the group, the request, the first bad index, its expected owner and slot
(computed here by hand from the plan's block-table row), and what every rank
holds there. Finally the digests and the oracle are tested on their own.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json

import numpy as np
import pytest

import dcpsim.runtime.model_runner as model_runner
import dcpsim.verify.check as check
from dcpsim.config import SimConfig
from dcpsim.layout import PAD
from dcpsim.runtime.block_table import BlockTable
from dcpsim.runtime.collectives import run_in_threads
from dcpsim.runtime.model_runner import ModelRunner
from dcpsim.scenario import RequestSpec, Scenario
from dcpsim.registry import builtin_scenario_names
from dcpsim.scenario_file import load_scenario
from dcpsim.scheduler.plan import RequestView
from dcpsim.scheduler.scheduler import Scheduler
from dcpsim.simulation import Job, build_layouts, run_rank
from dcpsim.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    cdiv,
)
from dcpsim.verify.check import multiset_digest, ordered_digest
from dcpsim.verify.oracle import expected_full, expected_on_rank, expected_owner, retained_start

# ----------------------------------------------------------------------------- helpers


def builtin(name, W, I=1, **ov):
    return load_scenario(name).with_overrides(
        decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, **ov)


def run(sc, *, paranoid=False, **job):
    W = sc.config.decode_context_parallel_size
    reports = run_in_threads(run_rank, Job(sc, paranoid=paranoid, **job), W)
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps) for r in reports}
    assert len(verdicts) == 1, f"ranks disagree: {verdicts}"
    return reports[0]


def plan_at(sc, step):
    """The plan of ``step`` from a fresh scheduler (the checker reads rows_after)."""
    sched = Scheduler(sc, build_layouts(sc))
    for plan in sched.plans():
        if plan.step == step:
            return sched, plan
    raise AssertionError(f"no step {step}")


def group_index(sc, name):
    return [lay.name for lay in build_layouts(sc)].index(name)


def slot_by_hand(layout, row, p, *, W, I):
    """Semantics doc sections 2-3, one position: the slot its owner stores it in."""
    B = layout.block_size
    if not layout.sharded:
        return int(row[p // B]) * B + p % B
    vb, off = divmod(p, B * W)
    loc = (off // (W * I)) * I + off % I
    return int(row[vb]) * B + loc


def assert_named(failure, W):
    assert failure.group and failure.request_id
    assert failure.index is not None and failure.index >= 0
    assert failure.expected_slot is not None and failure.expected_slot >= 0
    assert [h.rank for h in failure.holdings] == list(range(W))
    assert all(h.slot == failure.expected_slot for h in failure.holdings)
    text = "\n".join(failure.lines())
    assert f"group: {failure.group}" in text and f"request: {failure.request_id}" in text
    assert f"first bad {failure.index_kind}: {failure.index}" in text
    for r in range(W):
        assert f"rank {r} slot {failure.expected_slot}:" in text


# ----------------------------------------------------------------------------- correct runs

CONFIGS = [(1, 1), (2, 1), (2, 8), (3, 1), (3, 64), (4, 1), (4, 16)]


@pytest.mark.parametrize("W,I", CONFIGS, ids=[f"W{w}-I{i}" for w, i in CONFIGS])
@pytest.mark.parametrize("name", ["dsv3", "dsv41-hybrid"])
def test_builtin_scenarios_pass(name, W, I):
    sc = builtin(name, W, I)
    rep = run(sc)
    assert rep.passed and rep.failure is None, "\n".join(rep.failure.lines())
    assert rep.verified_indices > 0
    assert rep.verifications == rep.steps  # verify_every = 1
    assert rep.schedule["finished"] == len(sc.requests)
    assert "PASS" in rep.text()
    json.loads(rep.to_json())


@pytest.mark.parametrize("name,ov", [
    ("dsv3", dict(kernel_block_size=16)),
    ("dsv41-hybrid", dict(kernel_block_size=32)),
    ("dsv3", dict(block_size=32)),
    ("dsv41-hybrid", dict(block_size=16, cp_kv_cache_interleave_size=4)),
])
def test_builtin_scenarios_pass_other_geometry(name, ov):
    ov = dict(ov)
    I = ov.pop("cp_kv_cache_interleave_size", 2)
    rep = run(builtin(name, 2, I, **ov))
    assert rep.passed, "\n".join(rep.failure.lines())


def test_sharded_verification_counts_every_index_once():
    # With pools that hold every request (no W-dependent pressure) and no prefix caching, W=1 and
    # W=2 run the same schedule; the two shards of W=2 verify exactly the indices W=1 verifies.
    base = builtin("dsv3", 1)
    base = dataclasses.replace(base, kv_cache_tokens=None,
                               config=dataclasses.replace(base.config, enable_prefix_caching=False))
    a = run(base)
    b = run(base.with_overrides(decode_context_parallel_size=2))
    assert a.passed and b.passed
    # block reuse counts differ (pages of 64 vs 128 tokens); everything else is the same schedule
    assert {k: v for k, v in a.schedule.items() if k != "reused_blocks"} == \
        {k: v for k, v in b.schedule.items() if k != "reused_blocks"}
    assert a.verified_indices == b.verified_indices > 0


# ----------------------------------------------------------------------------- broken write paths

_orig_slot_mapping = model_runner.slot_mapping
_orig_slots_for = ModelRunner.slots_for
_orig_apply = ModelRunner.apply


def shifted_rank(positions, block_table, **kw):
    """Each rank writes the positions of the next rank (an interleave off by one)."""
    kw["dcp_rank"] = (kw["dcp_rank"] + 1) % kw["dcp_size"]
    return _orig_slot_mapping(positions, block_table, **kw)


def owner_only(positions, block_table, **kw):
    """Bug class 7: a replicated group masked like a sharded one."""
    slots = _orig_slot_mapping(positions, block_table, **kw)
    if kw.get("replicated") and kw["dcp_size"] > 1:
        p = np.arange(positions.start, positions.stop) if isinstance(positions, range) else np.asarray(positions)
        mine = (p // kw["interleave_size"]) % kw["dcp_size"] == kw["dcp_rank"]
        slots = np.where(mine, slots, PAD)
    return slots


def plus_one_block(positions, block_table, **kw):
    """Every slot moved by B: the request's last block spills into one it does not hold."""
    slots = _orig_slot_mapping(positions, block_table, **kw)
    return np.where(slots != PAD, slots + kw["block_size"], slots)


def test_break_shifted_rank_is_wrong_content(monkeypatch):
    # dsv3, W=2, I=1, B=64. Step 0 writes chat-0 [0, 256) into blocks [1, 2]. Rank 0 now holds
    # the odd positions: at its local index 0 (slot 1*64 + 0 = 64) it has position 1, and rank 1
    # has position 0 at its slot 64.
    monkeypatch.setattr(model_runner, "slot_mapping", shifted_rank)
    sc = builtin("dsv3", 2, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (0, "chat-0", 0, 0)
    _, plan = plan_at(sc, 0)
    lay = build_layouts(sc)[0]
    assert f.group == lay.name
    assert f.expected_slot == slot_by_hand(lay, plan.rows_after[0][0], 0, W=2, I=1) == 64
    assert f.holdings[0].index == 1 and f.holdings[1].index == 0
    assert f.expected_content == int(plan.views[0].fingerprints[0])
    assert f.holdings[1].content == f.expected_content != f.holdings[0].content
    assert f.further_bad == 255  # every one of the 256 positions is misplaced
    assert_named(f, 2)


@pytest.mark.parametrize("W", [2, 3])
def test_break_replicated_owner_only_is_wrong_content(monkeypatch, W):
    # dsv41-hybrid: the sliding-window group (window 128, B 64) is replicated. After step 0
    # chat-0 has 256 committed tokens, the window keeps [256 - 127, 256) = [129, 256). Only the
    # owner 129 % W (rank 1 for W=2, rank 0 for W=3) holds 129; every other rank misses it.
    monkeypatch.setattr(model_runner, "slot_mapping", owner_only)
    sc = builtin("dsv41-hybrid", W, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (0, "chat-0", 129, "all")
    g = group_index(sc, f.group)
    lay = build_layouts(sc)[g]
    assert isinstance(lay.spec, SlidingWindowMLASpec) and lay.replicated
    _, plan = plan_at(sc, 0)
    row = plan.rows_after[g][0]
    assert list(row[:2]) == [0, 0]  # released: wholly below 129
    assert f.expected_slot == slot_by_hand(lay, row, 129, W=W, I=1) == int(row[2]) * 64 + 1
    for r in range(W):
        assert f.holdings[r].index == (129 if r == 129 % W else -1)  # -1: never written
    assert_named(f, W)


def test_break_write_into_foreign_block_is_write_violation(monkeypatch):
    monkeypatch.setattr(model_runner, "slot_mapping", plus_one_block)
    sc = builtin("dsv3", 2, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "write-violation" and f.step == 0
    lay = build_layouts(sc)[0]
    text = "\n".join(f.details)
    for r in range(2):
        assert f"rank {r} step 0 group {lay.name} request chat-0" in text
    assert "does not hold" in text
    assert "write violation" in "\n".join(f.lines())


def test_write_violation_failure_has_structured_fields(monkeypatch):
    monkeypatch.setattr(model_runner, "slot_mapping", plus_one_block)
    f = run(builtin("dsv3", 2, 1)).failure
    assert f.kind == "write-violation"
    assert f.group is not None and f.request_id == "chat-0" and f.index is not None
    assert f.violations and {"rank", "slot", "reason", "count"} <= set(f.violations[0])


def _drop_position(target_req: str, target_index: int):
    def slots_for(self, layout, write, row, *args, **kw):
        slots, index, content = _orig_slots_for(self, layout, write, row, *args, **kw)
        if write.request_id == target_req:
            slots = np.where(index == target_index, PAD, slots)
        return slots, index, content
    return slots_for


def test_break_dropped_position_is_wrong_content(monkeypatch):
    # dsv3, W=2, I=1: position 300 of chat-0 is written at step 1 ([256, 512)). Owner 300 % 2 = 0.
    # Virtual block 300 // 128 = 2, offset 44, local offset 44 // 2 = 22: slot row[2] * 64 + 22.
    monkeypatch.setattr(ModelRunner, "slots_for", _drop_position("chat-0", 300))
    sc = builtin("dsv3", 2, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner, f.further_bad) == (1, "chat-0", 300, 0, 0)
    _, plan = plan_at(sc, 1)
    row = plan.rows_after[0][0]
    assert f.expected_slot == int(row[2]) * 64 + 22 == slot_by_hand(build_layouts(sc)[0], row, 300, W=2, I=1)
    assert f.holdings[0].index == -1 and f.holdings[0].found_at == []
    assert f.holdings[1].index == 301  # rank 1's local 22 of that virtual block
    assert_named(f, 2)


def _skip_rewrite_of_rejected():
    """The write path forgets to rewrite a position that holds a rejected draft."""
    last: dict = {}

    def slots_for(self, layout, write, row, *args, **kw):
        slots, index, content = _orig_slots_for(self, layout, write, row, *args, **kw)
        key = (self.rank, layout.group_id, write.req_index)
        seen = last.setdefault(key, {})
        skip = np.zeros(len(slots), dtype=bool)
        for j, (i, c) in enumerate(zip(index.tolist(), content.tolist())):
            if i == write.start and i in seen and seen[i] != c:
                skip[j] = True
        for i, c in zip(index.tolist(), content.tolist()):
            seen[i] = c
        return np.where(skip, PAD, slots), index, content
    return slots_for


def test_break_stale_rejected_draft_is_wrong_content(monkeypatch):
    # dsv3, W=2, I=1, k=3, chat-0 acceptance [3, 1, 0, 2]: step 3 writes [600, 604), 3/3
    # accepted; step 4 writes [604, 608), 1/3 accepted -> committed 606, positions 606, 607 hold
    # rejected drafts; step 5 must rewrite 606 with the true token but skips it; after step 5
    # (0/3 accepted, committed 607) rank 606 % 2 = 0 still holds the draft written at step 4.
    monkeypatch.setattr(ModelRunner, "slots_for", _skip_rewrite_of_rejected())
    sc = builtin("dsv3", 2, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (5, "chat-0", 606, 0)
    h = f.holdings[0]
    assert h.index == 606 and h.writer == "chat-0" and h.step == 4 and f.last_write_step == 4
    assert h.content != f.expected_content
    assert_named(f, 2)


def test_break_stale_rejected_draft_in_replicated_and_ring_groups(monkeypatch):
    monkeypatch.setattr(ModelRunner, "slots_for", _skip_rewrite_of_rejected())
    sc = builtin("dsv41-hybrid", 2, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    stale = [h for h in f.holdings if h.index == f.index]
    assert stale and all(h.step < f.step and h.content != f.expected_content for h in stale)
    assert_named(f, 2)


def _write_other_requests_contents(self, plan, request_ids, *args, **kw):
    writes = list(plan.writes)
    for k in range(1, len(writes)):
        other = plan.writes[k - 1].contents
        writes[k] = dataclasses.replace(writes[k], contents=np.resize(other, len(writes[k].contents)))
    return _orig_apply(self, dataclasses.replace(plan, writes=tuple(writes)), request_ids, *args, **kw)


def test_break_contents_of_another_request(monkeypatch):
    # dsv3 step 2: chat-0 [512, 600), chat-1 [512, 600) after a 512-token hit, short [0, 80).
    # chat-1 gets chat-0's contents: identical over the shared system prompt (< 520), so the
    # first bad position is 520 (owner 520 % 2 = 0), never an earlier one.
    monkeypatch.setattr(ModelRunner, "apply", _write_other_requests_contents)
    sc = builtin("dsv3", 2, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (2, "chat-1", 520, 0)
    h = f.holdings[0]
    assert h.index == 520 and h.writer == "chat-1" and h.content != f.expected_content
    _, plan = plan_at(sc, 2)
    chat0 = next(v for v in plan.views if v.request_id == "chat-0")
    assert h.content == int(chat0.fingerprints[520])  # it is chat-0's entry
    assert_named(f, 2)


def _narrow_replicated(self, config, max_len):
    """Bug class 5: a replicated state's table scaled by W as if sharded."""
    return cdiv(max_len, self.block_size * config.decode_context_parallel_size)


def test_break_replicated_table_scaled_by_w_overflows(monkeypatch):
    # dsv41-hybrid W=4: the window group's table gets cdiv(4096, 64*4) = 16 entries; long-doc
    # (1400 prompt tokens) needs up to cdiv(1424, 64) = 23 (released entries still count).
    monkeypatch.setattr(AttentionSpec, "max_num_blocks_per_req", _narrow_replicated)
    sc = builtin("dsv41-hybrid", 4, 1)
    rep = run(sc)
    f = rep.failure
    assert not rep.passed and f.kind == "block-table-overflow"
    assert f.group.startswith("SlidingWindowMLA[") and f.request_id == "long-doc"
    _, plan = plan_at(sc, f.step)
    stop = next(w.stop for w in plan.writes if w.request_id == "long-doc")
    need = cdiv(stop, 64)
    assert need > 16
    assert f"needs {need} block-table entries" in f.message and "has 16" in f.message


def test_break_block_table_too_narrow(monkeypatch):
    # dsv3 W=2: 2 entries of 128 tokens; chat-0 needs 4 at step 1 ([256, 512)).
    monkeypatch.setattr(MLAAttentionSpec, "max_num_blocks_per_req", lambda self, c, n: 2)
    rep = run(builtin("dsv3", 2, 1))
    f = rep.failure
    assert not rep.passed and f.kind == "block-table-overflow"
    assert (f.step, f.request_id) == (1, "chat-0") and f.group.startswith("MLAAttention[")


def test_break_one_ranks_block_table_is_mismatch(monkeypatch):
    def apply(self, plan, request_ids, *args, **kw):
        _orig_apply(self, plan, request_ids, *args, **kw)
        if self.rank == 1 and plan.step == 3:
            table = self.block_tables[0]
            row = table.row(0).copy()
            table.set_row(0, "chat-0", row[::-1])
    monkeypatch.setattr(ModelRunner, "apply", apply)
    rep = run(builtin("dsv3", 2, 1))
    f = rep.failure
    assert not rep.passed and f.kind == "block-table-mismatch" and f.step == 3
    assert any("request chat-0" in d and "rank 1" in d for d in f.details)


# --- the checker's second line of defence: per-rank oracles that do not add up ------------------

_orig_on_rank = check.expected_on_rank


def test_shards_that_do_not_reassemble(monkeypatch):
    # rank 1 "forgets" its last index of sharded groups: every entry it reads is right, yet the
    # shards miss a position. dsv3 W=2 step 0: rank 1 owns the odd positions < 256 -> 255.
    def on_rank(layout, view, rank):
        index, content = _orig_on_rank(layout, view, rank)
        if rank == 1 and layout.sharded:
            return index[:-1], content[:-1]
        return index, content
    monkeypatch.setattr(check, "expected_on_rank", on_rank)
    rep = run(builtin("dsv3", 2, 1))
    f = rep.failure
    assert not rep.passed and f.kind == "reassembly"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (0, "chat-0", 255, 1)
    assert_named(f, 2)


def test_replicas_that_differ(monkeypatch):
    # rank 1 reads one index less of replicated groups: ordered digests differ although no read
    # is wrong. dsv41-hybrid W=2 step 0: the window keeps [129, 256), rank 1 skips 129.
    def on_rank(layout, view, rank):
        index, content = _orig_on_rank(layout, view, rank)
        if rank == 1 and not layout.sharded:
            return index[1:], content[1:]
        return index, content
    monkeypatch.setattr(check, "expected_on_rank", on_rank)
    rep = run(builtin("dsv41-hybrid", 2, 1))
    f = rep.failure
    assert not rep.passed and f.kind == "replicas-differ"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (0, "chat-0", 129, "all")
    assert_named(f, 2)


# --- the engine's own fault registry --------------------------------------------------------------


def _fault_names():
    try:
        from dcpsim.faults import FAULTS
    except ImportError:  # pragma: no cover - registry not present
        return []
    return sorted(n for n in FAULTS if n != "none")


def _configured(sc, options):
    """Apply fault run options: with_overrides arguments, SimConfig fields, or Job fields."""
    ov_names = set(inspect.signature(Scenario.with_overrides).parameters) - {"self"}
    cfg_names = {f.name for f in dataclasses.fields(SimConfig)}
    ov = {k: v for k, v in options.items() if k in ov_names}
    cfg = {k: v for k, v in options.items() if k in cfg_names and k not in ov_names}
    job = {k: v for k, v in options.items() if k not in ov_names and k not in cfg_names}
    sc = sc.with_overrides(**ov)
    if cfg:
        sc = dataclasses.replace(sc, config=dataclasses.replace(sc.config, **cfg))
    return sc, job


@pytest.mark.parametrize("fault", _fault_names())
def test_every_registered_fault_is_caught(fault):
    """Each fault of the engine's registry, on the built-ins it declares (default dsv3 and
    dsv41-hybrid) in the configs it declares, wherever it can show, must fail the run."""
    from dcpsim.faults import FAULTS

    f = FAULTS[fault]
    caught = 0
    declared = getattr(f, "scenarios", None)
    first = declared or ("dsv3", "dsv41-hybrid")
    # a fault that cannot show on the two reference scenarios: the first small built-in where it can
    rest = [] if declared else [n for n in builtin_scenario_names() if n not in first and "256k" not in n]
    names = list(first) + rest
    for name in names:
        if caught and name in rest:
            break
        for config in getattr(f, "configs", ({},)):
            options = {**config, **getattr(f, "needs", {})}
            sc, job = _configured(load_scenario(name), options)
            layouts = build_layouts(sc)
            applies = (f.applies_to_scenario(sc, layouts) if hasattr(f, "applies_to_scenario")
                       else f.applies_to(layouts))
            if not applies:
                continue
            rep = run(sc, inject=fault, **job)
            assert not rep.passed and rep.failure is not None, f"{fault} on {name} {options} passed"
            caught += 1
    if not caught:
        pytest.skip(f"{fault} cannot show on {names}")


# --- paranoid mode --------------------------------------------------------------------------------


@pytest.mark.parametrize("name,W,I", [("dsv3", 3, 4), ("dsv41-hybrid", 2, 8)])
def test_paranoid_passes(name, W, I):
    rep = run(builtin(name, W, I), paranoid=True)
    assert rep.passed and rep.verified_indices > 0
    plain = run(builtin(name, W, I))
    assert rep.bytes_gathered > plain.bytes_gathered  # it really gathered the raw views


def test_paranoid_catches_a_break(monkeypatch):
    monkeypatch.setattr(model_runner, "slot_mapping", owner_only)
    sc = builtin("dsv41-hybrid", 2, 1)
    rep = run(sc, paranoid=True)
    f = rep.failure
    assert not rep.passed and f.kind == "reassembly" and f.step == 0
    assert f.request_id == "chat-0" and f.group == build_layouts(sc)[0].name


def test_paranoid_does_not_mask_other_failures(monkeypatch):
    # shifted ranks: the union of the raw views is still the full context (paranoid reassembly is
    # satisfied) but every rank reads the wrong entries -> the per-rank check still fails.
    monkeypatch.setattr(model_runner, "slot_mapping", shifted_rank)
    rep = run(builtin("dsv3", 2, 1), paranoid=True)
    assert not rep.passed and rep.failure.kind == "wrong-content" and rep.failure.index == 0


# ----------------------------------------------------------------------------- digests


def test_multiset_digest_is_order_independent_and_additive():
    rng = np.random.default_rng(0)
    index = np.arange(100, dtype=np.int64)
    content = rng.integers(-2**62, 2**62, size=100, dtype=np.int64)
    d = multiset_digest(index, content)
    perm = rng.permutation(100)
    assert multiset_digest(index[perm], content[perm]) == d
    # shards add up (mod 2**64) to the whole: what the checker relies on for sharded groups
    parts = [multiset_digest(index[r::3], content[r::3]) for r in range(3)]
    assert sum(parts) % 2**64 == d
    assert multiset_digest(index[:0], content[:0]) == 0
    # any changed content, moved index, lost or duplicated entry changes it
    c2 = content.copy()
    c2[17] ^= 1
    assert multiset_digest(index, c2) != d
    i2 = index.copy()
    i2[17] = 1000
    assert multiset_digest(i2, content) != d
    assert multiset_digest(index[1:], content[1:]) != d
    assert multiset_digest(np.append(index, 5), np.append(content, content[5])) != d
    # the pair is bound: swapping contents between two indices changes it
    c3 = content.copy()
    c3[[3, 4]] = c3[[4, 3]]
    assert multiset_digest(index, c3) != d


def test_ordered_digest_is_order_dependent():
    rng = np.random.default_rng(1)
    index = np.arange(50, dtype=np.int64)
    content = rng.integers(-2**62, 2**62, size=50, dtype=np.int64)
    d = ordered_digest(index, content)
    assert ordered_digest(index.copy(), content.copy()) == d
    swapped = np.arange(50)
    swapped[[10, 11]] = [11, 10]
    assert ordered_digest(index[swapped], content[swapped]) != d
    assert ordered_digest(index[::-1], content[::-1]) != d
    assert ordered_digest(index[:-1], content[:-1]) != d
    c2 = content.copy()
    c2[0] += 1
    assert ordered_digest(index, c2) != d


# ----------------------------------------------------------------------------- the oracle


def _layouts(layers, W, I, k=3):
    cfg = SimConfig(max_model_len=4096, max_num_batched_tokens=256, decode_context_parallel_size=W,
                    cp_kv_cache_interleave_size=I, num_speculative_tokens=k)
    sc = Scenario(name="o", layers=layers, config=cfg, requests=(RequestSpec("r", 10, 10),))
    return {type(lay.spec).__name__ + ("/R" if lay.tokens_per_state > 1 else ""): lay
            for lay in build_layouts(sc)}


LAYERS = {
    "mla": MLAAttentionSpec(block_size=16, head_size=64),
    "mla2": MLAAttentionSpec(block_size=32, head_size=64, tokens_per_state=2),
    "swa": SlidingWindowMLASpec(block_size=16, head_size=64, sliding_window=128,
                                extra_retained_tokens=5, dcp_replicated=True),
    "chunk": ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,
                                       attention_chunk_size=24, dcp_replicated=True),
    "ring": CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=8, dcp_replicated=True),
}


def view(n, total=2000):
    fp = (np.arange(total, dtype=np.int64) * 7919 + 13)  # distinct per position
    return RequestView(0, "r", n, fp)


def local_len(L, r, W, I):
    """Doc section 2: local(L, r) = base + clamp(L - base*W - r*I, 0, I), base = (L // (I*W)) * I."""
    base = (L // (I * W)) * I
    return base + min(max(L - base * W - r * I, 0), I)


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 8), (4, 16)])
@pytest.mark.parametrize("n", [0, 1, 5, 16, 63, 64, 100, 777])
def test_expected_on_rank_partitions_expected_full(W, I, n):
    lays = _layouts(LAYERS, W, I)
    v = view(n)
    for key in ("MLAAttentionSpec", "MLAAttentionSpec/R"):
        lay = lays[key]
        full_i, full_c = expected_full(lay, v)
        if key.endswith("/R"):  # records c < n // 2, content of position 2c + 1
            assert list(full_i) == list(range(n // 2))
            assert list(full_c) == [int(v.fingerprints[2 * c + 1]) for c in range(n // 2)]
        else:
            assert list(full_i) == list(range(n))
        parts = [expected_on_rank(lay, v, r) for r in range(W)]
        allidx = np.concatenate([p[0] for p in parts])
        assert sorted(allidx.tolist()) == full_i.tolist()  # disjoint and complete
        for r, (idx, con) in enumerate(parts):
            assert list(idx) == sorted(idx)  # local (attention) order
            assert all((i // I) % W == r for i in idx.tolist())
            assert all(expected_owner(lay, i) == (r if W > 1 else None) for i in idx.tolist()[:5])
            assert len(idx) == local_len(len(full_i), r, W, I)
            pos = np.searchsorted(full_i, idx)
            assert np.array_equal(con, full_c[pos])


@pytest.mark.parametrize("W", [1, 2, 4])
def test_replicated_groups_expect_everything_on_every_rank(W):
    lays = _layouts(LAYERS, W, 1)
    v = view(300)
    for key in ("SlidingWindowMLASpec", "ChunkedLocalAttentionSpec", "CircularBufferSpec"):
        lay = lays[key]
        assert not lay.sharded and expected_owner(lay, 7) is None
        full = expected_full(lay, v)
        for r in range(W):
            got = expected_on_rank(lay, v, r)
            assert np.array_equal(got[0], full[0]) and np.array_equal(got[1], full[1])


@pytest.mark.parametrize("n,window,chunk,ring", [
    # window 128, extra 5: n - 127 - 5; chunk 24: 24 * (n // 24); ring C=8, k=3: n - (8 - 3)
    (0, 0, 0, 0),
    (3, 0, 0, 0),
    (5, 0, 0, 0),
    (6, 0, 0, 1),
    (23, 0, 0, 18),
    (24, 0, 24, 19),
    (47, 0, 24, 42),
    (48, 0, 48, 43),
    (132, 0, 120, 127),
    (133, 1, 120, 128),
    (300, 168, 288, 295),
    (1000, 868, 984, 995),
])
def test_retained_start_formulas(n, window, chunk, ring):
    lays = _layouts(LAYERS, 2, 1, k=3)
    assert retained_start(lays["SlidingWindowMLASpec"], n) == window
    assert retained_start(lays["ChunkedLocalAttentionSpec"], n) == chunk
    assert retained_start(lays["CircularBufferSpec"], n) == ring
    assert retained_start(lays["MLAAttentionSpec"], n) == 0
    v = view(n)
    idx, con = expected_full(lays["SlidingWindowMLASpec"], v)
    assert list(idx) == list(range(window, n))
    assert np.array_equal(con, v.fingerprints[window:n])


def test_block_table_rows():
    t = BlockTable("g", max_num_reqs=3, max_num_blocks_per_req=4)
    t.sync({0: np.array([5, 6]), 2: np.array([1, 2, 3, 4])}, {0: "a", 2: "c"})
    assert list(t.row(0)) == [5, 6] and list(t.row(2)) == [1, 2, 3, 4]
    t.sync({2: np.array([0, 2, 3])}, {})
    assert not t.holds(0) and list(t.row(2)) == [0, 2, 3]
    with pytest.raises(Exception, match="needs 5 block-table entries"):
        t.set_row(1, "b", np.arange(1, 6))


def test_all_configs_listed_are_valid():
    # W*I combos used above must be valid for every group of both built-ins (B = 64 states)
    for (W, I), name in itertools.product(CONFIGS, ["dsv3", "dsv41-hybrid"]):
        build_layouts(builtin(name, W, I))


def test_verify_every_checks_fewer_steps_and_the_last():
    sc = builtin("dsv3", 2, 1, verify_every=7)
    rep = run(sc)
    assert rep.passed
    expected = len({s for s in range(rep.steps) if s % 7 == 0} | {rep.steps - 1})
    assert rep.verifications == expected


def test_traffic_is_counted_per_job_when_one_world_runs_several():
    # One Collectives serves every job of a batch; each report must count only its own bytes.
    from dcpsim.simulation import Job, run_jobs

    job = Job(builtin("dsv3", 2, 1))
    reports = run_jobs([job, job, job], in_process=True)
    gathered = [r.bytes_gathered for r in reports]
    assert gathered[0] > 0 and gathered == [gathered[0]] * 3
    assert [r.ranks[0]["bytes_sent"] for r in reports] == [reports[0].ranks[0]["bytes_sent"]] * 3
