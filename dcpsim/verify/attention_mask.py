"""The checker's judgement of the speculative-decode (verify) attention mask, every step.

A verify step runs ``q <= 1 + k`` query tokens at positions ``c + [0, q)`` of a request whose
context before the step is ``c``. Query token ``j`` may attend exactly the keys at positions
``<= c + j`` (causal over positions). On a rank of a sharded group the keys are the rank's own,
in local order: the positions ``p < c + q`` whose run of ``I`` is the rank's (run ``p // I``
belongs to rank ``(p // I) % W``), ascending. So the expected mask of a row is
``position(local key l) <= c + j``, derived here from the scenario's ``W`` and ``I`` alone;
nothing calls the engine's layout math. Under Helix the rank's keys are those its layout gives
it (``verify.helix.helix_rank_positions``: a verify row of ``1 + d`` tokens may straddle a block
boundary, so its tokens' keys land on two ranks). A key the mask shows that comes after the query is a
leak (the token reads a later draft); a key it hides that the query must see is a lost key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.plan import SpecDecodeMask, StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.helix import helix_rank_positions
from dcpsim.verify.oracle import owned_count

MAX_KEPT = 20


def rank_key_positions(group: ExpectedGroup, length: int, rank: int, request_id: str | None = None) -> np.ndarray:
    """The positions ``< length`` that rank ``rank`` holds, in its local order (ascending);
    under Helix request ``request_id``'s (``verify.helix``: its prompt length places them)."""
    if group.helix:
        return helix_rank_positions(group.prompt_len(request_id), length, rank, group.block_size, group.dcp_size)
    W, I = group.dcp_size, group.interleave_size
    runs = np.arange(rank, -(-length // I), W, dtype=np.int64)  # the rank's runs: r, r + W, ...
    positions = (runs[:, None] * I + np.arange(I, dtype=np.int64)[None, :]).reshape(-1)
    return positions[positions < length]


def expected_visible(group: ExpectedGroup, context: int, q: int, rank: int, request_id: str | None = None) -> np.ndarray:
    """``[q, n]`` bool: query token ``j`` (position ``context + j``) may see local key ``l``."""
    if not group.helix:  # the rank's keys ascend: row j shows the first owned_count(context + j + 1) of them
        seen = np.array([owned_count(group, rank, context + j + 1) for j in range(q)], dtype=np.int64)
        return np.arange(owned_count(group, rank, context + q), dtype=np.int64)[None, :] < seen[:, None]
    keys = rank_key_positions(group, context + q, rank, request_id)
    return keys[None, :] <= context + np.arange(q, dtype=np.int64)[:, None]


_ROW_BY_ROW_MIN = 1 << 14
"""From this many entries on, ``MaskJudge`` first looks at a mask row by row
(``_shows_exactly_its_prefixes``: about 11 us, whatever the size); below it, building the
expected mask and comparing costs less (6 us at ``[4, 13]``)."""


def _shows_exactly_its_prefixes(group: ExpectedGroup, context: int, q: int, rank: int, have: np.ndarray) -> bool:
    """Whether ``have`` is ``expected_visible`` (not under Helix): of the right shape, and each
    row ``j`` shows all of its first ``owned_count(context + j + 1)`` keys and none after them.
    One look at each entry, row by row, of a mask over the whole local context (``[4, 125K]``
    a decode step at 1M tokens, W = 8: 0.017 ms, where building the expected mask and comparing
    took 0.13 ms)."""
    if have.shape != (q, owned_count(group, rank, context + q)):
        return False
    for j in range(q):
        seen = owned_count(group, rank, context + j + 1)
        if not have[j, :seen].all() or have[j, seen:].any():
            return False
    return True


@dataclass(frozen=True)
class MaskMismatch:
    rank: int
    step: int
    group: str
    request_id: str
    query_position: int
    key_position: int | None
    """The position of the first wrongly judged key (None: the mask has the wrong shape)."""
    leaks: int
    """Keys the mask shows a query token that come after it, over the row."""
    hidden: int
    """Keys the mask hides from a query token that it must see, over the row."""
    shape: str = ""

    def __str__(self) -> str:
        where = f"rank {self.rank} step {self.step} group {self.group} request {self.request_id}"
        if self.key_position is None:
            return f"{where}: the spec-decode mask is {self.shape}"
        what = "sees" if self.key_position > self.query_position else "does not see"
        return (
            f"{where}: the query at position {self.query_position} {what} the key at position {self.key_position} "
            f"({self.leaks} later key(s) shown, {self.hidden} earlier key(s) hidden over the row)"
        )


class MaskJudge:
    """Judges each step's spec-decode masks of every sharded group; keeps the first mismatches."""

    def __init__(self, rank: int, groups: list[ExpectedGroup], store_of: list[int]):
        self.rank = rank
        self.by_store = {s: g for s, g in zip(store_of, groups)}
        self.count = 0
        self.checks = 0
        """Decode rows whose mask was judged."""
        self.kept: list[MaskMismatch] = []

    def judge(self, plan: StepPlan, masks: list[SpecDecodeMask] | None) -> None:
        for mask in masks or ():
            group = self.by_store.get(mask.group)
            if group is None or not group.sharded:
                continue
            for rid, c, q, have in zip(mask.request_ids, mask.context_lens.tolist(), mask.query_lens.tolist(), mask.visible):
                self.checks += 1
                self._judge_row(plan, group, rid, c, q, np.asarray(have, dtype=bool))

    def add(self, mismatch: MaskMismatch) -> None:
        """Count a mismatch; keep the first ``MAX_KEPT``."""
        self._add(mismatch)

    def _judge_row(self, plan: StepPlan, group: ExpectedGroup, rid: str, c: int, q: int, have: np.ndarray) -> None:
        if not group.helix and have.size >= _ROW_BY_ROW_MIN and _shows_exactly_its_prefixes(group, c, q, self.rank, have):
            return
        want = expected_visible(group, c, q, self.rank, rid)
        if have.shape != want.shape:
            self._add(MaskMismatch(self.rank, plan.step, group.name, rid, c, None, 0, 0, f"{have.shape}, expected {want.shape}"))
            return
        wrong = have != want
        if not wrong.any():
            return
        keys = rank_key_positions(group, c + q, self.rank, rid)
        leaks, hidden = int((have & ~want).sum()), int((~have & want).sum())
        j, col = np.argwhere(wrong)[0]
        self._add(MaskMismatch(self.rank, plan.step, group.name, rid, c + int(j), int(keys[col]), leaks, hidden))

    def _add(self, mismatch: MaskMismatch) -> None:
        self.count += 1
        if len(self.kept) < MAX_KEPT:
            self.kept.append(mismatch)
