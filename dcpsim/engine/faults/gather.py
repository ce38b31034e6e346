"""Context-gather faults: the chunked gather of a prefill's cached context (bug class 35).

The gather of a prefill over a long cached context runs in workspace-sized chunks
(``dcpsim.model.context_gather``); a fault here changes which rows of its shard a rank
gathers for a chunk."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.model.layout import local_seq_lens


class ContextGatherWholeLocalLen(Fault):
    name = "context-gather-whole-local-len"
    bug_class = "35. each chunk of a context gather given the rank's whole local context length (vllm#28526, #28476, #28411)"
    description = (
        "a prefill over a cached context longer than the gather workspace runs in several chunks; the rank "
        "gathers local(c, r) rows for every chunk instead of min(local(c, r) - local_start, the chunk's rows), "
        "so every chunk but the last reads past its piece (keys gathered twice, then rows past the context)"
    )
    configs = ({"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 4, "chunked_prefill_workspace_size": 64},)
    scenarios = ("dsv3", "prefix-sharing")
    """A 64-row workspace splits their contexts (chunked prefills, prefix hits); the
    256K built-in splits at vLLM's default workspace (a slow test runs it)."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where a prefill of the (reference) schedule gathers a sharded group's context in
        more than one piece (a request split over chunks, or a later chunk's request)."""
        return split_gathers(scenario, geometries) > 0

    def gather_local(self, g, context, start, length, dcp_rank):
        local_start, local_len = super().gather_local(g, context, start, length, dcp_rank)
        if not g.sharded:  # the bug lives in the DCP path (reorg_kvcache)
            return local_start, local_len
        whole = local_seq_lens(np.array([context]), dcp_size=g.dcp_size, interleave_size=g.interleave_size, dcp_rank=dcp_rank)
        return local_start, int(whole[0])


def split_gathers(scenario, geometries) -> int:
    """Gather entries of a sharded group, over the (reference) schedule, that start past the
    context's first token: the pieces of a request split over chunks."""
    engine, count = ReferenceEngine(), 0
    sharded = [g for g in geometries if g.sharded]
    for plan in Scheduler(scenario, engine, geometries).plans():
        for g in sharded:
            rows = [plan.rows_before[g.group_id].get(w.req_index, np.zeros(0, np.int64)) for w in plan.writes]
            gather = engine.context_gather(g, list(plan.writes), rows, 0)
            count += 0 if gather is None else int((gather.starts > 0).sum())
    return count
