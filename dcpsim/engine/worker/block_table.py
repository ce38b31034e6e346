"""A rank's block table for one KV-cache group, as in vLLM's worker.

``[max_num_reqs, max_num_blocks_per_req]`` block ids, one row per request
being served, filled from the scheduler's plan. The width is the engine's
``GroupGeometry.block_table_width`` (the reference: the group spec's
``max_num_blocks_per_req``, ``cdiv(max_model_len, B * W)`` when sharded,
``cdiv(max_model_len, B)`` when replicated, 1 for a ring); a row that
does not fit is a ``BlockTableOverflow``, which the harness reports as a
correctness failure (the symptom of a replicated group scaled by ``W``).
"""

from __future__ import annotations

import numpy as np

from dcpsim.plural import plural


class BlockTableOverflow(Exception):
    def __init__(self, group: str, request_id: str, needed: int, width: int):
        super().__init__(
            f"group {group}: request {request_id} needs {plural(needed, 'block-table entry', 'block-table entries')} but "
            f"the block table has {width} (max_num_blocks_per_req)"
        )
        self.group, self.request_id, self.needed, self.width = group, request_id, needed, width


class BlockTable:
    def __init__(self, group: str, max_num_reqs: int, max_num_blocks_per_req: int):
        self.group = group
        self.table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def set_row(self, req: int, request_id: str, block_ids: np.ndarray) -> None:
        if len(block_ids) > self.width:
            raise BlockTableOverflow(self.group, request_id, len(block_ids), self.width)
        row = self._row_of.get(req)
        if row is None:
            row = self._free_rows.pop()
            self._row_of[req] = row
        self.table[row, : len(block_ids)] = block_ids
        self.table[row, len(block_ids) :] = 0
        self.num_blocks[row] = len(block_ids)

    def remove_row(self, req: int) -> None:
        row = self._row_of.pop(req)
        self.table[row] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def sync(self, rows: dict[int, np.ndarray], request_ids: dict[int, str]) -> None:
        """Make the table hold exactly ``rows`` (request index -> block ids)."""
        for req in [r for r in self._row_of if r not in rows]:
            self.remove_row(req)
        for req, ids in rows.items():
            self.set_row(req, request_ids.get(req, str(req)), ids)

    def padded_row(self, req: int, entries: int) -> np.ndarray:
        """The request's whole row as a kernel reads it: null (0) past the blocks it holds,
        and, past the table's width, null too (at least ``entries`` entries)."""
        full = self.table[self._row_of[req]]
        return np.concatenate([full, np.zeros(max(0, entries - len(full)), np.int64)])

    def row(self, req: int) -> np.ndarray:
        """The request's block ids (a view of the table; null entries are 0)."""
        r = self._row_of[req]
        return self.table[r, : self.num_blocks[r]]
