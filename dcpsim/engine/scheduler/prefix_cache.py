"""Prefix caching across all groups, hashed per hash block and hit per whole unit.

As upstream vLLM 0.33.0: prefixes are hashed per hash block of ``G`` tokens (the engine's
``prefix_hash_block_size``, the GCD of the groups' block spans); block ``j`` of a group is
found by the key of the last hash block inside it, ``(h, fingerprint of the prefix ending
at prefix_key_position(h))``. Each group finds its own run of cached blocks, and the hit
is the longest prefix every group holds (each cached block credited with
``Engine.prefix_block_tokens`` tokens), rounded down to the hit unit (the engine's
``prefix_hash_unit``, the LCM of the spans) and leaving at least one token to compute
(``dcpsim.model.prefix_hit``); with an EAGLE / MTP drafter each EAGLE group's run (a group
holding a draft layer; every group when none does) gives up its last block first
(``Engine.prefix_hit_tokens``). Every group then reuses the whole blocks the hit covers,
the same block ids on every rank.

Units of the LCM of the spans become findable (registered, and advertised as KV events)
whole, once every position of the unit is written (the scheduler's own bookkeeping).

Partial-block hits (``prefix_match_unit`` ``M`` > 0, vLLM's fine-grained hits): past the whole
units, a hit may go on ``m * M`` tokens into the next block of every group (less than the
smallest span). A block is findable under an alias key per committed match boundary inside
it, ``(block index, tokens into it, fingerprint of the prefix ending there)``
(``BlockPool.cache_alias``), until it is handed out again. The hit's partial block is shared
by the request that computed it, so the admitted request gets a private block and a copy of
the hit tokens (``PartialHit``, the scheduler's copy-on-write).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dcpsim.engine.interface import Engine
from dcpsim.engine.scheduler.managers import GroupManager
from dcpsim.engine.scheduler.request import Request
from dcpsim.model.plan import KVEvent
from dcpsim.model.prefix_hit import block_key_hash_block, blocks_in_hit, per_group


@dataclass(frozen=True)
class PartialHit:
    """A hit's tokens past its whole units: ``tokens`` positions of block ``index`` of every
    group (the hit's whole tokens ``start`` divided by the group's span), found in block
    ``sources[g]`` of group ``g``. What the copy-on-write copies into the request's private block."""

    start: int
    tokens: int
    index: tuple[int, ...]
    sources: tuple[int, ...]


class PrefixCache:
    def __init__(self, managers: list[GroupManager], engine: Engine, *, eagle: bool | Sequence[bool] = False, match_unit: int = 0):
        """``eagle``: which groups are EAGLE groups (``model.prefix_hit.eagle_groups``; one bool
        for every group): a hit leaves the last cached block of each of them to recompute
        (``Engine.prefix_hit_tokens``)."""
        self.managers = managers
        self.eagle = per_group(eagle, len(managers))
        self.engine = engine
        self.geometries = [m.geometry for m in managers]
        self.spans = [g.manager_block_size for g in self.geometries]
        """Tokens one block-table entry of each group covers."""
        self.unit = math.lcm(*self.spans)
        """Tokens of a registration unit: a unit becomes findable whole, in every group."""
        self.hash_block = engine.prefix_hash_block_size(self.geometries)
        self.match_unit = match_unit
        """``prefix_match_unit``: 0, or the boundary (tokens) a partial-block hit may end on."""
        self._registered: dict[int, int] = {}
        self._partial_done: dict[int, int] = {}
        """Request -> the match boundaries registered as alias keys (``register_partial``)."""
        self.events: list[KVEvent] = []
        """The KV events of the units registered since the scheduler last took them."""

    def _key(self, req: Request, group: int, block: int) -> tuple:
        h = block_key_hash_block(self.spans[group], max(1, self.hash_block), block)
        end = self.engine.prefix_key_position(self.geometries, h)
        return (h, int(req.fingerprints[end]))

    def cached_run(self, req: Request, group: int, limit: int) -> list[int]:
        """The leading blocks of group ``group`` cached for ``req``'s prompt (at most
        ``limit`` tokens' worth of whole blocks)."""
        pool = self.managers[group].pool
        blocks: list[int] = []
        while (len(blocks) + 1) * self.spans[group] <= limit:
            b = pool.lookup(self._key(req, group, len(blocks)))
            if b is None:
                break
            blocks.append(b)
        return blocks

    def lookup(self, req: Request) -> tuple[int, list[list[int]]]:
        """Longest cached prefix (tokens) and its blocks per group."""
        limit = req.num_known - 1
        runs = [self.cached_run(req, g, limit) for g in range(len(self.managers))]
        hit = self.engine.prefix_hit_tokens(self.geometries, [len(r) for r in runs], limit, self.eagle)
        return hit, [run[: blocks_in_hit(hit, span)] for run, span in zip(runs, self.spans)]

    def partial(self, req: Request, hit: int) -> PartialHit | None:
        """The longest partial-block extension of a whole hit of ``hit`` tokens: ``m`` match
        units into the next block of every group (fewer tokens than the smallest span), still
        leaving one token to compute, where every group's block holds that prefix."""
        unit, limit = self.match_unit, req.num_known - 1
        if not unit or hit % self.unit:
            return None
        index = tuple(hit // span for span in self.spans)
        m = (min(limit - hit, min(self.spans) - 1)) // unit
        while m > 0:
            end = hit + m * unit
            sources = [m_.pool.lookup(self._alias(req, g, index[g], end)) for g, m_ in enumerate(self.managers)]
            if all(b is not None for b in sources):
                return PartialHit(hit, m * unit, index, tuple(sources))
            m -= 1
        return None

    def _alias(self, req: Request, group: int, block: int, end: int) -> tuple:
        return ("partial", block, end - block * self.spans[group], int(req.fingerprints[end - 1]))

    def register_partial(self, req: Request) -> None:
        """Make every match boundary the request has committed since the last call findable
        inside the block of each group holding it (alias keys)."""
        unit = self.match_unit
        if not unit:
            return
        done = self._partial_done.get(req.index, 0)
        for end in range(done + unit, req.num_computed + 1, unit):
            for g, m in enumerate(self.managers):
                table, span = m.held(req.index), self.spans[g]
                j = (end - 1) // span
                if end % span and j < len(table) and table[j]:
                    m.pool.cache_alias(self._alias(req, g, j, end), table[j])
        self._partial_done[req.index] = max(done, req.num_computed // unit * unit)

    def computed_units(self, req: Request) -> int:
        """Leading units of ``req`` whose KV is written: every position of the unit, its
        last one included, committed by a step that has run. Only these may be registered
        (the seam that decides when a unit becomes findable)."""
        return req.num_computed // self.unit

    def register(self, req: Request) -> None:
        """Make the request's fully computed units findable (and, with ``prefix_match_unit``,
        its committed match boundaries inside blocks: ``register_partial``)."""
        self.register_partial(req)
        done = self._registered.get(req.index, 0)
        full = self.computed_units(req)
        if full <= done:
            return
        for g, m in enumerate(self.managers):
            table = m.held(req.index)
            span = self.spans[g]
            for j in range(done * self.unit // span, min(full * self.unit // span, len(table))):
                m.pool.cache(self._key(req, g, j), table[j])
        for u in range(done, full):
            self._advertise(req, u)
        self._registered[req.index] = full

    def _advertise(self, req: Request, unit: int) -> None:
        """One ``BlockStored`` event per hash block of a newly findable unit."""
        self._advertise_span(req, unit * self.unit, (unit + 1) * self.unit)

    def hit(self, req: Request, hit: int, *, report_full: bool) -> None:
        """``req`` reuses the cached blocks of its first ``hit`` tokens: their units are
        registered already (not advertised again as the request's own), and with
        ``report_full`` (``kv_cache_report_mode = "full"``) their events are advertised
        again, so a router that missed them learns them."""
        self._registered[req.index] = max(self._registered.get(req.index, 0), hit // self.unit)
        if report_full:
            self._advertise_span(req, 0, hit // self.unit * self.unit)

    def _advertise_span(self, req: Request, start: int, stop: int) -> None:
        hb = max(1, self.hash_block)
        for begin in range(start, stop, hb):
            end = begin + hb
            self.events.append(KVEvent(req.request_id, begin, end, int(req.fingerprints[end - 1])))

    def take_events(self) -> tuple[KVEvent, ...]:
        events, self.events = tuple(self.events), []
        return events

    def forget(self, req: Request) -> None:
        self._registered.pop(req.index, None)
        self._partial_done.pop(req.index, None)
