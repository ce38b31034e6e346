"""The scheduler's plan rows (``GroupManager.row_array``, a mirror kept in step with each
change) are exactly the managers' block lists, and stay as they were when later steps
release, grow, free or replace rows."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario
from support.helpers import scheduler


@pytest.mark.parametrize("name,W", [("dsv41-hybrid", 1), ("dsv41-hybrid", 4), ("dsv3", 2), ("llama4-scout", 2)])
def test_plan_rows_are_the_lists_and_stay_snapshots(name, W):
    sc = load_scenario(name).with_overrides(ScenarioOverrides(decode_context_parallel_size=W))
    sched = scheduler(sc)
    kept = []
    nulled = 0
    for plan in sched.plans():
        for g, m in enumerate(sched.managers):
            # after the step's frees of finished requests: every row still held is the plan's
            for r, blocks in m.blocks.items():
                assert plan.rows_after[g][r].tolist() == blocks, (plan.step, g, r)
            nulled += sum(int((row == 0).sum()) for row in plan.rows_after[g].values())
        kept.append(
            (
                plan,
                [{r: a.copy() for r, a in rows.items()} for rows in plan.rows_before],
                [{r: a.copy() for r, a in rows.items()} for rows in plan.rows_after],
            )
        )
    # released (or padded) entries were seen, so the mirror's in-place path ran (dsv3: full only)
    assert (nulled > 0) == (name != "dsv3")
    for plan, before, after in kept:
        for rows, copy in ((plan.rows_before, before), (plan.rows_after, after)):
            for g, group in enumerate(rows):
                assert group.keys() == copy[g].keys()
                for r, a in group.items():
                    assert np.array_equal(a, copy[g][r]), (plan.step, g, r)
