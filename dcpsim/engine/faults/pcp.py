"""Prefill-context-parallel faults (PCP x TP x DCP, ``dcpsim.model.parallel``): the prefill split,
its KV gather, the rows after it, its attention metadata and the DCP ranks of the grid (bug classes
24-27, 30, 31 and 49)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dcpsim.engine.faults.base import Fault, has_sharded_attention
from dcpsim.model.arith import cdiv
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import PAD, local_seq_lens


def _pcp_dcp(scenario) -> tuple[int, int]:
    c = scenario.config
    return c.prefill_context_parallel_size, c.decode_context_parallel_size


class PcpGatherRankLocal(Fault):
    name = "pcp-gather-rank-local"
    bug_class = (
        "24. a PCP KV-gather plan built from rank-local metadata: one rank skips the collective "
        "on a 2-token prefill and the group hangs (vllm#53573)"
    )
    description = (
        "before vllm#56157: a prefill too short for 2 * pcp chunks is still split, and each PCP rank "
        "enters the KV all-gather only if one of its own chunks has earlier context; on a fresh 2-token "
        "prefill rank 0 holds token 0 alone, skips the gather, and the others wait for it until the "
        "process-group timeout (exit 3, naming rank 0)"
    )
    expects = "hang"
    scenarios = ("glm-pcp2-dcp2",)
    """Its own config (TP1 PCP2 DCP2, as vllm#53573): no other built-in has PCP."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """A fresh prompt so short that PCP rank 0's mirror chunk is empty."""
        pcp, _ = _pcp_dcp(scenario)
        size = lambda q: cdiv(q, 2 * pcp)
        return pcp > 1 and any(not r.shared_prefix_len and (2 * pcp - 1) * size(r.prompt_len) >= r.prompt_len for r in scenario.requests)

    def pcp_replicated(self, query_len, prefill, pcp, dcp):
        return pcp == 1 or not prefill

    def pcp_enters_gather(self, split_rows, pcp, pcp_rank):
        return any(start + offset > 0 for start, q in split_rows for offset, _ in self.pcp_chunks(q, pcp, pcp_rank))


class PcpChunksNotMirrored(Fault):
    name = "pcp-chunks-not-mirrored"
    bug_class = (
        "25. PCP chunk assignment not mirrored: rank r computes chunks r and r + pcp while the gather restores chunks r and 2 * pcp - 1 - r"
    )
    description = (
        "PCP rank r computes the KV of chunks r and r + pcp of a split prefill, but the all-gathered rows are "
        "put back where the mirrored plan (r, 2 * pcp - 1 - r) says: chunk 2's KV lands on chunk 3's positions"
    )
    scenarios = ("glm-pcp2-dcp2",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where PCP is on (the scenario's own config: selftest adds no PCP config, whose
        baselines would rerun every built-in) and a prefill is long enough to split."""
        pcp, _ = _pcp_dcp(scenario)
        return pcp > 1 and any(r.prompt_len - r.shared_prefix_len > 4 * pcp for r in scenario.requests)

    def pcp_chunks(self, query_len, pcp, pcp_rank):
        size = cdiv(query_len, 2 * pcp)
        pieces = [(c * size, min(size, query_len - c * size)) for c in (pcp_rank, pcp_rank + pcp)]
        return [(o, n) for o, n in pieces if n > 0]


class DcpRankNotTransposed(Fault):
    name = "dcp-rank-not-transposed"
    bug_class = (
        "26. DCP ranks cut from the (PCP, TP) grid without the transpose: dcp_rank = rank % dcp "
        "instead of tp_rank * pcp + pcp_rank (vllm/distributed/parallel_state.py)"
    )
    description = (
        "each rank takes its DCP rank from the untransposed grid, rank % dcp: with TP > 1 two ranks of one "
        "DCP group write as the same DCP rank and the positions of another are stored by nobody"
    )
    scenarios = ("glm-pcp2-dcp2",)
    configs = ({"tensor_parallel_size": 2, "decode_context_parallel_size": 4},)
    """TP2 x PCP2 with DCP over the grid; an invalid size without PCP (tp % dcp), so only PCP
    scenarios run it and its baselines."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        c = scenario.config
        return (
            c.prefill_context_parallel_size > 1
            and c.tp_size > 1
            and c.decode_context_parallel_size > 1
            and has_sharded_attention(geometries)
        )

    def dcp_rank_of(self, layout, rank):
        return rank % layout.dcp


class PcpSpecRegularMask(Fault):
    name = "pcp-spec-regular-mask"
    bug_class = (
        "27. PCP/DCP with speculative decoding: a speculative step's per-token bounds taken from one "
        "regular causal mask instead of the irregular one (vllm-ascend#6491)"
    )
    description = (
        "the PCP/DCP metadata gives the 1 + k query tokens of a speculative step the bounds of one regular "
        "(bottom-right) causal mask over the rank's shard, local(L) - (q - 1 - j), instead of each token's "
        "own local(H + j + 1) (the fix flattens the step into 1 + k single-token rows); sharded groups only"
    )
    configs = ({"tensor_parallel_size": 1, "num_speculative_tokens": 2},)
    """TP1 as the PCP built-in has it (invalid for a non-PCP scenario at W > 1), plus drafts."""
    scenarios = ("glm-pcp2-dcp2",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        c = scenario.config
        return (
            c.prefill_context_parallel_size > 1
            and c.num_speculative_tokens > 0
            and c.decode_context_parallel_size > 1
            and has_sharded_attention(geometries)
        )

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        if not geometry.sharded or geometry.storage is not Storage.PAGED:
            return meta
        bounds, starts = meta.query_local_bounds.copy(), meta.query_start_loc
        for i, w in enumerate(writes):
            if not w.num_drafts:
                continue
            q = w.stop - w.start
            last = local_seq_lens(
                np.array([w.stop], np.int64), dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size, dcp_rank=dcp_rank
            )[0]
            bounds[starts[i] : starts[i + 1]] = np.maximum(0, last - (q - 1 - np.arange(q, dtype=np.int64)))
        return dataclasses.replace(meta, query_local_bounds=bounds)


def _splits_a_prefill(scenario) -> bool:
    """PCP is on (the scenario's own config) and a prefill is long enough to split."""
    pcp, _ = _pcp_dcp(scenario)
    return pcp > 1 and any(r.prompt_len - r.shared_prefix_len > 4 * pcp for r in scenario.requests)


class PcpSlotsCutToLocalTokens(Fault):
    name = "pcp-slots-cut-to-local-tokens"
    bug_class = "30. PCP + DCP: a split row's slot mapping cut to the rank's local token count after the PCP gather (vllm-ascend#16775)"
    description = (
        "after the PCP all-gather a split prefill row holds all q tokens again, but its slot mapping is cut "
        "to the count of tokens one PCP rank computed (its two chunks, 2 * cdiv(q, 2 * pcp)): the KV of the "
        "tokens past the cut never reaches its slots (dcpsim: the restore leaves them without KV)"
    )
    scenarios = ("glm-pcp2-dcp2",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return _splits_a_prefill(scenario)

    def pcp_restore_offsets(self, query_len, pcp):
        offsets = super().pcp_restore_offsets(query_len, pcp)
        local = min(query_len, 2 * cdiv(query_len, 2 * pcp))
        return np.where(offsets < local, offsets, -1)


class PcpUniformDecodeSlots(Fault):
    name = "pcp-uniform-decode-slots"
    bug_class = "31. PCP + MTP: the decode rows' slot mapping laid out as if every request ran the same 1 + k tokens (vllm-ascend#8547)"
    description = (
        "the slot mapping of a step's speculative decode rows is read at offsets i * (1 + k), as if every "
        "request ran 1 + k tokens: once a request runs fewer drafts (its output nearly done), every later "
        "decode row takes the slots of the row before it"
    )
    configs = ({"tensor_parallel_size": 1, "num_speculative_tokens": 2},)
    scenarios = ("glm-pcp2-dcp2",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        c = scenario.config
        return c.prefill_context_parallel_size > 1 and c.num_speculative_tokens > 0 and has_sharded_attention(geometries)

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        mapped = super().step_write_slots(geometry, writes, block_rows, dcp_rank)
        q = 1 + geometry.num_speculative_tokens
        decodes = [i for i, w in enumerate(writes) if not w.prefill]
        if geometry.storage is not Storage.PAGED or q == 1 or len(decodes) < 2:
            return mapped
        buffer = np.concatenate([np.asarray(mapped[i][0], np.int64) for i in decodes])
        for k, i in enumerate(decodes):
            n = len(mapped[i][1])
            slots = np.full(n, PAD, np.int64)
            taken = buffer[k * q : k * q + n]
            slots[: len(taken)] = taken
            mapped[i] = (slots, mapped[i][1])
        return mapped


class PcpTailKeysFromHeadChunk(Fault):
    name = "pcp-tail-keys-from-head-chunk"
    bug_class = (
        "49. the PCP prefill's unmasked keys of a rank's tail chunk cut at its head chunk: the tail query "
        "chunk 2P-1-r reads the row's keys before chunk r, not before chunk 2P-1-r (generate_pcp_metadata's "
        "kv_with_q_tail_nomask_idx)"
    )
    description = (
        "each PCP rank's attention metadata gives its tail chunk's queries the unmasked keys before its head "
        "chunk: on PCP rank 0 of 2 the tail chunk 3 reads no key of chunks 0-2 (a query at the start of "
        "chunk 3 attends itself alone); the KV is written right, only the attention reads too little"
    )
    scenarios = ("glm-pcp2-dcp2",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where PCP is on and a prefill is long enough to split."""
        pcp, _ = _pcp_dcp(scenario)
        return pcp > 1 and any(r.prompt_len - r.shared_prefix_len > 4 * pcp for r in scenario.requests)

    def pcp_query_keys(self, query_len, pcp, pcp_rank):
        queries, spans = super().pcp_query_keys(query_len, pcp, pcp_rank)
        head = self.pcp_chunks(query_len, pcp, pcp_rank)
        if len(head) == 2:  # the tail chunk's rows come after the head chunk's
            first = head[0][1]
            spans = spans.copy()
            spans[first:, 1] = head[0][0]
        return queries, spans
