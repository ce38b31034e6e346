"""The independent expectation: what each rank must hold for a live request.

Derived from the request's committed length and true token fingerprints (the plan
history) and the checker's own geometry (``verify.geometry``), by naive enumeration: an
index ``i`` (position, or record) of a sharded group belongs to rank ``(i // I) % W``,
and a rank's local sequence is its owned indices in increasing order. Nothing here calls
the layout math or the engine.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import RequestView
from dcpsim.verify.geometry import ExpectedGroup


def retained_start(group: ExpectedGroup, num_committed: int) -> int:
    """First position attention still needs after ``num_committed`` tokens."""
    n = num_committed
    if group.retention is Retention.WINDOW:
        return max(0, n - (group.sliding_window - 1) - group.extra_retained_tokens)
    if group.retention is Retention.CHUNK:
        return n - n % group.attention_chunk_size
    if group.retention is Retention.RING:
        # A speculative step writes k + 1 rows; C - k committed rows always survive.
        return max(0, n - (group.block_size - group.num_speculative_tokens))
    return 0


def expected_full(group: ExpectedGroup, view: RequestView) -> tuple[np.ndarray, np.ndarray]:
    """Every index (position, or record) the group must hold, with its content."""
    n = view.num_committed
    if group.storage is Storage.RECORDS:
        R = group.tokens_per_state
        records = np.arange(n // R, dtype=np.int64)
        return records, view.fingerprints[records * R + R - 1]
    positions = np.arange(retained_start(group, n), n, dtype=np.int64)
    return positions, view.fingerprints[positions]


def expected_owner(group: ExpectedGroup, index: int) -> int | None:
    """The rank that must hold ``index`` (None: every rank, replicated)."""
    if not group.sharded:
        return None
    return (index // group.interleave_size) % group.dcp_size


def owned_mask(group: ExpectedGroup, index: np.ndarray, rank: int) -> np.ndarray:
    """Which of ``index`` rank ``rank`` must hold (all of them when replicated)."""
    if not group.sharded:
        return np.ones(len(index), dtype=bool)
    return (index // group.interleave_size) % group.dcp_size == rank


def expected_on_rank(group: ExpectedGroup, view: RequestView, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices rank ``rank`` must hold, in its local (attention) order, with contents."""
    index, content = expected_full(group, view)
    mine = owned_mask(group, index, rank)
    return index[mine], content[mine]
