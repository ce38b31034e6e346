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
continues a prefix already advertised (by any request: the chain a router follows) or
starts one, and the events of a request in a step end on a whole hit unit. An engine
that advertises per group (vLLM's ``BlockStored`` of one group's block, ``KVEvent.group``)
is held to that group's manager block size instead of the hash block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import StepPlan
from dcpsim.verify.geometry import ExpectedGroup

MAX_KEPT = 20
UNMATCHED = "a router hashing prompts at that unit matches none of it"


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
        self.groups = groups
        self.unit = hash_block_size(groups) if groups else 1
        self.align = hit_alignment(groups) if groups else 1
        self.count = 0
        self.events = 0
        self.kept: list[EventMismatch] = []
        self._known: set[int] = set()
        """The prefixes advertised so far (by any request, in any group), by the fingerprint
        of the prefix each advertised block ends: the chain a router follows."""
        self._fingerprints: dict[str, object] = {}
        """Each request's true fingerprints, from the views of the steps it ran in."""
        self._pending: list = []
        """Events of requests no step has shown yet (advertised before the request ran: a
        full-mode hit whose admission then waited); judged once the request is seen."""

    def judge(self, plan: StepPlan) -> None:
        """Every event of the step (``_problem``; the step's events are one batch, so a block
        may chain on one advertised later in it), then: a request's own hash-block events of
        the step end on a whole hit unit. Rank 0 only: every rank's plans hold the same events
        (the scheduler knows no rank), and each rank judging them would count each wrong event
        once per rank."""
        if self.rank != 0:
            return
        self._fingerprints.update((v.request_id, v.fingerprints) for v in plan.views)
        events, self._pending = [*self._pending, *plan.kv_events], []
        ready = []
        for e in events:
            fp = self._fingerprints.get(e.request_id)
            if fp is None:
                self._pending.append(e)
                continue
            ready.append((e, fp))
            if e.stop <= len(fp):  # the range was advertised, right or wrong: the step's others chain on it
                self._known.add(int(fp[e.stop - 1]))
        ends: dict[str, int] = {}
        for e, fp in ready:
            self.events += 1
            problem = self._problem(e, fp)
            if problem:
                self._add(plan, e.request_id, problem)
                continue
            if e.group is None:
                ends[e.request_id] = e.stop
        for rid, end in ends.items():
            if end % self.align:
                unit = f"hit unit of {self.align} tokens (the LCM of the groups' manager block sizes)"
                self._add(plan, rid, f"events end at {end}, not on a whole {unit}")

    def _problem(self, e, fp) -> str:
        """What is wrong with one event ("": nothing). An event of every group (``group``
        None, dcpsim's) is one hash block; an event of one group (vLLM's, ``BlockStored`` of
        that group) is one block of the group's manager block size, or the partial tail of a
        prompt inside one: whole hash blocks, not a whole block, not ending where a block
        ends. Either starts on a hash block, keys the fingerprint of the prefix ending at its
        last token, and continues a prefix advertised before or starts one."""
        where = f"[{e.start}, {e.stop})"
        if e.group is not None and not 0 <= e.group < len(self.groups):
            return f"{where} names group {e.group}; the model has {len(self.groups)}"
        span, G = e.stop - e.start, self.unit
        if e.group is None:
            if span != G or e.start % G:
                return f"{where} is not one hash block of {G} tokens (the GCD of the groups' manager block sizes): {UNMATCHED}"
        else:
            M = self.groups[e.group].manager_block_size
            where += f" of group {self.groups[e.group].name}"
            whole = span == M and e.start % M == 0
            partial = 0 < span < M and span % G == 0 and e.start % G == 0 and e.stop % M != 0 and e.start // M == (e.stop - 1) // M
            if not (whole or partial):
                why = f"neither one block of {M} tokens (the group's manager block size) nor whole hash blocks of {G} inside one"
                return f"{where} is {why}: {UNMATCHED}"
        if e.stop > len(fp) or int(fp[e.stop - 1]) != e.key:
            return f"{where} keys {e.key}, not the fingerprint of the prefix ending at position {e.stop - 1}"
        if e.start and int(fp[e.start - 1]) not in self._known:
            return f"{where} does not continue a prefix advertised before (nothing ends at {e.start})"
        return ""

    def _add(self, plan, request_id, what) -> None:
        self.count += 1
        if len(self.kept) < MAX_KEPT:
            self.kept.append(EventMismatch(self.rank, plan.step, request_id, what))
