"""Two mistakes of a prefix cache, as mutated scheduler parts (tests only).

* ``register-before-written`` (``RegisterBeforeWritten``, a ``PrefixCache``): a hash unit
  becomes findable one step early: the unit holding the request's frontier is registered
  once its tokens are known and its blocks held, before the step that writes its last
  position has run. A request that looks the unit up meanwhile, or the request itself
  recomputed after a preemption inside the unit, hits positions nobody wrote.
* ``keep-key-on-reuse`` (``KeepKeyOnReuse``, a ``BlockPool``): a freed cached block keeps
  its prefix key when it is handed out to another request and overwritten, so a later
  lookup of the old prefix hits a block that now holds other content (and the block is
  never cached under its new content).
* ``stale-index-entry`` (``StaleIndexEntry``, a ``BlockPool``): the same mistake, half
  done: the reallocated block forgets its key (and is cached again for its new content),
  but the index keeps the old entry pointing at it.

Neither is a decision of the ``Engine`` interface (``dcpsim.engine.interface``): when a
unit is registered and when a reallocated block's key is dropped are bookkeeping of
dcpsim's own scheduler (the same for every engine, and ``--engine vllm`` does not run
vLLM's KV-cache manager), so they are not catalogue faults of
``dcpsim.engine.faults``. They override the scheduler's seams instead
(``PrefixCache.computed_units``, ``BlockPool.evict``, ``BlockPool.uncache``), installed through
``Scheduler.prefix_cache_class`` / ``Scheduler.block_pool_class``.
"""

from __future__ import annotations

import contextlib

from dcpsim.engine.scheduler.block_pool import BlockPool
from dcpsim.engine.scheduler.prefix_cache import PrefixCache
from dcpsim.engine.scheduler.scheduler import Scheduler


class RegisterBeforeWritten(PrefixCache):
    def computed_units(self, req):
        frontier = -(-req.num_computed // self.unit)  # the unit holding the frontier too
        held = min(len(m.held(req.index)) // (self.unit // m.geometry.manager_block_size) for m in self.managers)
        return min(frontier, held, req.num_known // self.unit)  # a unit with blocks and a key


class KeepKeyOnReuse(BlockPool):
    def evict(self, block):
        pass


class StaleIndexEntry(BlockPool):
    def uncache(self, key, block):
        pass


MUTATIONS = {
    "register-before-written": ("prefix_cache_class", RegisterBeforeWritten),
    "keep-key-on-reuse": ("block_pool_class", KeepKeyOnReuse),
    "stale-index-entry": ("block_pool_class", StaleIndexEntry),
}


@contextlib.contextmanager
def mutated(name: str):
    """Every ``Scheduler`` built inside (in-process runs included) has mutation ``name``."""
    attr, part = MUTATIONS[name]
    before = getattr(Scheduler, attr)
    setattr(Scheduler, attr, part)
    try:
        yield
    finally:
        setattr(Scheduler, attr, before)


# ----------------------------------------------------------------------------- the situations

PREEMPTED_INSIDE_UNIT = "preempted-inside-unit"
"""A request was preempted in prefill with its frontier inside a hash unit that a lookup of
its prompt can hit (what ``register-before-written`` needs to show)."""
EVICTED_PREFIX_ASKED_AGAIN = "evicted-prefix-asked-again"
"""A lookup probed a key whose block had been handed out again (``keep-key-on-reuse``)."""


class _RecordingPool(BlockPool):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.evicted: set = set()
        self.asked_again = False

    def uncache(self, key, block):
        self.evicted.add(key)
        super().uncache(key, block)

    def lookup(self, key):
        self.asked_again |= key in self.evicted
        return super().lookup(key)


class _RecordingScheduler(Scheduler):
    block_pool_class = _RecordingPool


def situations(scenario) -> set[str]:
    """Which of the two situations the reference schedule of ``scenario`` contains."""
    from dcpsim.engine.reference import ReferenceEngine

    engine = ReferenceEngine()
    sched = _RecordingScheduler(scenario, engine, engine.geometries(scenario.layers, scenario.config))
    found = set()
    while not sched.done:
        before = {r.index: (r.num_computed, r.num_known, r.num_preemptions) for r in sched.running}
        sched.step()
        if sched.prefix_cache is None:
            continue
        unit = sched.prefix_cache.unit
        for r in sched.requests:
            if r.index not in before or r.num_preemptions == before[r.index][2]:
                continue
            computed, known, _ = before[r.index]
            if known - computed > 1 and computed % unit and computed // unit < (known - 1) // unit:
                found.add(PREEMPTED_INSIDE_UNIT)
    if any(m.pool.asked_again for m in sched.managers):
        found.add(EVICTED_PREFIX_ASKED_AGAIN)
    return found
