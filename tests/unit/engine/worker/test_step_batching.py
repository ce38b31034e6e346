"""The reference engine's batched step paths (``step_write_slots``, the query bounds of
``build_attention_metadata``) give exactly what the per-write methods give, and a subclass
that overrides one of the per-write methods is still called through it."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.interface import Engine
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage
from support.helpers import builtin, scheduler


def _steps(name, W, I=1):
    sched = scheduler(builtin(name, W, I))
    for plan in sched.plans():
        yield sched, plan


@pytest.mark.parametrize("name,W,I", [("dsv41-hybrid", 4, 1), ("dsv41-hybrid", 8, 2), ("qwen3-next-hybrid", 2, 1), ("dsv3", 1, 1)])
def test_batched_paths_equal_the_per_write_ones(name, W, I):
    engine = ReferenceEngine()
    batched = 0
    for sched, plan in _steps(name, W, I):
        writes = list(plan.writes)
        for g in sched.geometries:
            rows = [plan.rows_before[g.group_id].get(w.req_index, np.zeros(0, np.int64)) for w in writes]
            for r in range(W):
                if g.storage in (Storage.PAGED, Storage.RECORDS) and len(writes) > 2:
                    batched += 1
                got = engine.step_write_slots(g, writes, rows, r)
                want = Engine.step_write_slots(engine, g, writes, rows, r)
                assert [(s.tolist(), i.tolist()) for s, i in got] == [(s.tolist(), i.tolist()) for s, i in want]
                if g.storage not in (Storage.PAGED, Storage.RECORDS):
                    continue
                bounds = engine.build_attention_metadata(g, writes, rows, r).query_local_bounds
                per_write = [engine.query_local_bounds(g, w.start, w.stop, r) for w in writes]
                q = len(bounds) - sum(len(b) for b in per_write)  # CUDA-graph dummies' tokens
                assert bounds[: len(bounds) - q].tolist() == (np.concatenate(per_write).tolist() if per_write else [])
    assert batched  # the batched path ran


class _Marked(ReferenceEngine):
    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        return slots + 1000, index

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        return super().query_local_bounds(geometry, start, stop, dcp_rank) + 7


def test_an_override_is_not_bypassed():
    engine, ref = _Marked(), ReferenceEngine()
    seen = 0
    for sched, plan in _steps("dsv41-hybrid", 4):
        writes = list(plan.writes)
        for g in sched.geometries:
            if g.storage is not Storage.PAGED or len(writes) < 3:
                continue
            rows = [plan.rows_before[g.group_id][w.req_index] for w in writes]
            got = engine.step_write_slots(g, writes, rows, 1)
            want = ref.step_write_slots(g, writes, rows, 1)
            assert [s.tolist() for s, _ in got] == [(s + 1000).tolist() for s, _ in want]
            meta, base = engine.build_attention_metadata(g, writes, rows, 1), ref.build_attention_metadata(g, writes, rows, 1)
            n = sum(len(w.contents) for w in writes)
            assert (meta.query_local_bounds[:n] == base.query_local_bounds[:n] + 7).all()
            seen += 1
    assert seen


def _verify_rows(sched, plan, g):
    """The (context, query length) of the step's verify rows, as the worker asks for its mask."""
    q_max = 1 + g.num_speculative_tokens
    rows = [w for w in plan.writes if not w.prefill and w.start > 0 and 1 <= len(w.contents) <= q_max]
    return np.array([w.start for w in rows], np.int64), np.array([len(w.contents) for w in rows], np.int64)


@pytest.mark.parametrize("name,W,I", [("mtp-mask-interleave", 2, 16), ("dsv3-mtp", 4, 1), ("dsv3-mtp", 8, 2)])
def test_batched_spec_decode_masks_equal_the_per_row_ones(name, W, I):
    """The reference's spec-decode masks (one vectorized pass over the step's verify rows) are
    the interface's per-row default (``query_local_bounds`` and ``local_seq_lens`` per row)."""
    engine, rows_seen = ReferenceEngine(), 0
    for sched, plan in _steps(name, W, I):
        for g in sched.geometries:
            context, q_lens = _verify_rows(sched, plan, g)
            if not (g.sharded and g.storage is Storage.PAGED and g.num_speculative_tokens and len(q_lens)):
                continue
            for r in range(W):
                got = engine.spec_decode_mask(g, context, q_lens, r)
                want = Engine.spec_decode_mask(engine, g, context, q_lens, r)
                assert [(m.dtype, m.shape, m.tolist()) for m in got] == [(m.dtype, m.shape, m.tolist()) for m in want]
            rows_seen += len(q_lens)
    assert rows_seen


class _Lowered(ReferenceEngine):
    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        return np.maximum(super().query_local_bounds(geometry, start, stop, dcp_rank) - 1, 0)


def test_an_overridden_bound_reaches_the_spec_decode_mask():
    """A subclass's ``query_local_bounds`` (a fault's, an adapter's) shapes its masks: the
    vectorized pass stands for the reference's bounds only."""
    engine, ref, seen = _Lowered(), ReferenceEngine(), 0
    for sched, plan in _steps("dsv3-mtp", 4):
        for g in sched.geometries:
            context, q_lens = _verify_rows(sched, plan, g)
            if not len(q_lens):
                continue
            got, base = engine.spec_decode_mask(g, context, q_lens, 1), ref.spec_decode_mask(g, context, q_lens, 1)
            assert [np.maximum(m.sum(axis=1) - 1, 0).tolist() for m in base] == [m.sum(axis=1).tolist() for m in got]
            seen += 1
    assert seen
