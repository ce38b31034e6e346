"""The read path: fetch KV the way an attention kernel does.

Local index ``i`` of a paged group lives at kernel block ``i // Bk`` of the request's
kernel block table, offset ``i % Bk``; with ``Bk == B`` that is
``block_table[i // B] * B + i % B``. A sharded group's local index counts the rank's own
positions (or records); a replicated group's local index is the global one. A ring row
``s`` lives at ``block * C + s % C``. Geometry from ``verify.geometry`` only.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.kinds import Storage
from dcpsim.verify.geometry import ExpectedGroup


def read_slots(group: ExpectedGroup, row: np.ndarray, local_index: np.ndarray) -> np.ndarray:
    """Slots attention reads for ``local_index``; -1 where the table has no entry."""
    local_index = np.asarray(local_index, dtype=np.int64)
    row = np.asarray(row, dtype=np.int64)
    if group.storage is Storage.RING:
        return int(row[0]) * group.block_size + local_index % group.block_size
    return _through_rows(group, row, 0, len(row), local_index)


def read_slots_all(group: ExpectedGroup, rows: list[np.ndarray], local_indices: list[np.ndarray]) -> np.ndarray:
    """``read_slots`` of each request's ``(row, local indices)``, concatenated, in one pass over
    all of a group's requests (a ring, or negative local indices: request by request)."""
    if not rows:
        return np.zeros(0, dtype=np.int64)
    local = np.concatenate([np.asarray(x, dtype=np.int64) for x in local_indices])
    if group.storage is Storage.RING or (len(local) and local.min() < 0):
        return np.concatenate([read_slots(group, row, x) for row, x in zip(rows, local_indices)])
    rows = [np.asarray(row, dtype=np.int64) for row in rows]
    lens = np.array([len(row) for row in rows], dtype=np.int64)
    owner = np.repeat(np.arange(len(rows)), [len(x) for x in local_indices])
    return _through_rows(group, np.concatenate(rows), (np.cumsum(lens) - lens)[owner], lens[owner], local)


def _through_rows(group: ExpectedGroup, flat: np.ndarray, start, length, local: np.ndarray) -> np.ndarray:
    """The paged read of each local index through its request's block-table row, the entries
    ``flat[start : start + length]`` (scalars for one row, arrays aligned with ``local`` for
    several); -1 past the row."""
    page = group.page_states
    bk = group.kernel_block_size or page
    per_page = page // bk
    entry, sub = np.divmod(local // bk, per_page)  # block-table entry, kernel block in it
    inside = entry < length
    if inside.all():  # every index has an entry (most reads): no mask
        return (flat[start + entry] * per_page + sub) * bk + local % bk
    slots = np.full(len(local), -1, dtype=np.int64)
    at = (start + entry)[inside]
    slots[inside] = (flat[at] * per_page + sub[inside]) * bk + local[inside] % bk
    return slots
