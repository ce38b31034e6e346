"""Disaggregated prefill/decode faults: a connector or an instance engine changed in one decision.

Each ``PDFault`` gives the connector the run uses (``connector``, None: the correct one)
and each instance's engine (``engine``, None: the reference engine). ``--inject NAME`` on
a scenario with a ``[disaggregated]`` table runs one; ``selftest`` runs them all on the P/D
built-in (``dcpsim.campaigns.pd_selftest``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dcpsim.engine.async_load import LoadClear
from dcpsim.engine.connector import NixlConnector, PrefillRelease, ReshardingConnector
from dcpsim.engine.faults.base import Fault
from dcpsim.model.arith import cdiv
from dcpsim.model.connector import Route, block_matches, rank_global_blocks, token_routes


class PDFault:
    name = "none"
    bug_class = ""
    description = "no fault: the correct connector and engines"
    needs_pcp = False
    """The bug shows only with PCP > 1: selftest runs it with the prefill instance at PCP = 2
    (``pd_selftest.PCP_PREFILL``)."""
    kv_connector = "nixl"
    """The connector the fault lives in (selftest runs it on a scenario using it)."""
    scenario = ""
    """The P/D built-in selftest runs the fault on ('': ``pd_selftest.PD_SCENARIO``)."""

    def connector(self, kind: str):
        return None

    def engine(self, role: str):
        return None

    def release(self):
        """When a prefill rank frees a prompt's block during the transfer (None: the correct
        ``PrefillRelease``, after the last pull the plan expects)."""
        return None

    def load_clear(self):
        """What a decode rank clears when an asynchronous load completes (None: the correct
        ``engine.async_load.LoadClear``, every slot of the request's pages the load did not write)."""
        return None


class _StrideByDcp(NixlConnector):
    def routes(self, num_tokens, src, dst):
        return block_matches(num_tokens, src, dst, src_stride=src.decode_context_parallel_size)


class NixlStrideByDcp(PDFault):
    name = "nixl-stride-by-dcp"
    bug_class = "P/D 1. NIXL block matching strides by dcp instead of pcp * dcp (vllm#38433, novitalabs/pegaflow#428)"
    description = (
        "the prefill rank's blocks are taken as rank, rank + dcp, ... instead of rank, rank + pcp * dcp, ...: "
        "with pcp = dcp = 2 a rank's blocks 0, 2, 4 are loaded where it holds 0, 4, 8; on a vLLM 0.33.0 "
        "PCP prefill (W == pcp at TP 1: pcp shards of one DCP rank each) the stride is 1 where it is pcp"
    )
    needs_pcp = True

    def connector(self, kind):
        return _StrideByDcp()


class _OneSourceRank(NixlConnector):
    def routes(self, num_tokens, src, dst):
        one = dataclasses.replace(src, prefill_context_parallel_size=1, decode_context_parallel_size=1)
        return block_matches(num_tokens, one, dst)


class NixlOneSourceRank(PDFault):
    name = "nixl-one-source-rank"
    bug_class = "P/D 4. a NIXL transfer that assumes one source DCP rank (vllm#57389)"
    description = (
        "the transfer plan of the MLA cache regions is built as if the prefill instance had one DCP rank: "
        "every global block g is read from prefill rank 0 at its local block g, while rank g % N holds it "
        "at local block g // N"
    )

    def connector(self, kind):
        return _OneSourceRank()


class _ParallelDefaultInterleave(Fault):
    """The reference engine with ``cp_kv_cache_interleave_size`` left at vLLM's
    ``ParallelConfig`` default (1), not the NIXL-resolved block size."""

    name = "nixl-interleave-not-block-size"

    def group_geometry(self, group_id, group, config):
        return super().group_geometry(group_id, group, dataclasses.replace(config, cp_kv_cache_interleave_size=1))


class NixlInterleaveNotBlockSize(PDFault):
    name = "nixl-interleave-not-block-size"
    bug_class = (
        "P/D 2. under NIXL the interleave is not the smallest group block size "
        "(vllm#54457: forcing it elsewhere breaks block-level matching)"
    )
    description = (
        "both instances shard with cp_kv_cache_interleave_size = 1 (ParallelConfig's default) while the "
        "NIXL connector matches whole blocks, as if I = B"
    )

    def engine(self, role):
        return _ParallelDefaultInterleave()


class _IgnoresDecodeInterleave(ReshardingConnector):
    def routes(self, num_tokens, src, dst):
        believed = dataclasses.replace(dst, cp_kv_cache_interleave_size=src.cp_kv_cache_interleave_size)
        return token_routes(num_tokens, src, dst, dst_as=believed)


class ReshardIgnoresInterleave(PDFault):
    name = "reshard-ignores-interleave"
    bug_class = "P/D 3. a transfer that places entries with the prefill instance's interleave on the decode instance"
    description = "the re-sharding connector computes decode owners and local indices with the prefill's I"
    kv_connector = "resharding"

    def connector(self, kind):
        return _IgnoresDecodeInterleave()


class _PullsWholeSource(NixlConnector):
    def routes(self, num_tokens, src, dst):
        B = dst.block_size
        num_blocks = cdiv(num_tokens, B)
        routes = []
        for d in range(dst.cp_size):
            p = d % src.cp_size  # the one prefill rank decode rank d reads when N_src divides N_dst
            theirs = rank_global_blocks(src, p, num_blocks)
            # the source's blocks in its own order, paired with d's local blocks (the shorter list wins),
            # not only those global blocks d owns
            for j, g in enumerate(theirs[: len(rank_global_blocks(dst, d, num_blocks))].tolist()):
                offsets = np.arange(min(B, num_tokens - g * B), dtype=np.int64)
                routes.append(Route(p, d, j * B + offsets, j * B + offsets))
        return routes


class NixlPullsOutsideIntersection(PDFault):
    name = "nixl-pulls-outside-intersection"
    bug_class = (
        "P/D 5. a decode rank pulls blocks outside the ownership intersection: the source rank's blocks in its "
        "order, not only the global blocks both sides own (vllm#53205, ROCm/ATOM#1994)"
    )
    description = (
        "with fewer prefill ranks than decode ranks (pd-dsv3: 2 -> 4), decode rank d reads its prefill rank "
        "p = d % N_src and pairs p's local blocks 0, 1, ... (global p, p + N_src, ...) with its own local blocks, "
        "where its local block j must hold global block d + j * N_dst: from its second block on it holds "
        "positions another decode rank owns"
    )

    def connector(self, kind):
        return _PullsWholeSource()


class _FreesAtFirstPull(PrefillRelease):
    def frees(self, pulls, expected):
        return pulls == min(1, expected)


class PrefillFreesPerPull(PDFault):
    name = "prefill-frees-per-pull"
    bug_class = (
        "P/D 6. a prefill rank frees a prompt's block at a decode rank's pull instead of after the last pull "
        "the transfer expects (vllm-ascend#5224)"
    )
    description = (
        "each prefill block must be freed exactly once, after its last expected pull (a block nobody pulls when "
        "the transfer ends); this one is freed at its first pull, so a second decode rank that pulls it reads a "
        "freed block: through the re-sharding connector (prefill I = 1, decode I = 16) every prefill block holds "
        "positions of several decode ranks"
    )
    kv_connector = "resharding"

    def release(self):
        return _FreesAtFirstPull()


class _NotifiesReceiversOnly(NixlConnector):
    def notices(self, routes, dst):
        return {d: notice for d, notice in super().notices(routes, dst).items() if notice[0] > 0}


class NixlSkipsEmptyRankNotice(PDFault):
    name = "nixl-skips-empty-rank-notice"
    bug_class = "P/D 7. a decode rank that owns none of a prompt is never notified of its transfer's completion (sglang#32837)"
    description = (
        "the connector notifies only the decode ranks that received entries of a prompt: on pd-dsv3 (decode W = 4, "
        "B = 64) the 90-token prompt 'short' fills two blocks, so decode ranks 2 and 3 own none of it and wait for a "
        "completion that never comes"
    )

    def connector(self, kind):
        return _NotifiesReceiversOnly()


class _KeepsPageTails(LoadClear):
    def cleared(self, pages, page, written):
        every = super().cleared(pages, page, written)
        filled = np.unique(np.asarray(written, np.int64) // page)
        return every[~np.isin(every // page, filled)]  # only the pages the load left empty


class NixlPageTailNotCleared(PDFault):
    name = "nixl-page-tail-not-cleared"
    bug_class = (
        "P/D 8. the tail of a partly filled destination page is not cleared around an asynchronous load into a recycled block (vllm#54875)"
    )
    description = (
        "blocks an asynchronous load fills skip the clearing of new blocks (it would race the transfer), so when the "
        "load completes the decode rank must clear every slot of them it did not write; this one clears only the pages "
        "the load left empty, and the tail of a partly filled page keeps what the block's earlier request wrote: on "
        "pd-async-recycled the late requests' last pages are recycled from finished ones"
    )
    scenario = "pd-async-recycled"

    def load_clear(self):
        return _KeepsPageTails()
