"""Write-time violations, judged from a rank's write log: a write into the null block,
into a block the request does not hold, outside the store, or twice into one slot in a step.

The guard only asks which block a slot falls in (``slot // states per block``, the store's
own shape) and compares with the blocks the plan gave the request; it never recomputes
where a position should go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.distinct import has_repeats, member_of
from dcpsim.model.plan import StepPlan, WriteRecord

MAX_KEPT = 20
_NONE = np.zeros(0, np.int64)


@dataclass(frozen=True)
class Violation:
    """A run of ``count`` consecutive indices (and slots) with one reason."""

    rank: int
    step: int
    group: str
    request_id: str
    index: int
    slot: int
    reason: str
    count: int = 1
    last_index: int = -1

    def __str__(self) -> str:
        if self.count == 1:
            where = f"index {self.index} slot {self.slot}"
        else:
            where = f"slots {self.slot}..{self.slot + self.count - 1} ({self.count} writes, indices {self.index}..{self.last_index})"
        return f"rank {self.rank} step {self.step} group {self.group} request {self.request_id} {where}: {self.reason}"


class WriteGuard:
    def __init__(self, rank: int, group_names: dict[int, str]):
        """``group_names``: the engine's group id -> the group's name, for messages."""
        self.rank = rank
        self.group_names = group_names
        self.kept: list[Violation] = []
        self.count = 0
        self._step = -1

    def _add(self, group: int, request_id: str, index: int, slot: int, reason: str) -> None:
        self.count += 1
        name = self.group_names.get(group, f"#{group}")
        if self.kept:
            last = self.kept[-1]
            if (last.step, last.group, last.request_id, last.reason) == (self._step, name, request_id, reason) and (
                slot == last.slot + last.count
            ):
                self.kept[-1] = Violation(**{**last.__dict__, "count": last.count + 1, "last_index": int(index)})
                return
        if len(self.kept) < MAX_KEPT:
            self.kept.append(Violation(self.rank, self._step, name, request_id, int(index), int(slot), reason, 1, int(index)))

    def judge(self, plan: StepPlan, writes: list[WriteRecord], store_shapes: dict[int, tuple[int, int]]) -> None:
        """Record the violations among one step's writes (``store_shapes``: group id ->
        (blocks, states per block) of its store)."""
        self._step = plan.step
        written: dict[int, list[tuple[np.ndarray, np.ndarray, str]]] = {}
        for w in writes:
            num_blocks, per_block = store_shapes[w.group]
            slots, indices = w.slots, w.index
            if not len(slots):
                continue
            held = plan.rows_before[w.group].get(w.req_index, _NONE)
            blocks = slots // per_block
            inside = None  # the usual case: every slot inside the store, none in block 0
            if slots.min() >= per_block and slots.max() < num_blocks * per_block:
                foreign = ~member_of(blocks, held)
            else:
                inside = (slots >= 0) & (slots < num_blocks * per_block)
                for i in np.nonzero(~inside)[0][:MAX_KEPT]:
                    self._add(w.group, w.request_id, indices[i], slots[i], "slot outside the KV store")
                self.count += max(0, int((~inside).sum()) - MAX_KEPT)
                null = inside & (blocks == 0)
                for i in np.nonzero(null)[0]:
                    self._add(w.group, w.request_id, indices[i], slots[i], "write into the null block 0")
                foreign = inside & ~null & ~member_of(blocks, held)
            for i in np.flatnonzero(foreign):
                self._add(w.group, w.request_id, indices[i], slots[i], f"write into block {blocks[i]}, which the request does not hold")
            if inside is not None:
                slots, indices = slots[inside], indices[inside]
            written.setdefault(w.group, []).append((slots, indices, w.request_id))
        for g, parts in written.items():
            slots = np.concatenate([p[0] for p in parts])
            if has_repeats(slots):
                uniq, first, counts = np.unique(slots, return_index=True, return_counts=True)
                owners = np.concatenate([[p[2]] * len(p[0]) for p in parts])
                idx = np.concatenate([p[1] for p in parts])
                for u, f in zip(uniq[counts > 1], first[counts > 1]):
                    self._add(g, owners[f], idx[f], u, "slot written more than once in one step")
