"""The independent expectation: what each rank must hold for a live request.

Derived from the request's committed length and true token fingerprints (the plan
history) and the checker's own geometry (``verify.geometry``), by naive enumeration: an
index ``i`` (position, or record) of a sharded group belongs to rank ``(i // I) % W``,
and a rank's local sequence is its owned indices in increasing order. A Mamba state group
holds one entry per request, on every rank: the state after the last committed token, in the
block-table column the request's last write put it (``state_column``). Nothing here calls
the layout math or the engine.
"""

from __future__ import annotations

import numpy as np

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import RequestView
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.helix import helix_owner_of


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
    if group.storage is Storage.STATE:  # one state, summarising the whole committed prefix
        last = np.array([n - 1], dtype=np.int64)
        return last, view.fingerprints[last]
    first, stop = _span(group, n)
    return _with_content(group, view, np.arange(first, stop, dtype=np.int64))


def expected_share(group: ExpectedGroup, view: RequestView, part: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Slice ``part`` of ``parts`` equal, consecutive slices of ``expected_full``: the slices
    of ``part = 0 .. parts - 1`` together are the full context, each index once, whatever the
    layout. Each rank hashes its own slice of a full read's expectation, so the ranks share
    the full context's digest instead of each computing all of it."""
    if group.storage is Storage.STATE:
        index, content = expected_full(group, view)
        keep = slice(len(index) * part // parts, len(index) * (part + 1) // parts)
        return index[keep], content[keep]
    first, stop = _span(group, view.num_committed)
    size = max(0, stop - first)
    lo, hi = first + size * part // parts, first + size * (part + 1) // parts
    return _with_content(group, view, np.arange(lo, hi, dtype=np.int64))


def _span(group: ExpectedGroup, n: int) -> tuple[int, int]:
    """``[first, stop)`` of the indices a paged, records or ring group must hold."""
    if group.storage is Storage.RECORDS:
        return 0, n // group.tokens_per_state
    return retained_start(group, n), n


def _with_content(group: ExpectedGroup, view: RequestView, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``index`` with what each must hold: a record, the fingerprint of its last token."""
    if group.storage is Storage.RECORDS:
        R = group.tokens_per_state
        return index, view.fingerprints[index * R + R - 1]
    return index, view.fingerprints[index]


def owned_count(group: ExpectedGroup, rank: int, stop: int) -> int:
    """How many of the indices ``[0, stop)`` of a sharded group rank ``rank`` owns (``owned_below``
    of one length, as a plain int: the checker's per-item paths ask it one length at a time)."""
    I, span = group.interleave_size, group.interleave_size * group.dcp_size
    return (stop // span) * I + min(max(stop % span - rank * I, 0), I)


def owned_below(length: np.ndarray, rank: int, group: ExpectedGroup) -> np.ndarray:
    """Indices ``< length`` that rank ``rank`` holds, for each length: count its runs of ``I``
    among the ``cdiv(length, I)`` runs below the length (every run whole but the last); a
    replicated group holds them all."""
    length = np.asarray(length, dtype=np.int64)
    if not group.sharded:
        return length.copy()
    W, I = group.dcp_size, group.interleave_size
    # run k belongs to rank k % W: every whole cycle of W runs gives the rank I indices, and
    # the cycle's part below the length those of its run (I * rank onwards) that lie there
    cycles, rest = np.divmod(np.maximum(length, 0), W * I)
    return cycles * I + np.minimum(np.maximum(rest - rank * I, 0), I)


def expected_owner(group: ExpectedGroup, index: int, request_id: str | None = None) -> int | None:
    """The rank that must hold ``index`` (None: every rank, replicated); under Helix the
    owner depends on the request (``request_id``)."""
    if group.helix:
        return int(helix_owner_of(np.array([index]), group.prompt_len(request_id), group.block_size, group.dcp_size)[0])
    if not group.sharded:
        return None
    return (index // group.interleave_size) % group.dcp_size


def owned_mask(group: ExpectedGroup, index: np.ndarray, rank: int, request_id: str | None = None) -> np.ndarray:
    """Which of ``index`` rank ``rank`` must hold (all of them when replicated; under Helix,
    by request ``request_id``'s layout)."""
    if group.helix:
        return helix_owner_of(index, group.prompt_len(request_id), group.block_size, group.dcp_size) == rank
    if not group.sharded:
        return np.ones(len(index), dtype=bool)
    return (index // group.interleave_size) % group.dcp_size == rank


def expected_on_rank(group: ExpectedGroup, view: RequestView, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices rank ``rank`` must hold, in its local (attention) order, with contents.

    Sharded: the rank's runs ``k = rank, rank + W, ...`` of ``I`` indices, each run listed
    whole and cut to the span, so a rank enumerates only its ``1/W`` share of a long context.
    Helix: the request's positions the rank holds, in position order (its local order)."""
    if group.helix:
        first, stop = _span(group, view.num_committed)
        index = np.arange(first, stop, dtype=np.int64)
        return _with_content(group, view, index[owned_mask(group, index, rank, view.request_id)])
    if not group.sharded or group.storage is Storage.STATE:
        return expected_full(group, view)
    first, stop = _span(group, view.num_committed)
    I, W = group.interleave_size, group.dcp_size
    k0 = first // I  # the run holding the first index; the rank's runs are k = rank mod W
    runs = np.arange(k0 + (rank - k0) % W, -(-stop // I), W, dtype=np.int64)
    index = (runs[:, None] * I + np.arange(I, dtype=np.int64)).reshape(-1)
    index = index[(index >= first) & (index < stop)]
    return _with_content(group, view, index)


def state_column(group: ExpectedGroup, start: int, stop: int, num_drafts: int, num_committed: int) -> int:
    """The block-table column of a Mamba group holding the state after the last committed
    token, given the request's last write ``[start, stop)`` with ``num_drafts`` drafts.

    vLLM's kernels keep a request's states in its last ``1 + k`` state blocks (``none``
    mode: the row's first ``1 + k`` entries; ``align`` mode: from the entry of the write's
    last token, ``(stop - 1) // B``, on). A prefill chunk leaves one state, after its last
    token, in the first of them; a decode step leaves the state after each of its tokens,
    token ``j``'s in the ``j``-th, so the committed one is where the accepted tokens end.
    """
    first = (stop - 1) // group.block_size if group.mamba_cache_mode == "align" else 0
    if stop - start - num_drafts > 1:
        return first
    return first + (num_committed - 1 - start)
