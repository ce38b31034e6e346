"""One run of a schedule per interleave size, its sharded groups' loads per rank
(``dcpsim interleave``): the engine's write path (``engine.serial_ranks``) fed to the
statistics of ``dcpsim.views.interleave``."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.interface import Engine
from dcpsim.engine.serial_ranks import SerialRanks
from dcpsim.model.scenario import Scenario
from dcpsim.views.interleave import GroupStep, InterleaveStats


def interleave_stats(scenario: Scenario, engine: Engine | None = None) -> list[tuple[GroupGeometry, dict]]:
    """Run the schedule once; the ``InterleaveStats`` result of every sharded group."""
    ranks = SerialRanks(scenario, engine)
    sharded = [g for g in ranks.geometries if g.sharded]
    stats = {g.group_id: InterleaveStats(ranks.dcp_size) for g in sharded}
    for plan, logs in ranks.steps():
        for g in sharded:
            records = tuple(tuple(rec for rec in log if rec.group == g.group_id) for log in logs)
            stops = [w.stop for w in plan.writes]
            local = ranks.local_lens(g, stops) if stops else np.zeros((0, ranks.dcp_size), dtype=np.int64)
            stats[g.group_id].add(GroupStep(plan.writes, records, local))
    requests = ranks.scheduler.requests
    out = []
    for g in sharded:
        final = ranks.entries(g, [r.num_computed for r in requests])
        local = ranks.local_lens(g, [r.num_computed for r in requests])
        result = stats[g.group_id].result(
            {r.index: int(n) for r, n in zip(requests, final)}, {r.index: lens for r, lens in zip(requests, local)}
        )
        out.append((g, result))
    return out
