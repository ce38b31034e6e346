"""A rank's KV store for one group: a real tensor ``[num_blocks, states_per_page, 5]``.

Each stored state is a fingerprint row: the group, the global position (or
record index), the content fingerprint, the writing request and the step.
Unwritten slots hold -1. Block 0 is the null block.

With ``vector_dim > 0`` (the attention check) the store also holds a float32
tensor ``[num_blocks, states_per_page, vector_dim]`` of K/V vectors written at
the same slots; unwritten slots hold NaN.

The store keeps its own change record: every slot ``write`` stored a row at since the
last ``take_written`` (the incremental checker's input; ``verify.changes``).
"""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.model.distinct import sorted_distinct
from dcpsim.model.kv_entry import EMPTY, FIELDS, GROUP, INDEX, WRITER


class KVStore:
    def __init__(self, group_id: int, num_blocks: int, states_per_page: int, vector_dim: int = 0):
        self.group_id = group_id
        self.states_per_page = states_per_page
        self.data = torch.full((num_blocks, states_per_page, len(FIELDS)), EMPTY, dtype=torch.int64)
        self._flat = self.data.view(-1, len(FIELDS))
        self._rows = self._flat.numpy()
        """The same memory as ``data``, as numpy: indexing a few slots through it costs a
        fraction of torch's advanced indexing (a step writes and reads short runs)."""
        self._written: list[np.ndarray] = []
        """Slots written since the last ``take_written``: the store's change record."""
        self.vector_dim = vector_dim
        self.vectors = torch.full((num_blocks, states_per_page, vector_dim), float("nan"), dtype=torch.float32) if vector_dim else None
        self._vector_rows = self.vectors.view(-1, vector_dim).numpy() if vector_dim else None
        """The same memory as ``vectors``, as numpy ``[slots, vector_dim]`` (a step reads short runs)."""

    @property
    def num_slots(self) -> int:
        return self._flat.shape[0]

    @property
    def nbytes(self) -> int:
        extra = self.vectors.numel() * self.vectors.element_size() if self.vectors is not None else 0
        return self.data.numel() * self.data.element_size() + extra

    def write_vectors(self, slots: np.ndarray, vectors: np.ndarray) -> None:
        if self.vectors is not None and len(slots):
            self.vectors.view(-1, self.vector_dim)[torch.from_numpy(np.ascontiguousarray(slots))] = torch.from_numpy(
                np.ascontiguousarray(vectors, dtype=np.float32)
            )

    def read_vectors(self, slots: np.ndarray) -> torch.Tensor:
        """``[len(slots), vector_dim]`` float32 at ``slots``; a slot outside the store reads NaN."""
        slots = np.asarray(slots, dtype=np.int64)
        flat = self._vector_rows
        if not len(slots) or (0 <= slots.min() and slots.max() < len(flat)):
            return torch.from_numpy(flat[slots])  # a copy (fancy indexing)
        ok = (slots >= 0) & (slots < len(flat))
        out = np.full((len(slots), self.vector_dim), np.nan, dtype=np.float32)
        out[ok] = flat[slots[ok]]
        return torch.from_numpy(out)

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        if len(slots):
            slots = np.array(slots, dtype=np.int64)  # a copy: the record must not alias the caller's
            self._rows[slots] = rows
            self._written.append(slots)

    def take_written(self) -> np.ndarray:
        """The distinct slots written since the last call (sorted), and forget them."""
        written, self._written = self._written, []
        return sorted_distinct(np.concatenate(written)) if written else np.zeros(0, np.int64)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Rows at ``slots``; a slot outside the store reads as EMPTY."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return np.zeros((0, len(FIELDS)), dtype=np.int64)
        if 0 <= slots.min() and slots.max() < len(self._rows):
            return self._rows[slots]  # a copy (fancy indexing)
        out = np.full((len(slots), len(FIELDS)), EMPTY, dtype=np.int64)
        ok = (slots >= 0) & (slots < len(self._rows))
        out[ok] = self._rows[slots[ok]]
        return out

    def find(self, index: int, writer: int | None = None) -> np.ndarray:
        """Slots whose row claims ``index`` (and ``writer``): for failure reports."""
        flat = self._rows
        hit = (flat[:, INDEX] == index) & (flat[:, GROUP] == self.group_id)
        if writer is not None:
            hit &= flat[:, WRITER] == writer
        return np.nonzero(hit)[0]
