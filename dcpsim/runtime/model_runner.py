"""The write path of one rank: apply a step's plan to the rank's block tables and KV stores.

This is the simulated engine. It computes slot mappings with
``dcpsim.layout`` (and nothing else re-derives them) and writes fingerprint
rows into the stores; the write guard records violations as they happen.
"""

from __future__ import annotations

import numpy as np

from dcpsim.config import SimConfig
from dcpsim.faults import Fault
from dcpsim.group_layout import RECORDS, RING, GroupLayout
from dcpsim.layout import (
    PAD,
    record_emit_positions,
    record_slot_mapping,
    records_emitted,
    ring_slot_mapping,
    ring_states_to_write,
    slot_mapping,
)
from dcpsim.runtime.block_table import BlockTable
from dcpsim.runtime.kv_store import FIELDS, KVStore
from dcpsim.scheduler.plan import ReqWrite, StepPlan
from dcpsim.verify.write_guard import WriteGuard


class ModelRunner:
    def __init__(
        self,
        layouts: list[GroupLayout],
        pool_sizes: list[int],
        config: SimConfig,
        rank: int,
        max_num_reqs: int,
        fault: Fault | None = None,
        kv_vectors=None,
    ):
        self.fault = fault or Fault()
        self.kv_vectors = kv_vectors
        """Attention check: ``kv_vectors(group_id, contents) -> [n, width]`` float32 K/V
        written next to the fingerprints (``dcpsim.attention.vectors.KVVectors``), or None."""
        self.layouts = layouts
        self.config = config
        self.rank = rank
        self.block_tables = [
            BlockTable(
                lay.name,
                max_num_reqs,
                self.fault.block_table_width(lay, config),  # the spec's max_num_blocks_per_req
            )
            for lay in layouts
        ]
        self.stores = [
            KVStore(lay.group_id, n + 1, lay.states_per_page,
                    vector_dim=kv_vectors.width if kv_vectors is not None and lay.storage != RING else 0)
            for lay, n in zip(layouts, pool_sizes)
        ]
        self.guard = WriteGuard(
            rank,
            [lay.name for lay in layouts],
            [lay.states_per_page for lay in layouts],
            [s.num_slots for s in self.stores],
        )

    def slots_for(self, layout: GroupLayout, write: ReqWrite, row: np.ndarray, rank: int | None = None):
        """(slots on ``rank`` (default: this rank), stored index, content) of one request's write."""
        rank = self.rank if rank is None else rank
        start, stop = write.start, write.stop
        if layout.storage == RING:
            states = ring_states_to_write(start, stop, layout.block_size)
            slots = ring_slot_mapping(states, int(row[0]), layout.block_size)
            return slots, states, write.contents[states - start]
        kbs = layout.kernel_block_size
        if layout.storage == RECORDS:
            R = layout.tokens_per_state
            records = records_emitted(start, stop, R)
            slots = record_slot_mapping(
                records,
                row,
                block_size=layout.block_size,
                tokens_per_state=R,
                dcp_size=layout.dcp_size,
                dcp_rank=rank,
                interleave_size=layout.interleave_size,
                kernel_block_size=kbs * R if kbs else None,
                replicated=layout.replicated,
            )
            contents = write.contents[record_emit_positions(records, R) - start]
            return slots, records, contents
        slots = slot_mapping(
            range(start, stop),
            row,
            block_size=layout.block_size,
            dcp_size=layout.dcp_size,
            dcp_rank=rank,
            interleave_size=layout.interleave_size,
            kernel_block_size=kbs,
            replicated=layout.replicated,
        )
        return slots, np.arange(start, stop, dtype=np.int64), write.contents

    def apply(self, plan: StepPlan, request_ids: dict[int, str], during_step=None) -> None:
        """Write the step. ``during_step(plan, runner)``, if given, runs after the writes with
        the block tables the step ran with (before releases): the step's attention."""
        for table, rows in zip(self.block_tables, plan.rows_before):
            table.sync(rows, request_ids)
        self.guard.begin_step(plan.step)
        for layout, table, store in zip(self.layouts, self.block_tables, self.stores):
            for write in plan.writes:
                row = table.row(write.req_index)
                slots, index, content = self.fault.slots_for(self, layout, write, row)
                mine = slots != PAD
                slots, index, content = slots[mine], index[mine], content[mine]
                inside = self.guard.check(layout.group_id, write.request_id, row, slots, index)
                rows = np.empty((int(inside.sum()), len(FIELDS)), dtype=np.int64)
                rows[:, 0] = layout.group_id
                rows[:, 1] = index[inside]
                rows[:, 2] = content[inside]
                rows[:, 3] = write.req_index
                rows[:, 4] = plan.step
                store.write(slots[inside], rows)
                if store.vectors is not None:
                    store.write_vectors(slots[inside], self.kv_vectors(layout.group_id, content[inside]))
        self.guard.end_step()
        if during_step is not None:
            during_step(plan, self)
        for table, rows in zip(self.block_tables, plan.rows_after):
            table.sync(rows, request_ids)
