"""The write path of one rank: apply a step's plan to the rank's block tables and KV stores.

The engine decides every slot (``Engine.write_slots``); this module only syncs the block
tables to the plan, writes fingerprint rows (and, for the attention check, K/V vectors)
where the engine said, and keeps the step's write log, which the checker judges. A slot
outside a store, or an index the step does not compute, is logged but not written.
"""

from __future__ import annotations

import numpy as np

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.interface import Engine
from dcpsim.engine.worker.block_table import BlockTable
from dcpsim.engine.worker.kv_store import KVStore
from dcpsim.model.kinds import Storage
from dcpsim.model.kv_entry import FIELDS
from dcpsim.model.layout import PAD
from dcpsim.model.plan import StepPlan, WriteRecord
from dcpsim.model.vectors import kv_vectors


class ModelRunner:
    def __init__(
        self,
        engine: Engine,
        geometries: list[GroupGeometry],
        pool_sizes: list[int],
        rank: int,
        max_num_reqs: int,
        vector_width: int = 0,
    ):
        """``vector_width > 0``: also store K/V vectors of that width (the attention check)."""
        self.engine = engine
        self.geometries = geometries
        self.rank = rank
        self.vector_width = vector_width
        self.block_tables = [BlockTable(g.name, max_num_reqs, g.block_table_width) for g in geometries]
        self.stores = [
            KVStore(g.group_id, n + 1, g.states_per_page,
                    vector_dim=vector_width if g.storage not in (Storage.RING, Storage.STATE) else 0)
            for g, n in zip(geometries, pool_sizes)
        ]
        self.write_log: list[WriteRecord] = []
        """What the last applied step wrote (every group, every request, in order)."""

    def apply(self, plan: StepPlan, request_ids: dict[int, str], during_step=None) -> None:
        """Write the step. ``during_step(plan, runner)``, if given, runs after the writes with
        the block tables the step ran with (before releases): the step's attention."""
        for table, step_rows in zip(self.block_tables, plan.rows_before):
            table.sync(step_rows, request_ids)
        self.write_log = []
        for geometry, table, store in zip(self.geometries, self.block_tables, self.stores):
            tps = geometry.tokens_per_state
            rows = [table.row(w.req_index) for w in plan.writes]
            mapped = self.engine.step_write_slots(geometry, list(plan.writes), rows, self.rank)
            for write, (slots, index) in zip(plan.writes, mapped):
                slots, index = np.asarray(slots, np.int64), np.asarray(index, np.int64)
                mine = slots != PAD
                slots, index = slots[mine], index[mine]
                self.write_log.append(WriteRecord(geometry.group_id, write.req_index, write.request_id, slots, index))
                # what a state holds: the KV of its position, or of the position emitting a
                # record; an index the step does not compute has no KV to store
                emit = index * tps + tps - 1 - write.start
                keep = (slots >= 0) & (slots < store.num_slots) & (emit >= 0) & (emit < len(write.contents))
                slots, index, content = slots[keep], index[keep], write.contents[emit[keep]]
                entries = np.empty((len(slots), len(FIELDS)), dtype=np.int64)
                entries[:, 0] = geometry.group_id
                entries[:, 1] = index
                entries[:, 2] = content
                entries[:, 3] = write.req_index
                entries[:, 4] = plan.step
                store.write(slots, entries)
                if store.vectors is not None:
                    store.write_vectors(slots, kv_vectors(geometry.group_id, content, self.vector_width))
        if during_step is not None:
            during_step(plan, self)
        for table, rows in zip(self.block_tables, plan.rows_after):
            table.sync(rows, request_ids)
