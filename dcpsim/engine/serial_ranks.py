"""``SerialRanks``: the engine's write path of a schedule for every rank, one after another in
this thread. No checker and no world (the ranks of the write path never talk to each
other), so analyses can run a schedule many times cheaply (``dcpsim interleave``,
``dcpsim.campaigns.interleave``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.interface import Engine
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.model.kinds import Storage
from dcpsim.model.plan import StepPlan, WriteRecord
from dcpsim.model.scenario import Scenario


class SerialRanks:
    def __init__(self, scenario: Scenario, engine: Engine | None = None):
        self.engine = engine or ReferenceEngine()
        self.dcp_size = scenario.config.decode_context_parallel_size
        self.geometries = self.engine.geometries(scenario.layers, scenario.config)
        self.scheduler = self.engine.make_scheduler(scenario, self.geometries)
        self.request_ids = {r.index: r.request_id for r in self.scheduler.requests}
        pools = self.scheduler.pool_sizes
        self.runners = [
            ModelRunner(self.engine, self.geometries, pools, rank, max_num_reqs=len(self.request_ids)) for rank in range(self.dcp_size)
        ]

    def steps(self) -> Iterator[tuple[StepPlan, list[list[WriteRecord]]]]:
        """Every step's plan and each rank's write log of it."""
        for plan in self.scheduler.plans():
            logs = []
            for runner in self.runners:
                runner.apply(plan, self.request_ids)
                logs.append(runner.write_log)
            yield plan, logs

    def entries(self, geometry: GroupGeometry, lengths) -> np.ndarray:
        """Entries (positions, or records emitted) of contexts of ``lengths`` tokens."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return lengths // geometry.tokens_per_state if geometry.storage is Storage.RECORDS else lengths

    def local_lens(self, geometry: GroupGeometry, lengths) -> np.ndarray:
        """``[len(lengths), W]``: what each rank holds of contexts of ``lengths`` tokens."""
        entries = self.entries(geometry, lengths)
        return np.stack(
            [np.asarray(self.engine.local_seq_lens(geometry, entries, r), dtype=np.int64).reshape(-1) for r in range(self.dcp_size)], axis=1
        )
