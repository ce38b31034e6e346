"""``VllmScheduler``: dcpsim's step loop with vLLM's own ``KVCacheManager`` deciding every block.

dcpsim keeps its requests, their contents and acceptance pattern, the token budget and the
order of admission and preemption; every block decision goes through vLLM 0.33.0's
``vllm/v1/core`` as vLLM's scheduler calls it:

* prefix-cache hits: ``KVCacheManager.get_computed_blocks`` over the request's own block
  hashes (``vllm.v1.request.Request`` with vLLM's block hasher, at the hash block size
  ``resolve_kv_cache_block_sizes`` gives), the hit's blocks adopted by ``allocate_slots``;
* allocation, and the preemption signal: ``allocate_slots`` (``None``: the pool cannot hold
  the step, so the last running request is preempted, or the waiting one waits), with the
  drafter's lookahead as vLLM's scheduler passes it (``num_lookahead_tokens``: ``k`` for an
  EAGLE / MTP drafter, 0 for ngram; ``SimConfig.num_lookahead_tokens``, the rule of every
  release from 0.23.0 to 0.34.0);
* release: vLLM frees out-of-window blocks lazily, inside the next ``allocate_slots`` of the
  request (``remove_skipped_blocks``), not after each step as dcpsim's managers do;
* frees: ``KVCacheManager.free`` when a request finishes or is preempted (a finished
  request's rows are read for the step's plan before they go);
* KV events: the ``BlockStored`` events of the block pool, read after each call and handed
  to the checker's router per group (``KVEvent.group``).

vLLM's block pool is one pool shared by every group (block ids are global), so each group's
KV store is sized to the whole pool: ``pool_sizes`` is the shared pool's blocks for every
group, and the pool holds what dcpsim's per-group pools hold together. A configuration
vLLM refuses (its sliding-window, chunked-local and Mamba managers assert
``dcp_world_size == 1``) raises ``EngineError`` when the scheduler is built; the parent
turns it into exit 2 quoting vLLM (``VllmEngine.check_scenario``).

``--vllm-scheduler full`` reuses all of this (``dcpsim.engine.vllm.full_scheduler``): its
scheduler overrides ``_make_kv_manager`` to build vLLM's v1 ``Scheduler``, whose own
``KVCacheManager`` then serves the rows, the requests and the KV events read here.
"""

from __future__ import annotations

import types

import numpy as np

from dcpsim.engine.interface import EngineError
from dcpsim.engine.scheduler.request import Request
from dcpsim.engine.scheduler.scheduler import Scheduler, pool_sizes
from dcpsim.engine.vllm import eagle_groups, parallel_rules
from dcpsim.engine.vllm.connector import manager_connector
from dcpsim.engine.vllm.core import SamplingParams, VllmCore
from dcpsim.model.kinds import Storage
from dcpsim.model.plan import KVEvent, ReqWrite, ScheduleEvent

MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
SCHEDULER_DECISIONS = {
    "block allocation and the preemption signal": f"{MANAGER}.allocate_slots (num_lookahead_tokens: dcpsim's, vLLM's rule)",
    "prefix-cache hits": f"{MANAGER}.get_computed_blocks",
    "sliding-window and chunk release": f"{MANAGER}.allocate_slots (remove_skipped_blocks)",
    "frees": f"{MANAGER}.free",
    "block sizes (scheduler, hash)": "vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes",
    "kv events": f"{MANAGER}.take_events",
}
"""Who makes each scheduler-side decision under ``--vllm-scheduler manager``."""


class VllmScheduler(Scheduler):
    def __init__(self, scenario, engine, geometries, connector=None):
        self.core: VllmCore = engine.core
        self.vllm_engine = engine
        super().__init__(scenario, engine, geometries, connector=connector)

    # --- vLLM's manager, built once --------------------------------------------------

    def _init_blocks(self) -> None:
        core = self.core
        groups = self.engine.kv_cache_groups(self.scenario.layers)
        vgroups = [core.specs.KVCacheGroupSpec(list(g.layer_names), self.vllm_engine.vllm_spec(g.representative)) for g in groups]
        eagle_groups.mark(self.vllm_engine.tree, vgroups, groups, self.config)  # the drafter's groups, as the tree flags them
        shared = sum(pool_sizes(self.scenario, self.engine, self.geometries))
        self.pool_sizes = [shared] * len(self.geometries)
        """vLLM's one pool, shared by every group: each group's store holds all its blocks."""
        kv_cache_config = core.specs.KVCacheConfig(num_blocks=shared + 1, kv_cache_tensors=[], kv_cache_groups=vgroups)
        self.block_size, self.hash_block_size = core.call(
            "resolve_kv_cache_block_sizes", core.utils.resolve_kv_cache_block_sizes, kv_cache_config, self._vllm_config(groups)
        )
        core.init_none_hash()
        self.hasher = core.utils.get_request_block_hasher(self.hash_block_size, core.hash_fn)
        self.kv_manager = self._make_kv_manager(kv_cache_config)
        self.nixl = None if hasattr(self, "vllm") else manager_connector(self, kv_cache_config)  # P/D decode: vLLM's NIXL side
        self.managers = []
        self.prefix_cache = None
        self._vreqs: dict[int, object] = {}
        self._holding: dict[int, None] = {}  # request indices holding blocks, in order
        self._hits: dict[int, tuple] = {}
        self._loaded: dict[int, int] = {}  # request index -> tokens the connector loads on its admission
        self._events: list[KVEvent] = []
        self._hash_ends: dict[int, dict[bytes, int]] = {}  # request index -> hash -> the token it ends at
        self._ever_used: set[int] = set()
        self._reused = 0

    def _make_kv_manager(self, kv_cache_config):
        """vLLM's ``KVCacheManager`` over ``kv_cache_config``, as vLLM's scheduler builds it."""
        config = self.config
        budget = (  # releases.KV_MANAGER: the token budget's name in this tree
            dict(max_num_batched_tokens=config.max_num_batched_tokens)
            if self.vllm_engine.bindings.shape("kv_cache_manager") == "max-num-batched"
            else dict(max_in_flight_tokens=config.max_in_flight_tokens)
        )
        return self.core.call(
            "KVCacheManager",
            self.core.KVCacheManager,
            kv_cache_config,
            max_model_len=config.max_model_len,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            **budget,
            enable_caching=config.enable_prefix_caching,
            use_eagle=config.eagle_drop,
            enable_kv_cache_events=True,
            **self._cp_world_sizes(),
        )

    def _cp_world_sizes(self) -> dict:
        """The manager's CP sizes as the tree's scheduler hands them (``parallel_rules.release_sizes``):
        ``pcp_world_size`` only where the tree shards over PCP (and the scenario has PCP)."""
        dcp, pcp = parallel_rules.release_sizes(self.vllm_engine.tree, self.config)
        return dict(dcp_world_size=dcp, **({"pcp_world_size": pcp} if pcp > 1 and dcp < self.config.decode_context_parallel_size else {}))

    def _vllm_config(self, groups) -> types.SimpleNamespace:
        """What ``resolve_kv_cache_block_sizes`` reads of a ``VllmConfig``."""
        c = self.config
        dcp, pcp = parallel_rules.release_sizes(self.vllm_engine.tree, c)
        attention = [g.block_size for g in self.geometries if g.storage in (Storage.PAGED, Storage.RECORDS)]
        block_size = c.block_size or min(attention, default=self.geometries[0].block_size)
        return types.SimpleNamespace(
            cache_config=types.SimpleNamespace(
                block_size=block_size, prefix_match_unit=None, hash_block_size=None, enable_prefix_caching=c.enable_prefix_caching
            ),
            parallel_config=types.SimpleNamespace(
                decode_context_parallel_size=dcp,
                prefill_context_parallel_size=pcp,  # read before 0.26.0
            ),
            kv_transfer_config=None,
        )

    def _vreq(self, req: Request):
        """vLLM's ``Request`` of ``req``: the prompt's token ids, vLLM's block hasher."""
        if req.index not in self._vreqs:
            prompt = [int(t) for t in req.tokens[: req.spec.prompt_len]]
            vreq = self.core.call(
                "Request",
                self.core.Request,
                req.request_id,
                prompt,
                SamplingParams(req.spec.output_len),
                None,
                block_hasher=self.hasher,
            )
            vreq.kv_cache_report_mode = self.config.kv_cache_report_mode
            self._vreqs[req.index] = vreq
            self._index_hashes(req, vreq)
        return self._vreqs[req.index]

    # --- the allocation seams of dcpsim's step loop -----------------------------------

    def _start_from_cache(self, req: Request) -> tuple[int, int]:
        """The connector's loaded tokens (a P/D decode instance: ``allocate_slots`` gets
        them as ``num_external_computed_tokens``), else vLLM's prefix-cache hit. The
        connector is asked first, as dcpsim's scheduler asks it (vLLM asks after its local
        lookup; a decode instance's prompts are loaded whole either way)."""
        if req.num_computed:
            return 0, 0
        external = self.external_tokens(req)
        if external:
            self._loaded[req.index] = external
            req.num_computed = external
            return 0, external
        if not self.config.enable_prefix_caching:
            return 0, 0
        vreq = self._vreq(req)
        blocks, hit = self._call(req, "get_computed_blocks", self.kv_manager.get_computed_blocks, vreq)[:2]  # 0.26.0 on: and a third
        if hit:
            self._hits[req.index] = (blocks, hit)
            req.num_computed = hit
        return hit, 0

    def _try_allocate(self, req: Request, num_tokens: int) -> bool:
        vreq = self._vreq(req)
        blocks, hit = self._hits.pop(req.index, (None, 0))
        external = self._loaded.pop(req.index, 0)
        if external and self.nixl is not None:  # vLLM's NIXL scheduler side allocates the load first (nixl_scheduler)
            external = self.nixl.load(req, vreq, external)
            if external is None:
                return False
        vreq.num_computed_tokens = req.num_computed - hit - external
        new = self._call(
            req,
            "allocate_slots",
            self.kv_manager.allocate_slots,
            vreq,
            num_tokens - req.num_computed,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=self.config.num_lookahead_tokens,
            num_external_computed_tokens=external,
        )
        if new is None:
            return False
        vreq.num_computed_tokens = req.num_computed
        vreq.status = self.core.RequestStatus.RUNNING
        self._holding[req.index] = None
        self._count_reused(new)
        return True

    def _free(self, req: Request) -> None:
        if self._holding.pop(req.index, "not held") is None:
            self._call(req, "free", self.kv_manager.free, self._vreq(req))

    def _preempt(self, req: Request, events: list[ScheduleEvent], why) -> None:
        super()._preempt(req, events, why)
        vreq = self._vreq(req)  # as vLLM's Scheduler._preempt_request leaves it
        vreq.status = self.core.RequestStatus.PREEMPTED
        vreq.num_computed_tokens = 0
        vreq.spec_token_ids = []
        vreq.num_preemptions += 1

    def _settle(self, scheduled) -> None:
        """Nothing after the writes: vLLM caches the full blocks inside ``allocate_slots``
        and releases out-of-window blocks inside the next one."""

    def _execute(self, req: Request, n: int, drafts: int, step: int, events: list[ScheduleEvent]) -> ReqWrite:
        write = super()._execute(req, n, drafts, step, events)
        vreq = self._vreq(req)
        if req.num_known > vreq.num_tokens:  # the step's sampled tokens (accepted drafts and the bonus)
            vreq.append_output_token_ids([int(t) for t in req.tokens[vreq.num_tokens : req.num_known]])
            self._index_hashes(req, vreq)
        vreq.num_computed_tokens = req.num_computed  # rejected drafts rolled back
        return write

    def _rows(self) -> tuple[dict[int, np.ndarray], ...]:
        rows: tuple[dict[int, np.ndarray], ...] = tuple({} for _ in self.geometries)
        for index in self._holding:
            ids = self.kv_manager.get_block_ids(self.requests[index].request_id)
            for g, group_ids in enumerate(ids):
                rows[g][index] = np.asarray(group_ids, dtype=np.int64)
        return rows

    def _take_kv_events(self) -> tuple[KVEvent, ...]:
        events, self._events = tuple(self._events), []
        return events

    @property
    def summary(self) -> dict:
        return {**self.stats, "reused_blocks": self._reused, "requests": len(self.requests)}

    # --- helpers ---------------------------------------------------------------------

    def _call(self, req: Request, name: str, fn, *args, **kwargs):
        """A ``KVCacheManager`` call for ``req``; its KV events read at once (each names
        blocks of the request it was made for)."""
        try:
            return self.core.call(f"{MANAGER}.{name}", fn, *args, **kwargs)
        finally:
            self._read_events(req)

    def _read_events(self, req: Request) -> None:
        for event in self.kv_manager.take_events():
            if isinstance(event, self.core.BlockStored):
                self._events += self._kv_events(req, event)

    def _kv_events(self, req: Request, event) -> list[KVEvent]:
        """One ``KVEvent`` per block of a ``BlockStored`` of ``req``'s call: a block ends where
        the hash it carries ends (a hash block of ``req``'s chain), its span is the event's
        ``block_size``, its key ``req``'s fingerprint there (the router judges both)."""
        ends = self._hash_ends.get(req.index, {})
        out = []
        for h in event.block_hashes:
            stop = ends.get(bytes(h))
            if stop is None:
                stop = self._merged_end(ends, bytes(h))
            if stop is None:
                raise EngineError(
                    what=f"{MANAGER}.take_events",
                    function="vllm.v1.core.block_pool.BlockPool",
                    file="",
                    line=0,
                    message=f"a BlockStored event for {req.request_id!r} carries a hash of none of its blocks ({bytes(h).hex()[:16]})",
                )
            start = stop - int(event.block_size)
            out.append(KVEvent(req.request_id, start, stop, int(req.fingerprints[stop - 1]), group=event.group_idx))
        return out

    def _merged_end(self, ends: dict[bytes, int], h: bytes) -> int | None:
        """Where a block hash made of consecutive hash blocks ends (vLLM's
        ``BlockHashListWithBlockSize`` concatenates them for a group whose block spans several
        hash blocks: vllm-ascend's hash block is the GCD of the pages, unscaled by DCP), or None."""
        width = len(next(iter(ends), b""))
        if not width or len(h) <= width or len(h) % width:
            return None
        parts = [ends.get(h[i : i + width]) for i in range(0, len(h), width)]
        chained = all(p is not None for p in parts) and all(b - a == self.hash_block_size for a, b in zip(parts, parts[1:]))
        return parts[-1] if chained else None

    def _index_hashes(self, req: Request, vreq) -> None:
        """Where each of the request's block hashes ends (hash blocks of ``hash_block_size``)."""
        ends = self._hash_ends.setdefault(req.index, {})
        for i, h in enumerate(vreq.block_hashes):
            ends.setdefault(bytes(h), (i + 1) * self.hash_block_size)

    def _count_reused(self, new_blocks) -> None:
        """Newly allocated blocks that an earlier request had held: dcpsim's ``reused_blocks``
        (a prefix hit's adopted blocks are not allocations)."""
        for group_ids in new_blocks.get_block_ids():
            for b in group_ids:
                self._reused += b in self._ever_used
                self._ever_used.add(b)
