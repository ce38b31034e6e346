"""``RankView``: the narrow, read-only window the checker has on one rank of an engine.

The checker sees a rank the way an attention kernel and a memory auditor would: block-table
rows, states read at slots, and the log of what the step wrote. It never sees the engine's
geometry, slot mapping or managers. An engine's worker provides an object with these
methods (``dcpsim.engine.worker.view.WorkerView`` for the reference worker).

Group ids are the engine's KV-cache group (and store) numbers; the checker finds the group
holding a layer with ``group_of_layer``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from dcpsim.model.plan import AttentionMetadata, ContextGather, PcpQueryKeys, SpecDecodeMask, WriteRecord


class RankView(Protocol):
    rank: int

    def group_of_layer(self, layer_name: str) -> int:
        """The engine's group (and KV store) that holds ``layer_name``'s cache."""

    def block_table_row(self, group: int, req_index: int) -> np.ndarray:
        """A copy of the request's block-table row in that group (0 = null block)."""

    def step_read_rows(self, group: int) -> dict[int, np.ndarray]:
        """Request -> a copy of its row in that group as the last step's attention read it,
        for each row that changed since the read (the manager's releases after the step, a
        finished request's row dropped; an empty row for one the step did not have). A row
        not listed is still the one the step read (``block_table_row``)."""

    def block_table_width(self, group: int) -> int:
        """Entries per row of the group's block table (its capacity, not a row's length)."""

    def store_shape(self, group: int) -> tuple[int, int]:
        """(blocks, states per block) of the group's KV store, block 0 included."""

    def read_entries(self, group: int, slots: np.ndarray) -> np.ndarray:
        """``[len(slots), 5]`` int64 entry rows (``dcpsim.model.kv_entry``); a slot outside
        the store reads as ``EMPTY``."""

    def read_vectors(self, group: int, slots: np.ndarray) -> torch.Tensor:
        """``[len(slots), width]`` float32 K/V vectors (attention check); NaN outside."""

    def find_entries(self, group: int, index: int, writer: int | None = None) -> np.ndarray:
        """Slots whose entry claims ``index`` (and ``writer``): for failure reports."""

    def step_writes(self) -> list[WriteRecord]:
        """What the last applied step wrote, in order (the stores' change record)."""

    def take_written_slots(self, group: int) -> np.ndarray:
        """The distinct slots of the group's store written since the last call, sorted (the
        store's own change record, cleared by the call)."""

    def take_table_changes(self, group: int) -> dict[int, np.ndarray | None]:
        """Request index -> the columns of its block-table row in the group that changed
        since the last call (set, replaced, nulled, grown or cut off), or None when the
        request got or lost its whole row (the table's own change record, cleared)."""

    def step_attention_metadata(self) -> list[AttentionMetadata] | None:
        """The last applied step's attention metadata, one per attention group (copies);
        None when the engine does not build any."""

    def step_context_gathers(self) -> list[ContextGather] | None:
        """The last applied step's context gathers, one per group with a gather (copies);
        None when the engine makes no gather decision."""

    def step_spec_decode_masks(self) -> list[SpecDecodeMask] | None:
        """The last applied step's spec-decode masks, one per sharded paged group of a
        speculative model with decode rows (copies); None when the engine builds none."""

    def step_pcp_query_keys(self) -> list[PcpQueryKeys]:
        """The last applied step's PCP attention metadata, one per split prefill row (copies;
        empty without PCP)."""
