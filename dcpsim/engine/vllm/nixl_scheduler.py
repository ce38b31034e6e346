"""vLLM's NIXL connector, scheduler side, as a P/D decode instance's KV connector (both ``--vllm-scheduler`` modes).

vLLM builds a decode instance's scheduler-side connector with ``KVConnectorFactory``: for NIXL the
``NixlConnector`` facade over ``NixlPullConnectorScheduler`` (``nixl/pull_scheduler.py`` over
``nixl/base_scheduler.py`` from 0.24.0; ``NixlConnectorScheduler`` in ``nixl/scheduler.py`` in 0.23.0;
``releases.NIXL_SCHEDULER`` binds the shape a tree holds). dcpsim loads that class from the tree
(its ``metadata.py`` too; ``msgspec``, ``zmq`` and the rest of the connector package are stubs,
used only by the handshake listener dcpsim never starts) and hands vLLM's ``Scheduler`` this
facade, which forwards to it what vLLM's own facade forwards. vLLM's code then decides:

* how many tokens are external (``get_num_new_matched_tokens``: the prompt past the local hit,
  loaded asynchronously, so the request waits in ``WAITING_FOR_REMOTE_KVS``);
* which local blocks the pull fills (``update_state_after_alloc``: the request's blocks without a
  hash, clipped to the sliding window; 0.33.0 on: and how many blocks the local hit covers);
* the metadata the worker gets (``build_connector_meta``: ``reqs_to_recv``), and what a finished
  request frees (``request_finished``).

The worker side stays dcpsim's: the entries arrive through dcpsim's connector
(``dcpsim.engine.connector``) and are written into the block ids vLLM's code chose
(``PromptLoads.pulls``, read by ``write_loaded``), the chosen ids lined up with the request's
blocks from the first block the local hit does not cover, as NIXL's worker lines them up. A wrong
choice (too few blocks, a block of another request, one past the prompt) is wrong content the
checker sees. The transfer completes within the step that started it: the step's
``ModelRunnerOutput`` reports it in ``kv_connector_output.finished_recving``, and vLLM's next
``schedule()`` promotes the request, caches its blocks and schedules its last prompt token. Under
``--vllm-scheduler manager`` dcpsim's step loop makes the calls vLLM's ``Scheduler`` makes around the
load within the admitting step (``NixlSchedulerConnector.load``).

The request's ``kv_transfer_params`` are what the prefill instance's NIXL scheduler hands back at
``request_finished``, built from dcpsim's prefill run (``PromptLoads.remote``: the prefill
instance's block ids per group, sent by the prefill leader; its W and TP).
"""

from __future__ import annotations

import types

from dcpsim.engine.interface import EngineError
from dcpsim.engine.loading.bindings import bind, resolve
from dcpsim.engine.vllm.connector import IdleConnectorParts
from dcpsim.engine.vllm.releases import NIXL_SCHEDULER, NIXL_SUPPORT, VLLM_RELEASES

ENGINE_ID = "dcpsim-prefill"
"""The prefill instance's NIXL engine id in the decode requests' ``kv_transfer_params``."""
SIDE_CHANNEL = ("localhost", 5600)
"""vLLM's defaults of ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` (the prefill's handshake listener)."""


PD_CONNECTOR_DECISION = "P/D decode: the KV connector's scheduler side (external tokens, the blocks each pull fills)"
"""The scheduler decision ``engine info`` lists for a P/D decode instance's connector."""


def nixl_decision_text(tree_root) -> str:
    """Who makes ``PD_CONNECTOR_DECISION`` with this tree (``engine info``, reports)."""
    found = bind(tree_root, (NIXL_SCHEDULER,), release=None, label="vLLM", flag="--vllm-source", partial=True).bound["nixl_scheduler"]
    if found.shape is None:
        return "dcpsim's stand-in (dcpsim.engine.vllm.connector.SchedulerConnector: this tree holds no known NIXL scheduler side)"
    return (
        f"vllm {found.shape.module}.{found.shape.qualname.split('.')[0]} with kv_connector nixl (its transfer: dcpsim's connector); "
        "resharding: dcpsim's stand-in (dcpsim.engine.vllm.connector.SchedulerConnector)"
    )


def load_nixl(tree, release: str | None):
    """vLLM's NIXL scheduler class and its metadata module, loaded from ``tree`` (once per tree)."""
    cached = getattr(tree, "_dcpsim_nixl", None)
    if cached is not None:
        return cached
    bindings = bind(tree.root, (NIXL_SCHEDULER,), release=release if release in VLLM_RELEASES else None, label="vLLM", flag="--vllm-source")
    shape = bindings.bound["nixl_scheduler"].shape
    names = [*NIXL_SUPPORT[shape.name], shape.module]
    mods = tree.load(names)
    resolve(tree, mods, shape, f"known: {VLLM_RELEASES[0]}..{VLLM_RELEASES[-1]}")  # its signature, as loaded
    cls = getattr(mods[shape.module], shape.qualname.split(".")[0])
    tree._dcpsim_nixl = (shape, cls)
    return tree._dcpsim_nixl


class _TransferConfig:
    """What NIXL's scheduler reads of a ``KVTransferConfig`` (a consumer, KV on the device)."""

    kv_buffer_device = "cuda"
    kv_role = "kv_consumer"
    is_kv_producer = False
    is_kv_consumer = True

    def __init__(self, engine_id: str):
        self.engine_id = engine_id

    def get_from_extra_config(self, key, default):
        return default


def nixl_vllm_config(config, block_size: int, dcp: int) -> types.SimpleNamespace:
    """What NIXL's scheduler reads of the decode instance's ``VllmConfig``."""
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=config.tensor_parallel_size or dcp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_index=0,
            data_parallel_rank=0,
        ),
        cache_config=types.SimpleNamespace(block_size=block_size),
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        kv_transfer_config=_TransferConfig("dcpsim-decode"),
        num_prefill_lookahead_tokens=0,
    )


class NixlSchedulerConnector(IdleConnectorParts):
    """vLLM's NIXL scheduler side where vLLM's ``Scheduler`` calls its KV connector (see the module doc).

    ``loads``: dcpsim's ``PromptLoads`` of the decode instance (``remote``: the prefill's block ids per
    request and group, ``prefill``: its W and TP; ``pulls``: filled here with the block ids NIXL
    chose); ``sched``: dcpsim's ``VllmFullScheduler`` (its requests and group geometries)."""

    supports_divergent_local_hybrid_hits = False
    requires_kv_delivery = False

    def __init__(self, sched, loads, kv_cache_config, vllm_config):
        self.sched, self.loads = sched, loads
        self.by_id = {r.request_id: r for r in sched.requests}
        self.announced: set[str] = set()
        shape, cls = load_nixl(sched.vllm_engine.tree, sched.vllm_engine.version)
        self.shape = shape.name
        self.where = f"{shape.module}.{shape.qualname.split('.')[0]}"
        self.nixl = sched.core.call(f"{shape.module}.{shape.qualname}", cls, vllm_config, "dcpsim-decode", kv_cache_config)
        self.kv_cache_config = kv_cache_config
        self.hits: dict[str, int] = {}
        """request id -> the local hit vLLM asked NIXL about (tokens)."""
        self.inflight: dict[str, int] = {}
        """request id -> external tokens of a load whose request vLLM has not scheduled yet."""
        self.recving: set[str] = set()
        self.starts: dict[str, int] = {}
        """request id -> computed tokens of a loaded request vLLM scheduled this step (its ``NewRequestData``)."""
        self.kv_cache_manager = None

    # --- what dcpsim's full scheduler asks -------------------------------------------

    def take_loaded(self) -> tuple[tuple[int, int], ...]:
        """(request index, tokens the load counts as computed) of each loaded request vLLM
        scheduled this step: its computed tokens past the local hit (vLLM recomputes the last
        prompt token)."""
        out = []
        for rid, start in self.starts.items():
            self.inflight.pop(rid, None)
            out.append((self.by_id[rid].index, max(0, start - self.hits.get(rid, 0))))
        self.starts = {}
        return tuple(out)

    def connector_output(self):
        """The step's ``KVConnectorOutput``: the pulls started this step have finished."""
        done, self.recving = self.recving, set()
        return self.sched.core.outputs.KVConnectorOutput(finished_recving=done) if done else None

    def loading(self) -> bool:
        return bool(self.inflight)

    # --- what vLLM's Scheduler calls (NixlConnector's facade) -----------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.kv_cache_manager = kv_cache_manager

    def _params(self, request) -> None:
        if getattr(request, "kv_transfer_params", None):
            return
        req = self.by_id[request.request_id]
        remote = self.loads.remote.get(req.index)
        if remote is None or req.num_preemptions:
            return
        prefill = self.loads.prefill
        request.kv_transfer_params = dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=tuple(list(map(int, ids)) for ids in remote),
            remote_engine_id=ENGINE_ID,
            remote_request_id=f"{request.request_id}-prefill",
            remote_host=SIDE_CHANNEL[0],
            remote_port=SIDE_CHANNEL[1],
            tp_size=prefill.get("tp_size", 1),
            dcp_size=prefill.get("dcp_size", 1),
            pp_size=1,
            remote_num_tokens=req.spec.prompt_len,
        )

    def on_new_request(self, request) -> None:
        self._params(request)
        self.announced.add(request.request_id)
        hook = getattr(self.nixl, "on_new_request", None)
        if hook is not None:
            hook(request)

    # --- manager mode: dcpsim's step loop calls what vLLM's Scheduler would ------------

    def load(self, req, vreq, external: int) -> int | None:
        """``--vllm-scheduler manager``: admit ``req`` (``vreq``: its vLLM request) with its prompt
        loaded by NIXL, as vLLM's ``Scheduler`` does across the load: ask NIXL for the external
        tokens, allocate them with caching delayed (``allocate_slots(num_external_computed_tokens=...,
        delay_cache_blocks=True)``), tell NIXL the blocks (``update_state_after_alloc``), take the
        pull from its metadata (``build_connector_meta``), then, the pull done within the step, cache
        the blocks (``cache_blocks``, as ``_update_waiting_for_remote_kv``). ``external``: the tokens
        dcpsim's loop counts as loaded (all but the last prompt token). Returns the external tokens
        the step's own ``allocate_slots`` still gets (0: NIXL's load holds them; ``external``: a
        request the prefill run never finished, which has no remote blocks, as dcpsim's stand-in),
        or None when the pool cannot hold the load. NIXL loading another count than the whole prompt
        is an ``EngineError`` (dcpsim's loop counts the prompt loaded)."""
        if self.loads.remote.get(req.index) is None:
            return external
        rid = vreq.request_id
        if rid not in self.announced:
            self.on_new_request(vreq)
        sched = self.sched
        vreq.num_computed_tokens = 0
        tokens, _ = sched.core.call(f"{self.where}.get_num_new_matched_tokens", self.get_num_new_matched_tokens, vreq, 0)
        if tokens != external + 1:
            raise EngineError(
                what=f"{self.where}.get_num_new_matched_tokens",
                function=self.where,
                file="",
                line=0,
                message=f"NIXL loads {tokens} tokens of {rid!r}, whose prompt has {external + 1} (dcpsim's loop loads all but its last)",
            )
        new = sched._call(
            req, "allocate_slots", sched.kv_manager.allocate_slots, vreq, 0, num_external_computed_tokens=tokens, delay_cache_blocks=True
        )
        if new is None:
            return None
        blocks = sched.kv_manager.get_blocks(rid)
        sched.core.call(f"{self.where}.update_state_after_alloc", self.update_state_after_alloc, vreq, blocks, tokens)
        sched.core.call(f"{self.where}.build_connector_meta", self.build_connector_meta, None)
        self.recving.discard(rid)
        self.inflight.pop(rid, None)
        sched._call(req, "cache_blocks", sched.kv_manager.cache_blocks, vreq, tokens)
        self.nixl.update_connector_output(types.SimpleNamespace(finished_recving={rid}, finished_sending=None))
        return 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._params(request)
        self.hits[request.request_id] = int(num_computed_tokens)
        return self.nixl.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.nixl.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            self.inflight[request.request_id] = int(num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):  # a promoted load, scheduled at last
            if new.req_id in self.inflight and new.req_id not in self.recving:
                self.starts[new.req_id] = int(new.num_computed_tokens)
        meta = self.nixl.build_connector_meta(scheduler_output)
        for rid, req_meta in getattr(meta, "reqs_to_recv", {}).items():
            self._record_pull(rid, req_meta)
            self.recving.add(rid)
        return meta

    def _record_pull(self, rid: str, req_meta) -> None:
        """The local block ids NIXL pulls into, per group, from the request's block index its
        local hit ends at (NIXL's ``local_num_computed_blocks`` where the tree records it, else
        the hit's tokens over the group's block span, as NIXL's worker aligns the tail)."""
        req = self.by_id[rid]
        computed = tuple(getattr(req_meta, "local_num_computed_blocks", ()) or ())
        hit = self.hits.get(rid, 0)
        pulls = {}
        for g, ids in enumerate(req_meta.local_block_ids):
            first = computed[g] if g < len(computed) else hit // self.sched.geometries[g].manager_block_size
            pulls[g] = (int(first), [int(b) for b in ids])
        self.loads.pulls[req.index] = pulls

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(getattr(self.kv_cache_config, "transfer_group_ids", range(len(self.kv_cache_config.kv_cache_groups))))

    def may_load_async(self, request) -> bool:
        return True

    def get_external_cache_hit_sources(self, request, hits):
        return None

    def update_connector_output(self, connector_output) -> None:
        self.nixl.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids):
        with self.sched.vllm_engine.tree.importable():  # it imports vLLM's RequestStatus when called
            return self.nixl.request_finished(request, block_ids)

    def reset_cache(self):
        return None

    def shutdown(self) -> None:
        self.nixl.shutdown()
