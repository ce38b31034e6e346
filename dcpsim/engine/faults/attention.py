"""Attention-merge faults: what a shard reports to the LSE merge and how the merge weighs it
(bug classes 4, 16 and 17), which KV head a gathered query head reads (48), and which query
tokens a rank computes (52)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dcpsim.engine.attention.merge import sanitize_lse, scale_output
from dcpsim.engine.faults.base import Fault, has_sharded_attention
from dcpsim.engine.faults.metadata import graph_steps


class EmptyShardLseZero(Fault):
    name = "empty-shard-lse-zero"
    bug_class = "4. empty shard reporting lse = 0 in the merge"
    description = (
        "a rank whose shard holds no key for a query token reports lse = 0 instead of -inf, so "
        "the merge gives it weight exp(0 - lse) and scales the other ranks' outputs down"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def shard_lse(self, lse, empty):
        return lse.masked_fill(empty[:, None], 0.0)


class LseBaseMismatch(Fault):
    name = "lse-base-mismatch"
    bug_class = "16. LSEs of one base merged as the other (vllm#28840, vllm#43919, sglang#33064)"
    description = (
        "the backend returns base-2 LSEs (flash kernels: exp2/log2) but the DCP merge treats them "
        "as natural logs (and the other way round), so every rank's weight is wrong"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "lse_base": "2"}, {"decode_context_parallel_size": 2, "lse_base": "e"})

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        return super().merge_across_ranks(out, lse, group, variant=variant, base="e" if base == "2" else "2")


class EmptyShardNanUnguarded(Fault):
    name = "empty-shard-nan-unguarded"
    bug_class = "17. an empty shard's NaN output times its zero merge weight (ROCm/ATOM#1832)"
    description = (
        "a kernel leaves 0/0 = NaN in the output rows of query tokens whose shard holds no key, "
        "and the merge multiplies weight by output without the guard: 0 * NaN poisons the result"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "attention_merge": "alltoall"},)
    """The all-to-all merge goes through ``merge_attention_states``, the unguarded one here."""

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def shard_output(self, out, empty):
        return out.masked_fill(empty[:, None, None], float("nan"))

    def merge_attention_states(self, outputs, lses, base):
        lse, factors = self.merge_lse(lses, base)
        return (factors.unsqueeze(-1) * outputs).sum(dim=0), lse


FLASHINFER_MASKED_LSE = -49993.9765625
"""The LSE FlashInfer's paged causal prefill returns for a fully masked row (flashinfer#4452):
its finite mask sentinel, 5e4, not -inf."""


class EmptyShardLseFinite(Fault):
    name = "empty-shard-lse-finite"
    bug_class = "36. a fully masked row's LSE returned finite (about -5e4) instead of -inf (flashinfer#4452)"
    description = (
        "the kernel masks with a finite sentinel, so a query token whose shard on this rank holds no key "
        "reports lse = -49994 instead of -inf: beside a real shard it weighs exp(-5e4 - lse) = 0, but the "
        "merge of rows that are empty on every rank comes out finite, and the section-6 rule is broken"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 16},)
    scenarios = ("dsv3", "llama-gqa", "dsv41-hybrid")
    """Prefills of MLA, GQA and compressed records: every first token's shard on rank 1 is empty."""

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def shard_lse(self, lse, empty):
        return lse.masked_fill(empty[:, None], FLASHINFER_MASKED_LSE)


class AllEmptyRowsMergeNan(Fault):
    name = "all-empty-rows-merge-nan"
    bug_class = "37. rows empty on every rank (the padding of a CUDA-graph decode step) merged to NaN (vllm-ascend#14126)"
    description = (
        "the LSE merge takes m = max_r lse_r without the m = -inf guard and weighs every shard by "
        "exp(lse_r - lse): a row whose shards are all empty gets lse = -inf - (-inf) = NaN and NaN "
        "weights, so the padding rows of a padded decode step come out NaN (true rows are unchanged)"
    )
    needs = {"attention": True, "attention_padded_rows": True, "max_cudagraph_capture_size": 64}
    configs = ({"decode_context_parallel_size": 2},)
    scenarios = ("many-short", "dsv3")

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return has_sharded_attention(geometries) and any(dummies for _, dummies in graph_steps(scenario, geometries))

    def merge_lse(self, lses, base):
        exp, log = (torch.exp, torch.log) if base == "e" else (torch.exp2, torch.log2)
        clean = sanitize_lse(lses)
        m = clean.amax(dim=0)  # no guard: -inf when every shard is empty
        lse = m + log(exp(clean - m).sum(dim=0))
        return lse, exp(clean - lse)

    def merge_attention_states(self, outputs, lses, base):  # the all-to-all merge, over the same weights
        lse, factors = self.merge_lse(lses, base)
        return scale_output(outputs, factors).sum(dim=0), lse


class MergeVariantPerRank(Fault):
    name = "merge-variant-per-rank"
    bug_class = "38. ranks choosing the attention merge variant without agreement (vllm#48248)"
    description = (
        "the all-to-all communicator fails to initialise on some ranks (here the odd ones), which fall back "
        "to the all-gather merge alone while the others run the all-to-all: the group enters collectives of "
        "different shapes"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "attention_merge": "alltoall"},)
    scenarios = ("dsv3",)

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def merge_variant(self, variant, dcp_rank):
        return "allgather" if dcp_rank % 2 else variant


class GatheredHeadsGqaRemapped(Fault):
    name = "gathered-heads-gqa-remapped"
    bug_class = (
        "48. the DCP-gathered query heads remapped onto the rank's KV heads by the GQA ratio of the gathered count, "
        "gathered // local KV heads, instead of through each head's own KV head (vllm#48392, sglang#34161)"
    )
    description = (
        "after the DCP all-gather of queries the kernel sees n = W * H / TP query heads and the rank's kv / TP KV heads "
        "and pairs gathered head i with KV head i // (n / (kv / TP)), as if the gathered heads were one model's: the "
        "gather concatenates each member's TP heads, so head i must read KV head (its global head) // (H / kv) "
        "(gqa-pcp2-heads: 64 gathered heads of 32 over 8 KV heads, DCP over the PCP axis: gathered head 4, query head 4 "
        "of KV head 1, reads KV head 0; 56 of the 64 read another KV head than their own)"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2},)
    """The scenario's own W (a config other faults share: no new baselines)."""
    scenarios = ("gqa-pcp2-heads",)
    """Its own config: the one built-in whose ranks hold several KV heads under DCP (a DCP group
    over the PCP axis, TP 1). Where a DCP group is TP ranks each rank holds one KV head
    (``kv * W <= TP``) and every pairing is the same."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """A stated head layout whose ranks hold several KV heads and gather queries (W > 1)."""
        c = scenario.config
        if c.num_attention_heads is None or c.decode_context_parallel_size == 1 or not has_sharded_attention(geometries):
            return False
        return c.num_key_value_heads // min(c.num_key_value_heads, c.tp_size) > 1

    def attention_heads(self, layout, rank, num_heads, num_kv_heads):
        right = super().attention_heads(layout, rank, num_heads, num_kv_heads)
        ratio = max(1, len(right.query_heads) // len(right.kv_heads))
        return dataclasses.replace(right, kv_index=tuple(i // ratio for i in range(len(right.query_heads))))


class NonOwnerSkipsQueryRows(Fault):
    name = "non-owner-skips-query-rows"
    bug_class = (
        "52. a rank skipping the query tokens whose slot in its slot mapping is negative, as if they were padding, "
        "where the slot only says another rank owns the cache row (vllm#50095, fixed by vllm#50005; vllm#54907, fixed by vllm#54908)"
    )
    description = (
        "the attention kernel returns early for a token whose local cache slot is negative (PAD), before its query is "
        "normalised: under DCP that is every token another rank stores, so a rank contributes nothing (an empty shard) "
        "for the query tokens it does not own and the merge is attention over the owner's keys alone (W = 2, I = 1: "
        "every decode token's partial state on the rank that does not hold its position is missing)"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2},)
    """The config of the other attention faults (``empty-shard-lse-zero``): no new baselines."""
    scenarios = ("dsv3", "dsv32-sparse", "llama-gqa")
    """MLA (vllm#54907's dense prefill), sparse MLA (vllm#50095's DeepSeek-V3.2) and GQA."""

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def attention_query_rows(self, geometry, slots, dcp_rank):
        return np.asarray(slots, dtype=np.int64) >= 0
