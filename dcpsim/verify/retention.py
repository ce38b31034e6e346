"""Retention judged where the reads happen: every key a step's queries read must still be held
when the step runs (failure ``retention-at-read``).

A step writes positions ``[start, stop)`` of a request and its queries, one per position, read
their keys: query ``p`` of a sliding window reads positions ``(p - sliding_window, p]``, of a
chunked-local group its chunk ``[p - p % C, p]``, of full attention (MLA, sparse, the indexer)
its whole context ``[0, p]``, of a compressed cache the records emitted at positions ``<= p``
(``verify.attention_reference.key_range``). The keys below ``start`` (the context, committed
before the step) must be held, by the rank that owns them, in the blocks the step's block-table
rows give them: the rows as the step's attention read them, before the manager's releases after
the step (``RankView.step_read_rows``).

The check after the step (``verify.check``) judges what the rank holds for the *next* query:
``[retained_start(n), n)`` after ``n`` committed tokens, through the rows after the releases. A
window released one token early at the step's allocation (vLLM releases a request's out-of-window
blocks inside its next ``allocate_slots``) frees the block of the oldest key the step's first
query reads, a key the next query no longer needs, so that check passes. This one reads, per step
and request, the context keys the check after the step does not judge through the same block:

* the keys below the first one the group must still hold after the step
  (``retained_start`` of the committed length after it), whatever their column;
* the keys whose block-table column changed between the read and now (a row the step read
  that was released, replaced or dropped since).

The rest of the context is judged after the step through the same blocks, so nothing is read
twice: a full-attention group, which never releases, costs a dictionary lookup per step. Each
key is read through the read-time row with the checker's own geometry (``verify.read``) and
compared with the request's true fingerprint. Rings and Mamba states are not attention keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.kv_entry import CONTENT, GROUP, INDEX, WRITER
from dcpsim.model.plan import StepPlan
from dcpsim.verify.attention_reference import emit_positions, key_range, keys_before
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.helix import helix_local_of
from dcpsim.verify.oracle import owned_mask, retained_start
from dcpsim.verify.read import read_slots

MAX_KEPT = 20
_RELEASES = (Retention.WINDOW, Retention.CHUNK)
"""Retentions whose keys leave the group while the request lives (``oracle.retained_start``)."""


@dataclass(frozen=True)
class MissingKey:
    """A key a step's query read that the rank did not hold (the first of a request's step)."""

    rank: int
    step: int
    group: str
    request_id: str
    query_position: int
    """The step's first query that reads the key (the oldest key is its first query's)."""
    key: int
    """The missing key: a position, or a record index of a compressed cache."""
    index_kind: str
    block: int
    """The block id of the key's block-table column in the row the step read (0: the null block,
    -1: past the row's end)."""
    found: str
    """What the rank read there instead."""
    missing: int = 1
    """Keys of this request's step the rank did not hold."""
    slot: int = -1
    """The slot the rank read the key at (-1: past the end of its row)."""
    content: int = 0
    """The content the key must hold (the fingerprint of its position, or its record's last)."""
    owner: int | str = "all"
    """The rank that must hold the key (``all``: a replicated group)."""
    row: tuple[int, ...] = ()
    """The request's block-table row in the group as the step read it."""

    def __str__(self) -> str:
        where = "past the end of its row" if self.block < 0 else ("the null block" if self.block == 0 else f"block {self.block}")
        more = f"; {self.missing - 1} more key(s) of the step missing" if self.missing > 1 else ""
        return (
            f"rank {self.rank} step {self.step} group {self.group} request {self.request_id}: the query at position "
            f"{self.query_position} reads the {self.index_kind} {self.key}, which the rank no longer held when the step "
            f"ran (its column holds {where}; read: {self.found}){more}"
        )


def read_keys(group: ExpectedGroup, start: int, stop: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` of the context the queries of a write ``[start, stop)`` read: the keys
    emitted before ``start`` (the step's own writes are judged as writes)."""
    lo, _ = key_range(group, np.array([start, stop - 1], dtype=np.int64))
    return lo, keys_before(group, start)


def local_of(group: ExpectedGroup, keys: np.ndarray) -> np.ndarray:
    """The local index of each key on the rank that owns it (sections 2, 4: a sharded group's
    ``(k // (W*I)) * I + k % I``; a replicated group's key itself)."""
    if not group.sharded:
        return keys
    I, W = group.interleave_size, group.dcp_size
    return (keys // (I * W)) * I + keys % I


class RetentionJudge:
    """Judges, every step, the context keys each write's queries read on this rank; keeps the
    first requests whose keys were missing."""

    def __init__(self, rank: int, groups: list[ExpectedGroup], store_of: list[int], request_ids: dict[int, str] | None = None):
        self.rank = rank
        self.request_ids = request_ids or {}
        self.judged = [(g, s) for g, s in zip(groups, store_of) if g.storage in (Storage.PAGED, Storage.RECORDS)]
        self.count = 0
        """Keys missing so far (every step's)."""
        self.read = 0
        """Keys read so far."""
        self.kept: list[MissingKey] = []

    def judge(self, plan: StepPlan, view) -> None:
        """Judge the step ``plan`` the rank just ran; ``view`` is the rank's ``RankView``."""
        if not plan.writes or not self.judged:
            return
        views = {v.req_index: v for v in plan.views}
        for group, store in self.judged:
            changed = view.step_read_rows(store)
            if not changed and group.retention not in _RELEASES:  # all judged after the step, as read
                continue
            for w in plan.writes:
                req = views.get(w.req_index)
                if req is None or w.stop <= w.start:
                    continue
                self._judge_write(plan, group, store, view, w, req, changed.get(w.req_index))

    def _judge_write(self, plan, group: ExpectedGroup, store: int, view, w, req, read_row) -> None:
        """One request's write in one group: its context keys the check after the step does
        not judge through the same block (``read_row``: its row as read, when it changed since)."""
        after = retained_start(group, req.num_committed) if group.storage is Storage.PAGED else 0
        if after == 0 and read_row is None:  # nothing left the group: the check after the step reads it all
            return
        lo, hi = read_keys(group, w.start, w.stop)
        below = min(hi, max(lo, after))  # keys [lo, below): no longer retained after the step
        if below <= lo and read_row is None:
            return
        now = view.block_table_row(store, w.req_index)
        row = now if read_row is None else read_row
        keys = np.arange(lo, hi if read_row is not None else below, dtype=np.int64)
        keys = keys[owned_mask(group, keys, self.rank, w.request_id)]
        local = (
            helix_local_of(keys, group.prompt_len(w.request_id), group.block_size, group.dcp_size) if group.helix else local_of(group, keys)
        )
        if read_row is not None:  # past ``below`` only the columns that changed since the read
            column = local // group.page_states
            same = np.zeros(len(keys), dtype=bool)
            inside = column < min(len(row), len(now))
            same[inside] = row[column[inside]] == now[column[inside]]
            pick = (keys < below) | ~same
            keys, local = keys[pick], local[pick]
        if not len(keys):
            return
        self.read += len(keys)
        slots = read_slots(group, row, local)
        got = view.read_entries(store, slots)
        content = req.fingerprints[emit_positions(group, keys)]
        bad = (got[:, INDEX] != keys) | (got[:, CONTENT] != content) | (got[:, GROUP] != store) | (slots < 0)
        if bad.any():
            self._add(plan, group, w, row, keys, local, slots, got, content, bad)

    def _add(self, plan, group: ExpectedGroup, w, row: np.ndarray, keys, local, slots, got, content, bad) -> None:
        n = int(bad.sum())
        self.count += n
        if len(self.kept) >= MAX_KEPT:
            return
        i = int(np.flatnonzero(bad)[0])
        column = int(local[i]) // group.page_states
        block = int(row[column]) if column < len(row) else -1
        entry = got[i]
        if entry[INDEX] < 0:
            found = "nothing (never written)"
        else:
            other = int(entry[WRITER])
            writer = "this request" if other == w.req_index else self.request_ids.get(other, f"request #{other}")
            found = f"{group.index_kind} {int(entry[INDEX])} of {writer}"
        self.kept.append(
            MissingKey(
                self.rank,
                plan.step,
                group.name,
                w.request_id,
                w.start,
                int(keys[i]),
                group.index_kind,
                block,
                found,
                n,
                slot=int(slots[i]),
                content=int(content[i]),
                row=tuple(row.tolist()),
                owner=self.rank if group.sharded else "all",
            )  # fmt: skip
        )
