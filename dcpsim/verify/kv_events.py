"""The checker as a KV-aware router: it reads the prefix-cache events an engine advertises.

An engine that caches prefixes publishes a ``BlockStored`` event per hash block it makes
findable (vLLM's KV events, which routers such as Dynamo's match against their own hashes
of incoming prompts). The hashes are only useful if they are taken at the unit the
engine's lookups use; a router hashing at another unit matches nothing and reports a hit
rate of exactly 0, silently. Upstream vLLM 0.33.0 hashes at the GCD of the groups' manager
block sizes (``B * W`` for a sharded group, ``B`` for a replicated one) and aligns hits to
their LCM.

From the scenario alone this router expects: every event spans exactly one hash block,
starts on a multiple of it, keys the fingerprint of the prefix ending at its last token,
and the events of a request cover its cached units in whole hit-aligned spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import StepPlan
from dcpsim.verify.geometry import ExpectedGroup

MAX_KEPT = 20


def hash_block_size(groups: list[ExpectedGroup]) -> int:
    """The hash unit a router must use: the GCD of the groups' manager block sizes."""
    return math.gcd(*(g.manager_block_size for g in groups))


def hit_alignment(groups: list[ExpectedGroup]) -> int:
    """Hits are whole multiples of the LCM of the groups' manager block sizes."""
    return math.lcm(*(g.manager_block_size for g in groups))


def prefix_cacheable(groups: list[ExpectedGroup]) -> bool:
    return all(g.retention is Retention.FULL and g.storage in (Storage.PAGED, Storage.RECORDS) for g in groups)


@dataclass(frozen=True)
class EventMismatch:
    rank: int
    step: int
    request_id: str
    what: str

    def __str__(self) -> str:
        return f"rank {self.rank} step {self.step} request {self.request_id}: KV event {self.what}"


class KVEventRouter:
    def __init__(self, rank: int, groups: list[ExpectedGroup]):
        self.rank = rank
        self.unit = hash_block_size(groups) if groups else 1
        self.align = hit_alignment(groups) if groups else 1
        self.count = 0
        self.events = 0
        self.kept: list[EventMismatch] = []
        self._covered: dict[str, int] = {}

    def judge(self, plan: StepPlan) -> None:
        fingerprints = {v.request_id: v.fingerprints for v in plan.views}
        ends: dict[str, int] = {}
        for e in plan.kv_events:
            self.events += 1
            where = f"[{e.start}, {e.stop})"
            if e.stop - e.start != self.unit or e.start % self.unit:
                self._add(
                    plan,
                    e.request_id,
                    f"{where} is not one hash block of {self.unit} tokens (the GCD of "
                    "the groups' manager block sizes): a router hashing prompts at "
                    "that unit matches none of it",
                )
                continue
            fp = fingerprints.get(e.request_id)
            if fp is None or e.stop > len(fp) or int(fp[e.stop - 1]) != e.key:
                self._add(plan, e.request_id, f"{where} keys {e.key}, not the fingerprint of the prefix ending at position {e.stop - 1}")
                continue
            covered = self._covered.get(e.request_id, 0)
            if e.start not in (covered, 0):  # 0: advertised again after a preemption
                self._add(plan, e.request_id, f"{where} leaves a gap after the {covered} tokens advertised before")
            self._covered[e.request_id] = ends[e.request_id] = e.stop
        for rid, end in ends.items():
            if end % self.align:
                self._add(
                    plan,
                    rid,
                    f"events end at {end}, not on a whole hit unit of {self.align} tokens (the LCM of the groups' manager block sizes)",
                )

    def _add(self, plan, request_id, what) -> None:
        self.count += 1
        if len(self.kept) < MAX_KEPT:
            self.kept.append(EventMismatch(self.rank, plan.step, request_id, what))
