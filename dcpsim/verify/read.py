"""The read path: fetch KV the way an attention kernel does.

Local index ``i`` of a paged group lives at kernel block ``i // Bk`` of the
request's kernel block table, offset ``i % Bk``; with ``Bk == B`` that is
``block_table[i // B] * B + i % B``. A sharded group's local index counts the
rank's own positions (or records); a replicated group's local index is the
global one. A ring row ``s`` lives at ``block * C + s % C``.
"""

from __future__ import annotations

import numpy as np

from dcpsim.group_layout import RING, GroupLayout
from dcpsim.runtime.kv_store import KVStore


def read_slots(layout: GroupLayout, row: np.ndarray, local_index: np.ndarray) -> np.ndarray:
    """Slots attention reads for ``local_index``; -1 where the table has no entry."""
    local_index = np.asarray(local_index, dtype=np.int64)
    if layout.storage == RING:
        return np.full(len(local_index), int(row[0]) * layout.block_size, np.int64) + (
            local_index % layout.block_size
        )
    page = layout.states_per_page
    bk = layout.kernel_block_size or page
    per_page = page // bk
    kernel_table = (row[:, None] * per_page + np.arange(per_page)[None, :]).reshape(-1)
    kblock, offset = np.divmod(local_index, bk)
    inside = kblock < len(kernel_table)
    slots = np.full(len(local_index), -1, dtype=np.int64)
    slots[inside] = kernel_table[kblock[inside]] * bk + offset[inside]
    return slots


def read_view(layout: GroupLayout, store: KVStore, row: np.ndarray, local_index: np.ndarray) -> np.ndarray:
    return store.read(read_slots(layout, row, local_index))
