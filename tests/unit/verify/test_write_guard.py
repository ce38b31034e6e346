"""The write guard's all-at-once judgement of a step (``WriteGuard._judge_inside``) reports
exactly what judging each write on its own (``_judge_each``) does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dcpsim.model.plan import WriteRecord
from dcpsim.verify.write_guard import WriteGuard


def _step(rng, shapes: dict, most: int):
    """A step of 3 requests' writes into every group of ``shapes`` (group -> blocks, slots a
    block), each of up to ``most`` distinct slots: a slot twice comes from two writes."""
    rows = ({}, {})
    writes = []
    for req in range(3):
        for g, (blocks, per_block) in shapes.items():
            rows[g][req] = rng.choice(np.arange(1, blocks), size=rng.integers(0, 4), replace=False)
            n = int(rng.integers(0, most))
            slots = rng.choice(np.arange(per_block, blocks * per_block), size=n, replace=False)  # inside, off the null block
            writes.append(WriteRecord(g, req, f"r{req}", slots, np.arange(1000 * req, 1000 * req + n)))
    return SimpleNamespace(step=3, rows_before=rows), writes, shapes


# below 640 slots (distinct.TABLE_MIN) a step's slots are keyed by group; from 640 on apart by each group's range
SMALL, LARGE = ({0: (12, 4), 1: (9, 8)}, 6), ({0: (60, 32), 1: (40, 64)}, 500)


@pytest.mark.parametrize("shapes, most", [SMALL, LARGE])
def test_judging_a_step_at_once_reports_what_judging_each_write_does(shapes, most):
    rng = np.random.default_rng(0)
    caught = 0
    for _ in range(200):
        plan, writes, shapes = _step(rng, shapes, most)
        together, each = WriteGuard(0, {0: "a", 1: "b"}), WriteGuard(0, {0: "a", 1: "b"})
        together._step = each._step = plan.step
        assert together._judge_inside(plan, [w for w in writes if len(w.slots)], shapes)
        each._judge_each(plan, [w for w in writes if len(w.slots)], shapes)
        assert (together.count, together.kept) == (each.count, each.kept)
        caught += together.count > 0
    assert caught > 100  # the draws do put writes into foreign blocks and slots twice


def test_a_slot_outside_the_store_is_judged_write_by_write():
    plan = SimpleNamespace(step=1, rows_before=({0: np.array([1, 2])},))
    writes = [WriteRecord(0, 0, "r0", np.array([4, 5, 99]), np.array([0, 1, 2]))]
    guard = WriteGuard(0, {0: "a"})
    guard.judge(plan, writes, {0: (3, 4)})
    assert [v.reason for v in guard.kept] == ["slot outside the KV store"]
