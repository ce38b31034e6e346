"""Write-time violations: a write into the null block, into a block the request
does not hold, outside the store, or twice into one slot within one step.

The guard only asks which page a slot falls in (``slot // states_per_page``,
the store's own geometry) and compares with the request's block-table row; it
never recomputes where a position should go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_KEPT = 20


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
            where = (
                f"slots {self.slot}..{self.slot + self.count - 1} "
                f"({self.count} writes, indices {self.index}..{self.last_index})"
            )
        return f"rank {self.rank} step {self.step} group {self.group} request {self.request_id} {where}: {self.reason}"


class WriteGuard:
    def __init__(self, rank: int, group_names: list[str], states_per_page: list[int], num_slots: list[int]):
        self.rank = rank
        self.group_names = group_names
        self.states_per_page = states_per_page
        self.num_slots = num_slots
        self.kept: list[Violation] = []
        self.count = 0
        self._step = -1
        self._written: list[list[tuple[np.ndarray, np.ndarray, str]]] = [[] for _ in group_names]

    def _add(self, group: int, request_id: str, index: int, slot: int, reason: str) -> None:
        self.count += 1
        name = self.group_names[group]
        if self.kept:
            last = self.kept[-1]
            if (last.step, last.group, last.request_id, last.reason) == (self._step, name, request_id, reason) and (
                slot == last.slot + last.count
            ):
                self.kept[-1] = Violation(**{**last.__dict__, "count": last.count + 1, "last_index": int(index)})
                return
        if len(self.kept) < MAX_KEPT:
            self.kept.append(Violation(self.rank, self._step, name, request_id, int(index), int(slot), reason, 1, int(index)))

    def begin_step(self, step: int) -> None:
        self._step = step
        self._written = [[] for _ in self.group_names]

    def check(self, group: int, request_id: str, held: np.ndarray, slots: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Record violations; return the mask of writes that land inside the store."""
        inside = (slots >= 0) & (slots < self.num_slots[group])
        for i in np.nonzero(~inside)[0][:MAX_KEPT]:
            self._add(group, request_id, indices[i], slots[i], "slot outside the KV store")
        self.count += max(0, int((~inside).sum()) - MAX_KEPT)
        blocks = slots // self.states_per_page[group]
        null = inside & (blocks == 0)
        foreign = inside & ~null & ~np.isin(blocks, held)
        for i in np.nonzero(null)[0]:
            self._add(group, request_id, indices[i], slots[i], "write into the null block 0")
        for i in np.nonzero(foreign)[0]:
            self._add(group, request_id, indices[i], slots[i], f"write into block {blocks[i]}, which the request does not hold")
        self._written[group].append((slots[inside], indices[inside], request_id))
        return inside

    def end_step(self) -> None:
        for g, parts in enumerate(self._written):
            if not parts:
                continue
            slots = np.concatenate([p[0] for p in parts])
            uniq, first, counts = np.unique(slots, return_index=True, return_counts=True)
            if (counts > 1).any():
                owners = np.concatenate([[p[2]] * len(p[0]) for p in parts])
                idx = np.concatenate([p[1] for p in parts])
                for u, f in zip(uniq[counts > 1], first[counts > 1]):
                    self._add(g, owners[f], idx[f], u, "slot written more than once in one step")
        self._written = [[] for _ in self.group_names]
