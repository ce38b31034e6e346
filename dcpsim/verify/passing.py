"""What each column of a step's gathered message must show when the step passes on every
rank, so that an exchange judges all its queued steps at once in the usual case.

A step's message (``verify.check``) is its header (the judges' counts, the block-table digests)
and one row per (group, request) item. It passes when, on every rank, the judges counted
nothing and no entry was bad; the block-table digests are the same on every rank; a sharded
item read in full reassembles (the ranks' ``MULTISET`` digests add up to their ``SHARE`` of
the full context's); and a replicated item's ``ORDERED`` digests agree wherever every rank
re-read the same local indices (``LOCALS``). ``column_roles`` names each column's role once,
when the step is read; ``all_pass`` checks every queued step's columns in a few array passes.
When it says no, the checker judges the steps one by one, which finds the first failure and
builds its report (this module decides no failure, it only lets the usual case skip that walk).
"""

from __future__ import annotations

import functools

import numpy as np

IGNORED, ZERO, SAME, COUNTED, MULTISET_SUM, SHARE_SUM, REPLICA_ORDERED, REPLICA_LOCALS = range(8)

_ITEM_ROLES = np.array(
    [
        # BAD, COUNT, ORDERED, MULTISET, LOCALS, SHARE (verify.check's _ROW)
        [ZERO, COUNTED, IGNORED, IGNORED, IGNORED, IGNORED],  # sharded, read in part
        [ZERO, COUNTED, IGNORED, MULTISET_SUM, IGNORED, SHARE_SUM],  # sharded, read in full
        [ZERO, COUNTED, REPLICA_ORDERED, IGNORED, REPLICA_LOCALS, IGNORED],  # replicated
    ],
    dtype=np.int8,
)


def column_roles(counters: int, header_len: int, sharded: np.ndarray, partial: np.ndarray) -> np.ndarray:
    """The role of each column of a step's message: ``counters`` judges' counts first (each
    must be 0), one column left alone (the digests' count), the block-table digests up to
    ``header_len`` (the same on every rank), then each item's row (``sharded``, ``partial``: a
    bool per item, as the rows were built). Read-only: steps of the same shape share it."""
    kind = np.where(sharded, ~partial, 2).astype(np.int8)  # 0, 1, 2: _ITEM_ROLES's rows
    return _roles(counters, header_len, kind.tobytes())


@functools.lru_cache(maxsize=1024)
def _roles(counters: int, header_len: int, kinds: bytes) -> np.ndarray:
    """``column_roles`` of a shape (the items' kinds as bytes): a run's steps have a handful."""
    head = np.full(header_len, SAME, dtype=np.int8)
    head[:counters] = ZERO
    head[counters] = IGNORED
    roles = np.concatenate([head, _ITEM_ROLES[np.frombuffer(kinds, dtype=np.int8)].reshape(-1)])
    roles.flags.writeable = False
    return roles


def all_pass(gathered: np.ndarray, roles: np.ndarray) -> int | None:
    """Whether every step of ``gathered`` (every rank's messages, a row per rank; ``roles``:
    their columns' roles, concatenated) passes: the entries they read, summed over the ranks,
    if so, else None."""
    if gathered[:, roles == ZERO].any():
        return None
    same = gathered[:, roles == SAME]
    if (same != same[0]).any():
        return None
    pieces = gathered[:, roles == MULTISET_SUM].view(np.uint64).sum(axis=0, dtype=np.uint64)
    if (pieces != gathered[:, roles == SHARE_SUM].view(np.uint64).sum(axis=0, dtype=np.uint64)).any():
        return None
    ordered, locals_ = gathered[:, roles == REPLICA_ORDERED], gathered[:, roles == REPLICA_LOCALS]
    if ((locals_ == locals_[0]).all(axis=0) & (ordered != ordered[0]).any(axis=0)).any():
        return None
    return int(gathered[:, roles == COUNTED].sum())
