"""A check's reads of one group, all of the step's requests at once.

An incremental check re-reads only some local indices of each (group, request)
(``verify.changes``). Their expected entries are derived for all of a group's requests in
one pass (``expected_partial``: the same rule as ``changes.expected_at``, over the
requests' local indices concatenated), and ``StepReads`` keeps what a check read as flat
arrays with each item's bounds, cut into per-item ``(index, got, bad)`` only when a
failure's details or a paranoid check need them.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.kinds import Storage
from dcpsim.verify.changes import owned_index
from dcpsim.verify.geometry import ExpectedGroup


def expected_partial(group: ExpectedGroup, views, rank: int, local: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``changes.expected_at`` of each request of ``views`` at its (valid) local indices
    ``local``, concatenated: ``(index, content, local)``; one pass over all of them but the
    fingerprint look-up, which is each request's own."""
    flat = np.concatenate(local) if len(local) > 1 else np.asarray(local[0], dtype=np.int64)
    index = owned_index(group, rank, flat) if group.sharded else flat
    R = group.tokens_per_state if group.storage is Storage.RECORDS else 1
    at = index * R + (R - 1) if R > 1 else index
    parts, start = [], 0
    for view, x in zip(views, local):
        stop = start + len(x)
        parts.append(view.fingerprints[at[start:stop]])
        start = stop
    content = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return index, content, flat


class StepReads:
    """What a check read, item by item in the check's order: the expected indices, the
    entries read and which of them are bad, as flat arrays; ``bounds[k]:bounds[k + 1]`` is
    item ``k``'s. Indexing gives an item's ``(index, got, bad)`` (views of the arrays)."""

    def __init__(self, index: np.ndarray, got: np.ndarray, bad: np.ndarray, lengths: np.ndarray):
        self.index, self.got, self.bad = index, got, bad
        self.lengths = lengths
        self.bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.bounds[k], self.bounds[k + 1]
        return self.index[a:b], self.got[a:b], self.bad[a:b]

    def __iter__(self):
        return (self[k] for k in range(len(self)))
