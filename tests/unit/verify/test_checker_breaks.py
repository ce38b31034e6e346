"""The checker against broken engines, end to end in one process (ranks as threads).

Each break is a small engine variant (a ``ReferenceEngine`` subclass changing one
decision) run with ``run(sc, engine=...)``, or a registered fault of
``dcpsim.engine.faults.FAULTS`` where one already stands for the bug. The run must
fail with the expected kind and a report that names the group, the request, the first bad
index, its expected owner and slot (computed here by hand from the plan's block-table
row), and what every rank holds there.

Two breaks corrupt the worker itself (what it stores, a rank's block table): the
``Engine`` interface decides slots and geometry but not contents or table rows, so those
patch ``ModelRunner.apply`` on the class object. Two more break the checker's own oracle
(``dcpsim.verify.check.expected_on_rank``) to provoke its second line of defence, which
no engine can reach: with a correct oracle, shards without a bad entry always reassemble.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import dcpsim.verify.check as check
from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import PAD
from dcpsim.model.specs import MLAAttentionSpec, SlidingWindowMLASpec
from dcpsim.verify.geometry import expected_groups
from support.helpers import builtin, geometries, run, scheduler

# ----------------------------------------------------------------------------- helpers


def plan_at(sc, step):
    """The plan of ``step`` from a fresh reference scheduler (the checker reads rows_after).
    The breaks below change no scheduling decision, so it is the broken run's plan too."""
    sched = scheduler(sc)
    for plan in sched.plans():
        if plan.step == step:
            return sched, plan
    raise AssertionError(f"no step {step}")


def group_index(sc, name):
    """The engine's (reference) group number of the group called ``name``."""
    return [g.name for g in geometries(sc)].index(name)


def expected_group(sc, name):
    """The checker's own geometry of the group called ``name``."""
    return next(g for g in expected_groups(sc) if g.name == name)


def slot_by_hand(group, row, p, *, W, I):
    """Semantics doc sections 2-3, one position: the slot its owner stores it in."""
    B = group.block_size
    if not group.sharded:
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


def stored_content(geometry, write, index):
    """What the worker stores for ``index`` of a write (the content of its position, or
    of the position emitting a record)."""
    tps = geometry.tokens_per_state
    return write.contents[index * tps + tps - 1 - write.start]


# ----------------------------------------------------------------------------- engine variants


class DropPosition(ReferenceEngine):
    """Index ``index`` of request ``request_id`` is never written, on any rank."""

    name = "drop-position"

    def __init__(self, request_id: str, index: int):
        self.request_id, self.index = request_id, index

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if write.request_id == self.request_id:
            slots = np.where(index == self.index, PAD, slots)
        return slots, index


class SkipRewriteOfRejected(ReferenceEngine):
    """The write path forgets to rewrite a write's first index when it holds a rejected
    draft (the index was last written with other contents). Stateful: one instance per run."""

    name = "skip-rewrite-of-rejected"

    def __init__(self):
        self._last: dict[tuple[int, int, int], dict[int, int]] = {}

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        content = stored_content(geometry, write, index)
        seen = self._last.setdefault((dcp_rank, geometry.group_id, write.req_index), {})
        skip = np.zeros(len(slots), dtype=bool)
        for j, (i, c) in enumerate(zip(index.tolist(), content.tolist())):
            if i == write.start and i in seen and seen[i] != c:
                skip[j] = True
        for i, c in zip(index.tolist(), content.tolist()):
            seen[i] = c
        return np.where(skip, PAD, slots), index


class NarrowMLATable(ReferenceEngine):
    """Block-table rows of 2 entries for every MLA group."""

    name = "narrow-mla-table"

    def group_geometry(self, group_id, group, config):
        geometry = super().group_geometry(group_id, group, config)
        if isinstance(geometry.group_spec, MLAAttentionSpec):
            geometry = dataclasses.replace(geometry, block_table_width=2)
        return geometry


def test_the_variants_change_nothing_when_they_do_not_fire():
    # each variant is the reference engine except for its one decision: a variant that
    # matches nothing passes (so every failure below comes from the break itself)
    sc = builtin("dsv3", 2, 1)
    assert run(sc, engine=DropPosition("no-such-request", 0)).passed
    assert run(sc, engine=DropPosition("chat-0", 10**9)).passed


def test_break_dropped_position_is_wrong_content():
    # dsv3, W=2, I=1: position 300 of chat-0 is written at step 1 ([256, 512)). Owner 300 % 2 = 0.
    # Virtual block 300 // 128 = 2, offset 44, local offset 44 // 2 = 22: slot row[2] * 64 + 22.
    sc = builtin("dsv3", 2, 1)
    rep = run(sc, engine=DropPosition("chat-0", 300))
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner, f.further_bad) == (1, "chat-0", 300, 0, 0)
    _, plan = plan_at(sc, 1)
    row = plan.rows_after[0][0]
    assert f.expected_slot == int(row[2]) * 64 + 22 == slot_by_hand(expected_groups(sc)[0], row, 300, W=2, I=1)
    assert f.block_table == [int(b) for b in row]  # the row behind expected_slot
    assert f.holdings[0].index == -1 and f.holdings[0].found_at == []
    assert f.holdings[1].index == 301  # rank 1's local 22 of that virtual block
    assert_named(f, 2)


def test_break_stale_rejected_draft_is_wrong_content():
    # dsv3, W=2, I=1, k=3, chat-0 acceptance [3, 1, 0, 2]: step 3 writes [600, 604), 3/3
    # accepted; step 4 writes [604, 608), 1/3 accepted -> committed 606, positions 606, 607 hold
    # rejected drafts; step 5 must rewrite 606 with the true token but skips it; after step 5
    # (0/3 accepted, committed 607) rank 606 % 2 = 0 still holds the draft written at step 4.
    sc = builtin("dsv3", 2, 1)
    rep = run(sc, engine=SkipRewriteOfRejected())
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (5, "chat-0", 606, 0)
    h = f.holdings[0]
    assert h.index == 606 and h.writer == "chat-0" and h.step == 4 and f.last_write_step == 4
    assert h.content != f.expected_content
    assert_named(f, 2)


def test_break_stale_rejected_draft_in_replicated_and_ring_groups():
    sc = builtin("dsv41-hybrid", 2, 1)
    rep = run(sc, engine=SkipRewriteOfRejected())
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content"
    stale = [h for h in f.holdings if h.index == f.index]
    assert stale and all(h.step < f.step and h.content != f.expected_content for h in stale)
    assert_named(f, 2)


def test_break_block_table_too_narrow():
    # dsv3 W=2: 2 entries of 128 tokens where the builder expects 32; chat-0 would overflow at
    # step 1 ([256, 512)), but the worker's table width is judged at step 0 already
    rep = run(builtin("dsv3", 2, 1), engine=NarrowMLATable())
    f = rep.failure
    assert not rep.passed and f.kind == "attention-metadata" and f.step == 0
    assert f.group.startswith("MLAAttention[")
    assert any("block table width (worker) is 2, expected >= 32" in d for d in f.details), f.details


class TableWidth(ReferenceEngine):
    """Every paged group's worker rows ``width(least)`` entries wide (``least``: the longest
    context in the group's shards), the builder told the same, or ``builder`` entries more."""

    name = "table-width"

    def __init__(self, width, builder=0):
        self.width, self.builder = width, builder

    def group_geometry(self, group_id, group, config):
        g = super().group_geometry(group_id, group, config)
        if g.storage is Storage.PAGED:
            least = -(-config.max_model_len // g.manager_block_size)
            g = dataclasses.replace(g, block_table_width=self.width(least))
        return g

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        return dataclasses.replace(meta, block_table_width=meta.block_table_width + self.builder)


@pytest.mark.parametrize("width", [lambda n: n, lambda n: n + 3, lambda n: 4 * n], ids=["exact", "unaligned", "wide"])
def test_any_worker_width_that_holds_the_longest_context_passes(width):
    # vLLM 0.33.0 rounds rows up to 128 tokens, vllm-ascend does not: the semantics ask only
    # that a row hold max_model_len in the group's shards, and that the builder agree
    assert run(builtin("dsv3", 2, 1), engine=TableWidth(width)).passed


def test_break_builder_width_not_the_workers():
    rep = run(builtin("dsv3", 2, 1), engine=TableWidth(lambda n: n + 3, builder=1))
    f = rep.failure
    assert not rep.passed and f.kind == "attention-metadata" and f.step == 0
    assert any("block_table_width is 36, expected 35 (the worker's)" in d for d in f.details), f.details


# ----------------------------------------------------------------------------- worker breaks

_orig_apply = ModelRunner.apply


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
    def on_rank(group, view, rank):
        index, content = _orig_on_rank(group, view, rank)
        if rank == 1 and group.sharded:
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
    def on_rank(group, view, rank):
        index, content = _orig_on_rank(group, view, rank)
        if rank == 1 and not group.sharded:
            return index[1:], content[1:]
        return index, content

    monkeypatch.setattr(check, "expected_on_rank", on_rank)
    rep = run(builtin("dsv41-hybrid", 2, 1))
    f = rep.failure
    assert not rep.passed and f.kind == "replicas-differ"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (0, "chat-0", 129, "all")
    assert_named(f, 2)


# ----------------------------------------------------------------------------- registered faults
# The report of each registered fault that a hand-made break used to duplicate, in detail.


def _interleave_off_by_one(sc, f, W):
    # dsv3, W=2, I=1, B=64. Step 0 writes chat-0 [0, 256) into blocks [1, 2]. Each rank writes
    # the positions of the other: rank 0 holds the odd positions, at its local index 0 (slot
    # 1*64 + 0 = 64) it has position 1, and rank 1 has position 0 at its slot 64.
    assert f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (0, "chat-0", 0, 0)
    _, plan = plan_at(sc, 0)
    group = expected_groups(sc)[0]
    assert f.group == group.name
    assert f.expected_slot == slot_by_hand(group, plan.rows_after[0][0], 0, W=2, I=1) == 64
    assert f.holdings[0].index == 1 and f.holdings[1].index == 0
    assert f.expected_content == int(plan.views[0].fingerprints[0])
    assert f.holdings[1].content == f.expected_content != f.holdings[0].content
    assert f.further_bad == 255  # every one of the 256 positions is misplaced
    assert_named(f, 2)


def _replicated_owner_only(sc, f, W):
    # dsv41-hybrid: the sliding-window group (window 128, B 64) is replicated. After step 0
    # chat-0 has 256 committed tokens, the window keeps [256 - 127, 256) = [129, 256). Only the
    # owner 129 % W (rank 1 for W=2, rank 0 for W=3) holds 129; every other rank misses it.
    assert f.kind == "wrong-content"
    assert (f.step, f.request_id, f.index, f.expected_owner) == (0, "chat-0", 129, "all")
    g = group_index(sc, f.group)
    geometry, group = geometries(sc)[g], expected_group(sc, f.group)
    assert isinstance(geometry.spec, SlidingWindowMLASpec) and geometry.replicated
    assert group.retention is Retention.WINDOW and not group.sharded
    _, plan = plan_at(sc, 0)
    row = plan.rows_after[g][0]
    assert list(row[:2]) == [0, 0]  # released: wholly below 129
    assert f.block_table == [int(b) for b in row]
    assert f.expected_slot == slot_by_hand(group, row, 129, W=W, I=1) == int(row[2]) * 64 + 1
    for r in range(W):
        assert f.holdings[r].index == (129 if r == 129 % W else -1)  # -1: never written
    assert_named(f, W)


def _foreign_block(sc, f, W):
    assert f.kind == "write-violation" and f.step == 0
    name = expected_groups(sc)[0].name
    text = "\n".join(f.details)
    for r in range(W):
        assert f"rank {r} step 0 group {name} request chat-0" in text
    assert "does not hold" in text
    assert "write violation" in "\n".join(f.lines())


def _replicated_scaled_by_w(sc, f, W):
    # dsv41-hybrid W=4: the window group's table gets cdiv(4096, 64*4) = 16 entries where the
    # builder expects cdiv(4096, 64) = 64 (long-doc would overflow it later): caught at step 0
    assert f.kind == "attention-metadata" and f.step == 0
    assert f.group.startswith("SlidingWindowMLA[")
    assert any("block table width (worker) is 16, expected >= 64" in d for d in f.details), f.details


REPORT_CHECKS = {
    "interleave-off-by-one": _interleave_off_by_one,
    "replicated-owner-only": _replicated_owner_only,
    "foreign-block": _foreign_block,
    "replicated-scaled-by-w": _replicated_scaled_by_w,
}

FAULT_REPORTS = [
    ("interleave-off-by-one", "dsv3", 2),
    ("replicated-owner-only", "dsv41-hybrid", 2),
    ("replicated-owner-only", "dsv41-hybrid", 3),
    ("foreign-block", "dsv3", 2),
    ("replicated-scaled-by-w", "dsv41-hybrid", 4),
]


@pytest.mark.parametrize("fault,name,W", FAULT_REPORTS, ids=[f"{f}-{n}-W{w}" for f, n, w in FAULT_REPORTS])
def test_registered_fault_report(fault, name, W):
    engine = FAULTS[fault]
    sc = builtin(name, W, 1)
    assert engine.applies_to_scenario(sc, geometries(sc))
    rep = run(sc, engine=engine)
    assert not rep.passed and rep.failure is not None
    REPORT_CHECKS[fault](sc, rep.failure, W)


@pytest.mark.parametrize("fault", ["foreign-block"])
def test_write_violation_failure_has_structured_fields(fault):
    f = run(builtin("dsv3", 2, 1), engine=FAULTS[fault]).failure
    assert f.kind == "write-violation"
    assert f.group is not None and f.request_id == "chat-0" and f.index is not None
    assert f.violations and {"rank", "slot", "reason", "count"} <= set(f.violations[0])
    # the request's own row, which the violating slot's block is not in
    assert f.block_table and f.violations[0]["slot"] // 64 not in f.block_table


def test_paranoid_catches_a_break():
    sc = builtin("dsv41-hybrid", 2, 1)
    rep = run(sc, engine=FAULTS["replicated-owner-only"], paranoid=True)
    f = rep.failure
    assert not rep.passed and f.kind == "reassembly" and f.step == 0
    assert f.request_id == "chat-0" and f.group == expected_groups(sc)[0].name


def test_paranoid_does_not_mask_other_failures():
    # ranks writing each other's positions: the union of the raw views is still the full context
    # (paranoid reassembly is satisfied) but every rank reads the wrong entries -> the per-rank
    # check still fails.
    rep = run(builtin("dsv3", 2, 1), engine=FAULTS["interleave-off-by-one"], paranoid=True)
    assert not rep.passed and rep.failure.kind == "wrong-content" and rep.failure.index == 0
