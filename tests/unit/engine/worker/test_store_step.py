"""A group's writes of a step reach its store in one pass (``ModelRunner._store_step``, as vLLM's
one cache write over the step's ``slot_mapping``): every store ends exactly as when the step is
stored request by request, and where two requests write one slot the later one's entry lands last."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.worker.model_runner import ModelRunner
from support.helpers import builtin, scheduler


class PerRequest(ModelRunner):
    """The same runner, storing entry by entry in request order: the test's own reading of what a
    slot holds (the entry of the write's position, or of the position emitting a record)."""

    def _store_step(self, step, geometry, store, logged):
        tps = geometry.tokens_per_state
        for write, slots, index in logged:
            for slot, i in zip(slots.tolist(), index.tolist()):
                emit = i * tps + tps - 1 - write.start
                if 0 <= slot < store.num_slots and 0 <= emit < len(write.contents):
                    row = [geometry.group_id, i, int(write.contents[emit]), write.req_index, step]
                    store.write(np.array([slot]), np.array([row], dtype=np.int64))


class SharedFirstSlot(ReferenceEngine):
    """Writes every request's first written entry also to the slot of the step's first request's."""

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        mapped = super().step_write_slots(geometry, writes, block_rows, dcp_rank)
        first = next((s[s >= 0][:1] for s, _ in mapped if (s >= 0).any()), None)
        if first is None or not len(first):
            return mapped
        out = []
        for slots, index in mapped:
            mine = np.flatnonzero(np.asarray(slots) >= 0)[:1]
            out.append((np.concatenate([slots, first]), np.concatenate([index, index[mine]])) if len(mine) else (slots, index))
        return out


def _replay(name: str, W: int, rank: int, engine) -> tuple[int, int]:
    """Apply every step to a runner and to a per-request one; their stores must agree after each.
    Returns, of the (step, group)s where several requests wrote: how many were stored in one pass,
    and how many request by request."""
    sched = scheduler(builtin(name, W), engine)
    runners = [cls(engine, sched.geometries, sched.pool_sizes, rank, max_num_reqs=len(sched.requests)) for cls in (ModelRunner, PerRequest)]
    ids = {r.index: r.request_id for r in sched.requests}
    one_pass = by_request = 0
    calls: list[tuple[int, int]] = []
    real = ModelRunner._store_entries
    runners[0]._store_entries = lambda step, geometry, store, logged, slots=None: (
        calls.append((geometry.group_id, len(logged))),
        real(runners[0], step, geometry, store, logged, slots),
    )
    for plan in sched.plans():
        calls.clear()
        for runner in runners:
            runner.apply(plan, ids)
        writers: dict[int, int] = {}
        for record in runners[0].write_log:
            if len(record.slots):
                writers[record.group] = writers.get(record.group, 0) + 1
        for g, n in writers.items():
            if n > 1:
                by_request += (g, 1) in calls
                one_pass += (g, n) in calls
        for a, b in zip(runners[0].stores, runners[1].stores):
            assert np.array_equal(a.data.numpy(), b.data.numpy()), (name, W, rank, plan.step)
            assert a.take_written().tolist() == b.take_written().tolist()
    return one_pass, by_request


@pytest.mark.parametrize("name, W, rank", [("many-short", 4, 1), ("dsv41-hybrid", 2, 0), ("prefix-sharing", 2, 1)])
def test_a_step_stored_in_one_pass_equals_it_stored_request_by_request(name, W, rank):
    one_pass, by_request = _replay(name, W, rank, ReferenceEngine())
    assert one_pass and not by_request, (one_pass, by_request)


def test_a_slot_two_requests_write_is_stored_request_by_request():
    """The later request's entry lands last, as when each request is stored on its own."""
    one_pass, by_request = _replay("many-short", 2, 0, SharedFirstSlot())
    assert by_request and not one_pass, (one_pass, by_request)
