"""Write-time violations, judged from a rank's write log: a write into the null block,
into a block the request does not hold, outside the store, or twice into one slot in a step.

The guard only asks which block a slot falls in (``slot // states per block``, the store's
own shape) and compares with the blocks the plan gave the request; it never recomputes
where a position should go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.distinct import TABLE_MIN, has_repeats, member_of
from dcpsim.model.plan import StepPlan, WriteRecord

MAX_KEPT = 20
_AT_ONCE = 3
"""Writes in a step from which ``WriteGuard.judge`` judges them all at once."""
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


def _by_group(writes: list[WriteRecord], slots: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Keys of ``slots`` equal only where two writes of one group share a slot: group x
    (largest slot + 1) + slot, a range of groups times the largest slot. Below ``TABLE_MIN``
    slots, which ``has_repeats`` sorts whatever their range, they cost two passes against
    ``_apart_by_group``'s dozen."""
    group = np.repeat(np.array([w.group for w in writes], dtype=np.int64), lengths)
    return group * (int(slots.max()) + 1) + slots


def _apart_by_group(writes: list[WriteRecord], slots: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``_by_group``'s keys in a narrow range: each group's slots shifted past the ranges of
    the groups before it, so the keys span the groups' ranges together, not groups x the
    largest slot (``has_repeats`` then marks them in a table instead of sorting them)."""
    group = np.array([w.group for w in writes], dtype=np.int64)
    lo = np.minimum.reduceat(slots, starts)  # per write: every write holds a slot
    hi = np.maximum.reduceat(slots, starts)
    groups = int(group.max()) + 1
    first, last = np.full(groups, np.iinfo(np.int64).max), np.full(groups, -1)
    np.minimum.at(first, group, lo)
    np.maximum.at(last, group, hi)
    held = last >= first  # the groups with writes
    width = np.where(held, last - first + 1, 0)
    shift = np.cumsum(width) - width - np.where(held, first, 0)  # group g's slots start past the widths below it
    return slots + np.repeat(shift[group], lengths)


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
        writes = [w for w in writes if len(w.slots)]
        # both report the same; all at once costs less from about three writes a step on
        if len(writes) < _AT_ONCE or not self._judge_inside(plan, writes, store_shapes):
            self._judge_each(plan, writes, store_shapes)

    def _judge_inside(self, plan: StepPlan, writes: list[WriteRecord], store_shapes) -> bool:
        """The usual step, all its writes at once: when every slot lies inside its store and
        outside the null block, report the writes into blocks the request does not hold and
        the slots written twice, as ``_judge_each`` would; False (nothing judged) otherwise."""
        lengths = np.array([len(w.slots) for w in writes], dtype=np.int64)
        shapes = np.array([store_shapes[w.group] for w in writes], dtype=np.int64).reshape(-1, 2)
        slots = np.concatenate([w.slots for w in writes]).astype(np.int64, copy=False)
        per_block = np.repeat(shapes[:, 1], lengths)
        if not ((slots >= per_block) & (slots < np.repeat(shapes[:, 0], lengths) * per_block)).all():
            return False
        blocks = slots // per_block
        held = [np.asarray(plan.rows_before[w.group].get(w.req_index, _NONE), dtype=np.int64) for w in writes]
        pool = np.concatenate(held)
        span = int(max(blocks.max(), pool.max() if len(pool) else 0)) + 1
        owner = np.repeat(np.arange(len(writes), dtype=np.int64), lengths)
        pool_owner = np.repeat(np.arange(len(writes), dtype=np.int64), [len(h) for h in held])
        keep = pool >= 0  # a negative entry holds no block (and must not alias another write's key)
        foreign = ~member_of(owner * span + blocks, (pool_owner * span + pool)[keep])
        starts = np.cumsum(lengths) - lengths
        for i in np.flatnonzero(foreign):
            w = writes[owner[i]]
            index = w.index[i - starts[owner[i]]]
            self._add(w.group, w.request_id, index, slots[i], f"write into block {blocks[i]}, which the request does not hold")
        if has_repeats(_apart_by_group(writes, slots, lengths, starts) if len(slots) >= TABLE_MIN else _by_group(writes, slots, lengths)):
            written: dict[int, list[tuple[np.ndarray, np.ndarray, str]]] = {}
            for w in writes:
                written.setdefault(w.group, []).append((w.slots, w.index, w.request_id))
            self._repeats(written)
        return True

    def _judge_each(self, plan: StepPlan, writes: list[WriteRecord], store_shapes) -> None:
        """Every write on its own: slots outside the store or in the null block, then
        blocks the request does not hold, then slots written twice."""
        written: dict[int, list[tuple[np.ndarray, np.ndarray, str]]] = {}
        for w in writes:
            num_blocks, per_block = store_shapes[w.group]
            slots, indices = w.slots, w.index
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
        self._repeats(written)

    def _repeats(self, written: dict[int, list[tuple[np.ndarray, np.ndarray, str]]]) -> None:
        """Slots written more than once in the step, group by group (``written``: group id ->
        its writes' (slots, indices, request id) inside the store, in order)."""
        for g, parts in written.items():
            slots = np.concatenate([p[0] for p in parts])
            if has_repeats(slots):
                uniq, first, counts = np.unique(slots, return_index=True, return_counts=True)
                owners = np.concatenate([[p[2]] * len(p[0]) for p in parts])
                idx = np.concatenate([p[1] for p in parts])
                for u, f in zip(uniq[counts > 1], first[counts > 1]):
                    self._add(g, owners[f], idx[f], u, "slot written more than once in one step")
