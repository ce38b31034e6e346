"""Sparse-attention faults (DSA, semantics section 14): how the ranks pick each query token's
top-k keys and find them in their shards (bug classes 33, 34 and 43)."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.reference import topk_by_score_then_position
from dcpsim.model.sparse import is_indexer, sparse_topk


def has_sparse_attention(geometries, *, sharded_indexer: bool = False) -> bool:
    """A sparse group over more than one rank (with a sharded indexer when asked)."""
    sparse = any(sparse_topk(g.group_spec) and g.dcp_size > 1 for g in geometries)
    return sparse and (not sharded_indexer or any(is_indexer(g.group_spec) and g.sharded for g in geometries))


class TopkTieOrder(Fault):
    name = "topk-tie-order"
    bug_class = "33. ranks breaking top-k ties in different orders (vllm#46145, ROCm/ATOM#1832)"
    description = (
        "each rank's top-k fills the keys tied at the k-th score in its own order (a radix select "
        "filling ties from either end: positions ascending on even ranks, descending on odd ones), so "
        "the ranks attend over different key sets and none is the total order's"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2},)
    scenarios = ("dsv32-sparse",)

    def applies_to(self, geometries) -> bool:
        return has_sparse_attention(geometries)

    def select_topk(self, scores, topk, local_counts, dcp_rank):
        n = np.asarray(scores).shape[1]
        ties = np.arange(n, dtype=np.int64)
        return topk_by_score_then_position(scores, topk, tie_key=ties if dcp_rank % 2 == 0 else -ties)


class SparseRowMaskedByEmptyShard(Fault):
    name = "sparse-row-masked-by-empty-shard"
    bug_class = "34. a merged global top-k row masked by this rank's row_has_no_kv (local-inference-lab/vllm#33)"
    description = (
        "after the ranks' candidates are merged into the global top-k, a rank masks the whole row "
        "(-1) for query tokens where its own shard of the indexer holds no key (row_has_no_kv), "
        "erasing candidates that other ranks own: the ranks' selections diverge"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2}, {"decode_context_parallel_size": 4, "cp_kv_cache_interleave_size": 16})
    scenarios = ("dsv32-sparse",)

    def applies_to(self, geometries) -> bool:
        return has_sparse_attention(geometries, sharded_indexer=True)

    def select_topk(self, scores, topk, local_counts, dcp_rank):
        chosen = super().select_topk(scores, topk, local_counts, dcp_rank)
        return np.where((np.asarray(local_counts) == 0)[:, None], -1, chosen)


class TopkLocalInterleaveOne(Fault):
    name = "topk-local-interleave-one"
    bug_class = (
        "43. sparse attention's global top-k ids localized with the I = 1 formula: owner g % W at local offset "
        "g // W instead of (g // I) % W at round_down(g // W, I) + g % I (ROCm/ATOM#2008)"
    )
    description = (
        "each rank keeps the selected positions g with g % W == r and reads them at local index g // W, the token "
        "interleave's rule: with I > 1 a rank attends over keys it does not hold (other positions' rows, or rows "
        "past its shard) and drops selected keys it holds, so the merged output is not attention over the selection"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 16},)
    scenarios = ("dsv32-sparse",)

    def applies_to(self, geometries) -> bool:
        return has_sparse_attention(geometries)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where some sparse group is sharded with I > 1 (at I = 1 the two rules agree)."""
        return self.applies_to(geometries) and any(
            sparse_topk(g.group_spec) and g.sharded and g.dcp_size > 1 and g.interleave_size > 1 for g in geometries
        )

    def sparse_local_keys(self, geometry, selected, dcp_rank):
        t = np.asarray(selected, dtype=np.int64)
        if not geometry.sharded:
            return t
        W = geometry.dcp_size
        return np.where((t >= 0) & (t % W == dcp_rank), t // W, -1)
