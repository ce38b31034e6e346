"""Prefix caching across all groups at one hash unit.

The engine gives the hash unit (the reference: the LCM of every group's manager
block size, ``B * W`` for a single sharded group) and the position keying a unit. A unit ``u`` of a request
is keyed by ``(u, fingerprint of the prefix ending at the unit)``; a hit
needs the key in every group and reuses the same block ids on every rank.
Hits come in whole units, stop at the first miss, and leave at least one
token to compute.
"""

from __future__ import annotations

from dcpsim.engine.interface import Engine
from dcpsim.engine.scheduler.managers import GroupManager
from dcpsim.engine.scheduler.request import Request
from dcpsim.model.plan import KVEvent


class PrefixCache:
    def __init__(self, managers: list[GroupManager], engine: Engine):
        self.managers = managers
        self.engine = engine
        self.geometries = [m.geometry for m in managers]
        self.unit = engine.prefix_hash_unit(self.geometries)
        self.hash_block = engine.prefix_hash_block_size(self.geometries)
        self._registered: dict[int, int] = {}
        self.events: list[KVEvent] = []
        """The KV events of the units registered since the scheduler last took them."""

    def _key(self, req: Request, unit: int) -> tuple:
        end = self.engine.prefix_key_position(self.geometries, unit)
        return (unit, int(req.fingerprints[end]))

    def lookup(self, req: Request) -> tuple[int, list[list[int]]]:
        """Longest cached prefix (tokens) and its blocks per group."""
        max_units = (req.num_known - 1) // self.unit
        hit_blocks: list[list[int]] = [[] for _ in self.managers]
        units = 0
        while units < max_units:
            key = self._key(req, units)
            found = []
            for m in self.managers:
                per_unit = self.unit // m.geometry.manager_block_size
                blocks = [m.pool.lookup((key, j)) for j in range(per_unit)]
                if any(b is None for b in blocks):
                    break
                found.append(blocks)
            else:
                for g, blocks in enumerate(found):
                    hit_blocks[g].extend(blocks)
                units += 1
                continue
            break
        return units * self.unit, hit_blocks

    def computed_units(self, req: Request) -> int:
        """Leading units of ``req`` whose KV is written: every position of the unit, its
        last one included, committed by a step that has run. Only these may be registered
        (the seam that decides when a unit becomes findable)."""
        return req.num_computed // self.unit

    def register(self, req: Request) -> None:
        """Make the request's fully computed units findable."""
        done = self._registered.get(req.index, 0)
        full = self.computed_units(req)
        for u in range(done, full):
            key = self._key(req, u)
            for m in self.managers:
                per_unit = self.unit // m.geometry.manager_block_size
                table = m.held(req.index)
                for j in range(per_unit):
                    m.pool.cache((key, j), table[u * per_unit + j])
            self._advertise(req, u)
        self._registered[req.index] = max(done, full)

    def _advertise(self, req: Request, unit: int) -> None:
        """One ``BlockStored`` event per hash block of a newly findable unit."""
        hb = max(1, self.hash_block)
        for start in range(unit * self.unit, (unit + 1) * self.unit, hb):
            stop = start + hb
            self.events.append(KVEvent(req.request_id, start, stop, int(req.fingerprints[stop - 1])))

    def take_events(self) -> tuple[KVEvent, ...]:
        events, self.events = tuple(self.events), []
        return events

    def forget(self, req: Request) -> None:
        self._registered.pop(req.index, None)
