"""A rank's KV store for one group: a real tensor ``[num_blocks, states_per_page, 5]``.

Each stored state is a fingerprint row: the group, the global position (or
record index), the content fingerprint, the writing request and the step.
Unwritten slots hold -1. Block 0 is the null block.
"""

from __future__ import annotations

import numpy as np
import torch

FIELDS = ("group", "index", "content", "writer", "step")
GROUP, INDEX, CONTENT, WRITER, STEP = range(len(FIELDS))
EMPTY = -1


class KVStore:
    def __init__(self, group_id: int, num_blocks: int, states_per_page: int):
        self.group_id = group_id
        self.states_per_page = states_per_page
        self.data = torch.full((num_blocks, states_per_page, len(FIELDS)), EMPTY, dtype=torch.int64)
        self._flat = self.data.view(-1, len(FIELDS))

    @property
    def num_slots(self) -> int:
        return self._flat.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        if len(slots):
            self._flat[torch.from_numpy(np.ascontiguousarray(slots))] = torch.from_numpy(
                np.ascontiguousarray(rows)
            )

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Rows at ``slots``; a slot outside the store reads as EMPTY."""
        slots = np.asarray(slots, dtype=np.int64)
        out = np.full((len(slots), len(FIELDS)), EMPTY, dtype=np.int64)
        ok = (slots >= 0) & (slots < self.num_slots)
        if ok.any():
            out[ok] = self._flat[torch.from_numpy(slots[ok])].numpy()
        return out

    def find(self, index: int, writer: int | None = None) -> np.ndarray:
        """Slots whose row claims ``index`` (and ``writer``): for failure reports."""
        flat = self._flat.numpy()
        hit = (flat[:, INDEX] == index) & (flat[:, GROUP] == self.group_id)
        if writer is not None:
            hit &= flat[:, WRITER] == writer
        return np.nonzero(hit)[0]
