"""A P/D decode instance's KV connector as vLLM's v1 ``Scheduler`` calls it (``--vllm-scheduler full``).

vLLM builds its scheduler-side connector with ``KVConnectorFactory`` from the
``kv_transfer_config``. With the ``nixl`` connector dcpsim hands vLLM's ``Scheduler`` vLLM's own
NIXL scheduler side (``dcpsim.engine.vllm.nixl_scheduler``, chosen by ``scheduler_connector``):
it decides the external tokens and the blocks each pull fills, asynchronously as in vLLM. For
the ``resharding`` connector (no vLLM counterpart) it hands this stand-in, ``SchedulerConnector``,
after building it. What the stand-in answers is dcpsim's
connector (``dcpsim.engine.connector.PromptLoads``: a prompt's KV arrives whole on its first
admission, all but the last token); what vLLM does with the answer is vLLM's code:
``schedule()`` adds the loaded tokens to the request's computed tokens, ``allocate_slots``
allocates their blocks (``num_external_computed_tokens``), and the step writes from there.

The load is synchronous (``get_num_new_matched_tokens`` returns ``load_kv_async=False``, vLLM's
path for a connector that loads before the forward pass), so the request is scheduled in the
step that admits it, as dcpsim's own decode scheduler does; NIXL's asynchronous path
(``WAITING_FOR_REMOTE_KVS`` for a step or more) is not modelled. Each method below is one
vLLM calls on a ``KVConnectorBase_V1`` of the scheduler role (``vllm/v1/core/sched/scheduler.py``);
a connector that supports the hybrid allocator (``SupportsHMA``) is told a finished request's
blocks of every group.
"""

from __future__ import annotations

import types

from dcpsim.engine.loading.placeholders import StubModule

CONNECTOR_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1"


class SupportsHMA:
    """vLLM's marker of a connector that supports the hybrid memory allocator
    (``kv_connector/v1/base.py``), stubbed as a real class so that vLLM's ``isinstance``
    check of the connector runs."""


def connector_package_stub(name: str, tree) -> types.ModuleType:
    """The connector package, stubbed (its base classes need vLLM's config and the worker
    side) but for ``SupportsHMA``."""
    module = StubModule(name, tree)
    module.SupportsHMA = SupportsHMA
    return module


def scheduler_connector(sched, loads, kv_cache_config, vllm_config):
    """The connector vLLM's ``Scheduler`` of a P/D decode instance gets: vLLM's NIXL scheduler side
    for the ``nixl`` connector (``loads.kind``) with the prefill's block ids at hand, else the stand-in.
    ``vllm_config``: the scheduler's own (its block size, parallel sizes)."""
    if getattr(loads, "kind", "") == "nixl" and getattr(loads, "remote", None):
        from dcpsim.engine.vllm.nixl_scheduler import NixlSchedulerConnector, nixl_vllm_config

        parallel = vllm_config.parallel_config
        config = nixl_vllm_config(sched.config, vllm_config.cache_config.block_size, parallel.decode_context_parallel_size)
        return NixlSchedulerConnector(sched, loads, kv_cache_config, config)
    return SchedulerConnector(loads, sched._by_id)


def manager_connector(sched, kv_cache_config):
    """``--vllm-scheduler manager``: vLLM's NIXL scheduler side for dcpsim's step loop to call
    (``NixlSchedulerConnector.load``) on a P/D decode instance of the ``nixl`` connector, else None."""
    loads = sched.connector
    if getattr(loads, "kind", "") != "nixl" or not getattr(loads, "remote", None):
        return None
    from dcpsim.engine.vllm import parallel_rules
    from dcpsim.engine.vllm.nixl_scheduler import NixlSchedulerConnector, nixl_vllm_config

    dcp, _ = parallel_rules.release_sizes(sched.vllm_engine.tree, sched.config)
    config = nixl_vllm_config(sched.config, sched._vllm_config(()).cache_config.block_size, dcp)
    return NixlSchedulerConnector(sched, loads, kv_cache_config, config)


class IdleConnectorParts(SupportsHMA):
    """What vLLM's scheduler asks every connector and a decode instance's has nothing of: no
    pending frees or pushes, no stats, no KV events, no partial tails to register."""

    def has_pending_block_frees(self) -> bool:
        return False

    def has_pending_push_work(self) -> bool:
        return False

    def get_kv_connector_stats(self):
        return None

    def take_events(self):
        return ()

    def register_finished_partial_tail(self, request, block_ids, tails) -> bool:
        return False


class SchedulerConnector(IdleConnectorParts):
    """dcpsim's connector (``loads``: ``external_tokens(req)``) in the shape vLLM's scheduler calls."""

    supports_divergent_local_hybrid_hits = False
    requires_kv_delivery = False

    def __init__(self, loads, requests_by_id: dict):
        self.loads = loads
        self.requests_by_id = requests_by_id
        self.loaded: list[tuple[int, int]] = []
        """(request index, tokens) of every load since the last ``take_loaded``."""
        self.kv_cache_manager = None

    def take_loaded(self) -> tuple[tuple[int, int], ...]:
        loaded, self.loaded = tuple(self.loaded), []
        return loaded

    def connector_output(self):
        """The step's ``KVConnectorOutput``: none, the loads are synchronous."""
        return None

    def loading(self) -> bool:
        return False

    # --- what vLLM's Scheduler calls ---------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request) -> None:
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """The tokens past the local hit that the connector loads, and synchronously."""
        req = self.requests_by_id[request.request_id]
        return max(0, self.loads.external_tokens(req) - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens:
            self.loaded.append((self.requests_by_id[request.request_id].index, int(num_external_tokens)))

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, None]:
        """A finished request's blocks are freed at once (a decode instance sends nothing)."""
        return False, None

    def update_connector_output(self, connector_output) -> None:
        pass
