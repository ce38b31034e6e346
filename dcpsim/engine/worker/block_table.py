"""A rank's block table for one KV-cache group, as in vLLM's worker.

``[max_num_reqs, max_num_blocks_per_req]`` block ids, one row per request
being served, filled from the scheduler's plan. The width is the engine's
``GroupGeometry.block_table_width`` (the reference: the group spec's
``max_num_blocks_per_req``, ``cdiv(max_model_len, B * W)`` when sharded,
``cdiv(max_model_len, B)`` when replicated, 1 for a ring); a row that
does not fit is a ``BlockTableOverflow``, which the harness reports as a
correctness failure (the symptom of a replicated group scaled by ``W``).

The table keeps its own change record: per request, the columns of its row whose block id
changed (an entry set, replaced, nulled or cut off) since the last ``take_changes``, or
``ALL_COLUMNS`` when the request got or lost its row (the incremental checker's input).
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.distinct import sorted_distinct
from dcpsim.plural import plural


class BlockTableOverflow(Exception):
    def __init__(self, group: str, request_id: str, needed: int, width: int):
        super().__init__(
            f"group {group}: request {request_id} needs {plural(needed, 'block-table entry', 'block-table entries')} but "
            f"the block table has {width} (max_num_blocks_per_req)"
        )
        self.group, self.request_id, self.needed, self.width = group, request_id, needed, width


ALL_COLUMNS = None
"""A change record's value for a request whose whole row is new (or gone)."""


def never_changes(ids) -> bool:
    """Whether nobody can change the entries of ``ids``: a read-only array, and so is each array
    it is a view of, down to data it owns (a scheduler's snapshot) or to immutable ``bytes`` (a
    snapshot unpickled from the launcher's schedule file, ``harness.parent_schedule``)."""
    if not isinstance(ids, np.ndarray):
        return False
    while isinstance(ids, np.ndarray):
        if ids.flags.writeable:
            return False
        ids = ids.base
    return ids is None or isinstance(ids, bytes)


class BlockTable:
    def __init__(self, group: str, max_num_reqs: int, max_num_blocks_per_req: int):
        self.group = group
        self.table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self._changed: dict[int, list[np.ndarray] | None] = {}
        """Request -> changed columns (arrays) since ``take_changes``; ``ALL_COLUMNS``: all."""
        self._synced: dict[int, np.ndarray] = {}
        """Request -> the read-only array its row was last set from (``sync``): handed the same
        one again (the scheduler shares a snapshot while a row does not change), the row holds it."""
        self._read_rows: dict[int, np.ndarray] = {}
        """Request -> its row as the step's attention read it, kept for the rows that changed
        since the read (``mark_read``); the others still hold it."""
        self._keep_read = False

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def set_row(self, req: int, request_id: str, block_ids: np.ndarray) -> None:
        self._synced.pop(req, None)
        if len(block_ids) > self.width:
            raise BlockTableOverflow(self.group, request_id, len(block_ids), self.width)
        row = self._row_of.get(req)
        n = len(block_ids)
        if row is not None:  # one comparison of the entries both rows have (a row is the whole context)
            old = int(self.num_blocks[row])
            columns = np.flatnonzero(self.table[row, : min(n, old)] != block_ids[: min(n, old)])
            same = n == old and not len(columns)
        if self._keep_read and req not in self._read_rows:
            if row is None:
                self._read_rows[req] = np.zeros(0, dtype=np.int64)
            elif not same:
                self._read_rows[req] = self.row(req).copy()
        if row is None:
            row = self._free_rows.pop()
            self._row_of[req] = row
            self._changed[req] = ALL_COLUMNS
            old, same = 0, n == 0
        if same:  # most rows of a step: nothing to change
            return
        if self._changed.get(req, ()) is not ALL_COLUMNS:
            self.table[row, :n] = block_ids
            self.table[row, n:old] = 0
            if len(columns) or n != old:  # changed entries, and those grown or cut off
                resized = np.arange(min(n, old), max(n, old), dtype=np.int64)  # grown, or cut off
                self._changed.setdefault(req, []).append(np.concatenate([columns, resized]))
        else:
            self.table[row, :n] = block_ids
            self.table[row, n:old] = 0
        self.num_blocks[row] = n

    def remove_row(self, req: int) -> None:
        self._synced.pop(req, None)
        if self._keep_read and req not in self._read_rows:
            self._read_rows[req] = self.row(req).copy()
        row = self._row_of.pop(req)
        self.table[row, : self.num_blocks[row]] = 0  # past num_blocks a row is null already (set_row)
        self._changed[req] = ALL_COLUMNS
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def sync(self, rows: dict[int, np.ndarray], request_ids: dict[int, str]) -> None:
        """Make the table hold exactly ``rows`` (request index -> block ids)."""
        for req in [r for r in self._row_of if r not in rows]:
            self.remove_row(req)
        synced = self._synced
        for req, ids in rows.items():
            if synced.get(req) is ids:  # set from this very (read-only) array: unchanged
                continue
            self.set_row(req, request_ids.get(req, str(req)), ids)
            if never_changes(ids):
                synced[req] = ids

    def mark_read(self, reading: bool) -> None:
        """``True``: the table now holds the rows the step's attention reads; from here on
        each row's first change keeps a copy of it as read (``read_rows``), until the next
        ``mark_read(False)`` (the next step's sync). Costs one copy per changed row."""
        self._keep_read = reading
        if reading:
            self._read_rows = {}

    def read_rows(self) -> dict[int, np.ndarray]:
        """Request -> its row as the last step read it, for the rows that changed since
        (released, cut off, removed; empty for a row the step did not have): the other rows
        are as read."""
        return self._read_rows

    def padded_row(self, req: int, entries: int) -> np.ndarray:
        """The request's row as a kernel reads it: null (0) past the blocks it holds,
        and, past the table's width, null too (at least ``entries`` entries)."""
        r = self._row_of[req]
        # past num_blocks the row is null: copy only what is asked for (a row of a 10^9-token
        # max_model_len is 10^7 entries)
        have = self.table[r, : min(self.width, max(int(self.num_blocks[r]), entries))]
        return np.concatenate([have, np.zeros(max(0, entries - len(have)), np.int64)])

    def take_changes(self) -> dict[int, np.ndarray | None]:
        """Request -> the distinct changed columns of its row (or ``ALL_COLUMNS``) since
        the last call, and forget them."""
        changed, self._changed = self._changed, {}
        return {req: cols if cols is ALL_COLUMNS else sorted_distinct(np.concatenate(cols)) for req, cols in changed.items()}

    def row(self, req: int) -> np.ndarray:
        """The request's block ids (a view of the table; null entries are 0)."""
        r = self._row_of[req]
        return self.table[r, : self.num_blocks[r]]
