"""``WorkerView``: the reference worker's ``RankView`` (``dcpsim.model.rank_view``).

Read-only: every array it returns is a copy, so the checker cannot change what the engine
holds, and the checker reaches the worker only through these methods. The ``take_*``
methods hand over (and clear) the stores' and block tables' own change records.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.model.plan import AttentionMetadata, ContextGather, PcpQueryKeys, SpecDecodeMask, WriteRecord


class WorkerView:
    def __init__(self, runner: ModelRunner):
        self._runner = runner
        self.rank = runner.rank
        self._group_of = {name: g.group_id for g in runner.geometries for name in g.layer_names}

    def group_of_layer(self, layer_name: str) -> int:
        return self._group_of[layer_name]

    def block_table_row(self, group: int, req_index: int) -> np.ndarray:
        return self._runner.block_tables[group].row(req_index).copy()

    def step_read_rows(self, group: int) -> dict[int, np.ndarray]:
        return {req: row.copy() for req, row in self._runner.block_tables[group].read_rows().items()}

    def block_table_width(self, group: int) -> int:
        return int(self._runner.block_tables[group].table.shape[1])

    def store_shape(self, group: int) -> tuple[int, int]:
        store = self._runner.stores[group]
        return store.num_slots // store.states_per_page, store.states_per_page

    def read_entries(self, group: int, slots: np.ndarray) -> np.ndarray:
        return self._runner.stores[group].read(slots)

    def read_vectors(self, group: int, slots: np.ndarray) -> torch.Tensor:
        return self._runner.stores[group].read_vectors(slots).clone()

    def find_entries(self, group: int, index: int, writer: int | None = None) -> np.ndarray:
        return self._runner.stores[group].find(index, writer)

    def step_writes(self) -> list[WriteRecord]:
        return list(self._runner.write_log)

    def take_written_slots(self, group: int) -> np.ndarray:
        return self._runner.stores[group].take_written()

    def take_table_changes(self, group: int) -> dict[int, np.ndarray | None]:
        return self._runner.block_tables[group].take_changes()

    def step_attention_metadata(self) -> list[AttentionMetadata] | None:
        if not self._runner.builds_metadata:
            return None
        return [_with_copied_arrays(m) for m in self._runner.metadata_log]

    def step_context_gathers(self) -> list[ContextGather] | None:
        if not self._runner.gathers_context:
            return None
        return [_with_copied_arrays(g) for g in self._runner.gather_log]

    def step_spec_decode_masks(self) -> list[SpecDecodeMask] | None:
        if not self._runner.builds_masks:
            return None
        return [
            SpecDecodeMask(m.group, m.request_ids, m.context_lens.copy(), m.query_lens.copy(), tuple(v.copy() for v in m.visible))
            for m in self._runner.mask_log
        ]

    def step_pcp_query_keys(self) -> list[PcpQueryKeys]:
        return [dataclasses.replace(k, queries=k.queries.copy(), spans=k.spans.copy()) for k in self._runner.pcp_keys_log]

    @property
    def kv_store_bytes(self) -> int:
        return sum(s.nbytes for s in self._runner.stores)


def _with_copied_arrays(record):
    """A copy of a frozen record (``AttentionMetadata``, ``ContextGather``) whose ``ARRAYS``
    are fresh int64 copies (``dataclasses.replace`` without its per-call field walk: the
    fields are plain attributes, no ``__post_init__``)."""
    out = object.__new__(type(record))
    fields = out.__dict__
    fields.update(record.__dict__)
    for name in record.ARRAYS:
        fields[name] = np.array(fields[name], dtype=np.int64)
    return out
