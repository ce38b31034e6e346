"""The independent expectation: what each rank must hold for a live request.

Derived from the request's committed length and true token fingerprints (the
plan history) and the spec's own fields, with naive enumeration: a position
``p`` of a sharded group belongs to rank ``(p // I) % W`` and a rank's local
sequence is its owned positions in increasing order. Nothing here calls the
layout module or the managers' release logic.
"""

from __future__ import annotations

import numpy as np

from dcpsim.group_layout import CHUNK, RECORDS, RING, WINDOW, GroupLayout
from dcpsim.scheduler.plan import RequestView


def retained_start(layout: GroupLayout, num_committed: int) -> int:
    """First position attention still needs after ``num_committed`` tokens."""
    spec, n = layout.spec, num_committed
    if layout.retention == WINDOW:
        return max(0, n - (spec.sliding_window - 1) - spec.extra_retained_tokens)
    if layout.retention == CHUNK:
        return n - n % spec.attention_chunk_size
    if layout.retention == RING:
        # A speculative step writes k + 1 rows; C - k committed rows always survive.
        return max(0, n - (spec.block_size - layout.num_speculative_tokens))
    return 0


def expected_full(layout: GroupLayout, view: RequestView) -> tuple[np.ndarray, np.ndarray]:
    """Every index (position, or record) the group must hold, with its content."""
    n = view.num_committed
    if layout.storage == RECORDS:
        R = layout.tokens_per_state
        records = np.arange(n // R, dtype=np.int64)
        return records, view.fingerprints[records * R + R - 1]
    positions = np.arange(retained_start(layout, n), n, dtype=np.int64)
    return positions, view.fingerprints[positions]


def expected_owner(layout: GroupLayout, index: int) -> int | None:
    """The rank that must hold ``index`` (None: every rank, replicated)."""
    if not layout.sharded:
        return None
    return (index // layout.interleave_size) % layout.dcp_size


def expected_on_rank(layout: GroupLayout, view: RequestView, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices rank ``rank`` must hold, in its local (attention) order, with contents."""
    index, content = expected_full(layout, view)
    if not layout.sharded:
        return index, content
    mine = (index // layout.interleave_size) % layout.dcp_size == rank
    return index[mine], content[mine]
