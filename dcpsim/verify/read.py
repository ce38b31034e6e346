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
    return read_slots_flat(group, rows, [len(x) for x in local_indices], local, local_indices)


def read_slots_flat(
    group: ExpectedGroup, rows: list[np.ndarray], counts: list[int], local: np.ndarray, local_indices=None, flat=None
) -> np.ndarray:
    """``read_slots_all`` with the local indices given concatenated (``local``, ``counts[k]``
    of them request ``k``'s; ``local_indices``: the same per request, else cut from ``local``;
    ``flat``: the rows concatenated as int64, when the caller has them)."""
    if group.storage is Storage.RING or (len(local) and local.min() < 0):
        if local_indices is None:
            local_indices = np.split(local, np.cumsum(counts)[:-1])
        return np.concatenate([read_slots(group, row, x) for row, x in zip(rows, local_indices)])
    if len(rows) == 1:
        return _through_rows(group, np.asarray(rows[0], dtype=np.int64), 0, len(rows[0]), local)
    lens = np.array([len(row) for row in rows], dtype=np.int64)
    owner = np.repeat(np.arange(len(rows)), counts)
    flat = np.concatenate(rows).astype(np.int64, copy=False) if flat is None else flat
    return _through_rows(group, flat, (np.cumsum(lens) - lens)[owner], lens[owner], local)


def _through_rows(group: ExpectedGroup, flat: np.ndarray, start, length, local: np.ndarray) -> np.ndarray:
    """The paged read of each local index through its request's block-table row, the entries
    ``flat[start : start + length]`` (scalars for one row, arrays aligned with ``local`` for
    several); -1 past the row."""
    page = group.page_states
    bk = group.kernel_block_size or page
    per_page = page // bk
    kernel, offset = np.divmod(local, bk)
    if per_page == 1:  # the kernel block is the page: kernel block k is entry k
        entry, sub = kernel, 0
    else:
        entry, sub = np.divmod(kernel, per_page)  # block-table entry, kernel block in it
    inside = entry < length
    if inside.all():  # every index has an entry (most reads): no mask
        block = flat[start + entry]
        return (block * per_page + sub) * bk + offset if per_page > 1 else block * bk + offset
    slots = np.full(len(local), -1, dtype=np.int64)
    at = (start + entry)[inside]
    slots[inside] = (flat[at] * per_page + (sub[inside] if per_page > 1 else 0)) * bk + offset[inside]
    return slots
