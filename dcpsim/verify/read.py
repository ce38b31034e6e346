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
    page = group.page_states
    bk = group.kernel_block_size or page
    per_page = page // bk
    entry, sub = np.divmod(local_index // bk, per_page)  # block-table entry, kernel block in it
    if len(entry) and entry.max() < len(row):  # every index has an entry (most reads): no mask
        return (row[entry] * per_page + sub) * bk + local_index % bk
    inside = entry < len(row)
    slots = np.full(len(local_index), -1, dtype=np.int64)
    slots[inside] = (row[entry[inside]] * per_page + sub[inside]) * bk + local_index[inside] % bk
    return slots
