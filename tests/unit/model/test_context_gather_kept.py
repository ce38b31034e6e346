"""The context gather over many steps: the engine's kept slots (``model.context_gather.ContextSlots``,
through ``ReferenceEngine.context_gather``) and the checker's (``verify.context_gather``, the
``kept`` of ``expected_gather``) give exactly what a derivation from scratch gives, step after
step, over a schedule that changes what they keep: chunked prefills over long contexts split
into many chunks, several requests, a request preempted and recomputed on fresh blocks, one
finishing and its id reused by a new request with a prefix hit, one whose row keeps its first
blocks and gets new ones past them. The plans computed per request equal the chunk-by-chunk
walks, and no array handed out earlier changes afterwards."""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.context_gather import ContextSlots, plan_chunks, plan_chunks_walk, workspace_size
from dcpsim.model.plan import ReqWrite, StepPlan
from dcpsim.verify.context_gather import expected_entries, expected_entries_walked, expected_gather, expected_workspace, judge_gathers
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.metadata import MetadataJudge
from support.helpers import fault_scenario, geometries

FIELDS = ("chunks", "starts", "seq_lens", "local_starts", "local_seq_lens", "slots")


class _EntryByEntry(ReferenceEngine):
    """The reference's gather entry by entry (its ``gather_local`` overridden, unchanged): no
    kept slots, every slot read from the row each step (the derivation from scratch)."""

    def gather_local(self, g, context, start, length, dcp_rank):
        return super().gather_local(g, context, start, length, dcp_rank)


class _Schedule:
    """A hand-driven schedule of prefills on one group: each request writes ``chunk`` prompt
    tokens a step (then one decode token), over a row of shuffled block ids grown as needed."""

    def __init__(self, unit: int, seed: int):
        self.unit, self.rng = unit, random.Random(seed)
        self.free = list(range(1, 5000))
        self.rng.shuffle(self.free)
        self.live: dict[int, dict] = {}
        self.changed: list[tuple[int, str]] = []  # (step, request) whose row changed under kept keys

    def add(self, index: int, rid: str, prompt: int, chunk: int, done: int = 0) -> None:
        self.live[index] = dict(id=rid, prompt=prompt, chunk=chunk, done=done, row=[])

    def preempt(self, index: int, keep_blocks: int = 0, hit_blocks: int = 0) -> None:
        """The request loses its blocks past the first ``keep_blocks`` and is admitted again
        with ``hit_blocks`` more of them found in the prefix cache on other blocks."""
        r = self.live[index]
        r["row"] = r["row"][:keep_blocks] + [self.free.pop() for _ in range(hit_blocks)]
        r["done"] = len(r["row"]) * self.unit

    def plan(self, step: int) -> StepPlan:
        writes, rows = [], {}
        for index, r in self.live.items():
            n = min(r["chunk"], r["prompt"] - r["done"]) or 1
            stop = r["done"] + n
            while len(r["row"]) * self.unit < stop:
                r["row"].append(self.free.pop())
            rows[index] = np.array(r["row"], dtype=np.int64)
            writes.append(ReqWrite(index, r["id"], r["done"], np.arange(n, dtype=np.int64), prefill=n > 1))
            r["done"] = stop
        return StepPlan(step, tuple(writes), (rows,), (), (rows,))


def _schedule(unit: int, seed: int):
    """The steps: three requests prefilling in chunks; r0 preempted at step 4 and admitted
    again at once with a prefix hit of 3 blocks held elsewhere (a context on a new row), r1
    finishing at step 8 and its id reused in that step by a request admitted with a prefix hit
    (a context from its first step, on fresh blocks), r2 keeping its first two blocks and
    getting new ones past them at step 9."""
    s = _Schedule(unit, seed)
    s.add(0, "r0", 3000, 160)
    s.add(1, "r1", 1500, 96)
    s.add(2, "r2", 2600, 224)
    for step in range(16):
        if step == 4:
            s.preempt(0, hit_blocks=3)
        if step == 8:
            del s.live[1]
            s.add(3, "r1", 2000, 128, done=512)
        if step == 9:
            s.preempt(2, keep_blocks=2)
        yield s.plan(step)


def _rows_of(plan: StepPlan) -> list[np.ndarray]:
    return [plan.rows_before[0][w.req_index] for w in plan.writes]


def _same_gather(a, b) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        assert a.request_ids == b.request_ids and a.workspace_size == b.workspace_size
        for name in FIELDS:
            assert getattr(a, name).dtype == np.int64 and np.array_equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("W,I", [(1, 1), (2, 4), (4, 1), (4, 16)])
def test_kept_slots_give_the_plans_derived_from_scratch_over_many_steps(W, I):
    sc = fault_scenario("dsv3", decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, chunked_prefill_workspace_size=256)
    g, group = geometries(sc)[0], expected_groups(sc)[0]
    S = expected_workspace(group, sc.config)
    assert S == g.chunked_prefill_workspace_size
    engine, scratch = ReferenceEngine(), _EntryByEntry()
    kept_by_rank: list[dict] = [{} for _ in range(W)]
    handed: list[tuple] = []  # every gather handed out, with the one derived from scratch then
    split = changed = 0
    last_rows: dict[str, np.ndarray] = {}
    for plan in _schedule(g.manager_block_size, seed=W * 100 + I):
        k = g.num_speculative_tokens
        contexts = [w.start for w in plan.writes if w.stop - w.start > 1 + k]
        kw = dict(workspace=S, block_size=g.block_size, dcp_size=W, interleave_size=I)
        assert plan_chunks(contexts, **kw) == plan_chunks_walk(contexts, **kw)
        assert expected_entries(group, contexts, S) == expected_entries_walked(group, contexts, S) == plan_chunks(contexts, **kw)
        for w in plan.writes:  # a row that changed under a context the caches hold
            old, row = last_rows.get(w.request_id), plan.rows_before[0][w.req_index]
            n = min(len(old), len(row)) if old is not None else 0
            changed += w.start > 0 and old is not None and not np.array_equal(old[:n], row[:n])
            last_rows[w.request_id] = row
        for r in range(W):
            got = engine.context_gather(g, list(plan.writes), _rows_of(plan), r)
            want = scratch.context_gather(g, list(plan.writes), _rows_of(plan), r)
            _same_gather(got, want)
            have = expected_gather(group, plan, plan.rows_before[0], r, S, kept_by_rank[r])
            fresh = expected_gather(group, plan, plan.rows_before[0], r, S)
            assert (have is None) == (fresh is None) == (got is None)
            if got is None:
                continue
            split += int(len(got.chunks) > len(set(got.request_ids)))
            for name in ("request_ids", "chunks", "starts", "seq_lens", "local_starts", "local_seq_lens", "every_slot"):
                assert np.array_equal(have[name], fresh[name]), name
            assert all(np.array_equal(a, b) for a, b in zip(have["slots"], fresh["slots"], strict=True))
            assert np.array_equal(got.slots, fresh["every_slot"])  # the engine and the checker agree
            handed.append((got, want, have["every_slot"], fresh["every_slot"]))
    assert split and changed >= 3, (split, changed)  # chunks split, and every row change met a kept context
    for got, want, have, fresh in handed:  # nothing handed out was written over by a later step
        _same_gather(got, want)
        assert np.array_equal(have, fresh)


def test_a_kept_context_on_a_new_row_is_read_through_the_new_row():
    """The case a stale cache gets wrong: the same request, the same context, other blocks."""
    sc = fault_scenario("dsv3", decode_context_parallel_size=2, cp_kv_cache_interleave_size=4, chunked_prefill_workspace_size=256)
    g, group = geometries(sc)[0], expected_groups(sc)[0]
    unit = g.manager_block_size
    write = ReqWrite(0, "r0", 5 * unit, np.arange(64, dtype=np.int64), prefill=True)
    engine, kept = ReferenceEngine(), {}
    seen = []
    for blocks in (np.arange(1, 7), np.arange(11, 17), np.r_[1:3, 21:25]):
        rows = {0: blocks.astype(np.int64)}
        plan = StepPlan(0, (write,), (rows,), (), (rows,))
        got = engine.context_gather(g, [write], [rows[0]], 1)
        have = expected_gather(group, plan, rows, 1, g.chunked_prefill_workspace_size, kept)
        fresh = _EntryByEntry().context_gather(g, [write], [rows[0]], 1)
        assert np.array_equal(got.slots, fresh.slots) and np.array_equal(have["every_slot"], fresh.slots)
        seen.append((got.slots, have["every_slot"], fresh.slots))
    assert not np.array_equal(seen[0][2], seen[1][2]) and not np.array_equal(seen[1][2], seen[2][2])
    for got, have, fresh in seen:  # one request: each side handed out a view of what it keeps, unchanged since
        assert np.array_equal(got, fresh) and np.array_equal(have, fresh)


def test_the_judge_keeps_its_slots_across_steps_and_still_catches_the_fault():
    from dcpsim.engine.faults import FAULTS

    sc = fault_scenario("dsv3", decode_context_parallel_size=2, cp_kv_cache_interleave_size=4, chunked_prefill_workspace_size=64)
    g = geometries(sc)[0]
    fault = type(FAULTS["context-gather-whole-local-len"])()
    judges = {name: MetadataJudge(1, expected_groups(sc), [0], sc.config.max_model_len, (), config=sc.config) for name in ("ref", "fault")}
    engines = {"ref": ReferenceEngine(), "fault": fault}
    for plan in _schedule(g.manager_block_size, seed=3):
        for name, judge in judges.items():
            gather = engines[name].context_gather(g, list(plan.writes), _rows_of(plan), 1)
            judge_gathers(judge, plan, [] if gather is None else [gather])
    assert judges["ref"].count == 0 and judges["ref"].gather_checks > 10
    assert judges["ref"].gather_slots[0]  # the requests of the last step are kept
    assert judges["fault"].count > 0


def test_kept_slots_are_not_carried_by_a_copy_or_a_pickle():
    sc = fault_scenario("dsv3", decode_context_parallel_size=2, chunked_prefill_workspace_size=256)
    g = geometries(sc)[0]
    engine = ReferenceEngine()
    plan = next(p for p in _schedule(g.manager_block_size, seed=1) if p.step == 2)
    assert engine.context_gather(g, list(plan.writes), _rows_of(plan), 0) is not None
    kept = engine._context_slots()
    assert kept._scopes
    for other in (pickle.loads(pickle.dumps(engine)), copy.deepcopy(engine)):
        assert isinstance(other._context_slots(), ContextSlots) and not other._context_slots()._scopes


def test_the_default_workspace_plan_of_a_10m_context_is_computed_per_request():
    S = workspace_size(None, max_model_len=10485760, max_num_seqs=256, block_size=64, dcp_size=8, interleave_size=1)
    kw = dict(workspace=S, block_size=64, dcp_size=8, interleave_size=1)
    for contexts in ([10485496 - 16384], [100, 10_000_000, 0, 70_000, 5]):
        assert plan_chunks(contexts, **kw) == plan_chunks_walk(contexts, **kw)


class _Group:
    """The few fields of ``ExpectedGroup`` the checker's packing reads."""

    def __init__(self, B, W, I):
        self.block_size, self.dcp_size, self.interleave_size, self.sharded = B, W, I, W > 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.just(0), st.integers(1, 300), st.integers(1, 20000)), min_size=0, max_size=7),
    st.sampled_from([(1, 1), (2, 1), (2, 4), (4, 2), (3, 16), (8, 1), (8, 64)]),
    st.sampled_from([16, 32, 64]),
    st.integers(1, 3000),
    st.booleans(),
)
def test_the_per_request_plans_are_the_chunk_by_chunk_walks(contexts, layout, B, want, aligned):
    """On vLLM's aligned workspace and on a raw one (where a chunk takes at least one alignment)."""
    W, I = layout
    S = workspace_size(want, max_model_len=0, max_num_seqs=1, block_size=B, dcp_size=W, interleave_size=I) if aligned else want
    align = np.lcm(B, W * I) if W > 1 else B
    if S // W * W // align * align == 0:  # not one alignment in a chunk: the walk never ends either
        return
    kw = dict(workspace=S, block_size=B, dcp_size=W, interleave_size=I)
    walked = plan_chunks_walk(contexts, **kw)
    assert plan_chunks(contexts, **kw) == walked
    assert expected_entries(_Group(B, W, I), contexts, S) == expected_entries_walked(_Group(B, W, I), contexts, S) == walked
