"""P/D runs with a PCP prefill instance on real gloo worlds: every (prefill PCP, TP, W;
decode W) the NIXL connector takes with at most 8 processes passes in one world, some
re-sharding ones beside (several DCP groups, DCP over the whole grid), and the
stride-by-dcp fault fails on the decode instance as wrong content."""

from __future__ import annotations

import pytest
from test_disagg_run import TINY, tiny

from dcpsim.campaigns.pd_selftest import run_case
from dcpsim.harness.pd import run_pd_batch
from dcpsim.harness.pd_job import PDJob
from dcpsim.harness.world_options import WorldOptions
from support.helpers import nixl_takes_pcp_prefill, pd_pcp_sizes

pytestmark = [pytest.mark.dist, pytest.mark.slow]

NIXL_PCP = pd_pcp_sizes(8)
RESHARD_PCP = [((2, 2, 4), 2), ((2, 2, 2), 3), ((2, 1, 1), 4), ((3, 2, 3), 2), ((2, 3, 6), 2), ((2, 2, 1), 2)]
"""Prefills NIXL refuses: DCP over the whole grid, several DCP groups, replicated PCP to a
sharded decode instance."""


def prefill(pcp, tp, w, **more):
    return dict({"prefill_context_parallel_size": pcp, "tensor_parallel_size": tp, "decode_context_parallel_size": w}, **more)


def check(report, sizes):
    (pcp, tp, w), d = sizes
    assert report.passed, (sizes, report.prefill.failure, report.decode.failure)
    assert len(report.prefill.ranks) == pcp * tp and len(report.decode.ranks) == d
    assert report.prefill.prefill_context_parallel_size == pcp
    prompts = sum(r["prompt_len"] for r in TINY["requests"])
    assert report.entries_sent == prompts and report.entries_written == prompts  # from the serving DCP group only
    assert report.layouts["prefill"]["kv_shards"] == w and report.decode.schedule["finished"] == 3


def test_every_nixl_pcp_prefill_passes():
    jobs = [PDJob(tiny(prefill(*p), {"decode_context_parallel_size": d}, "nixl")) for p, d in NIXL_PCP]
    for sizes, report in zip(NIXL_PCP, run_pd_batch(jobs, world=WorldOptions(timeout=60))):
        check(report, sizes)


def test_pcp_prefills_nixl_refuses_pass_resharding():
    assert not any(nixl_takes_pcp_prefill(*p, d) for p, d in RESHARD_PCP)
    jobs = [
        PDJob(
            tiny(
                prefill(*p, cp_kv_cache_interleave_size=1),
                {"decode_context_parallel_size": d, "cp_kv_cache_interleave_size": 4, "block_size": 32},
                "resharding",
            )
        )
        for p, d in RESHARD_PCP
    ]
    for sizes, report in zip(RESHARD_PCP, run_pd_batch(jobs, world=WorldOptions(timeout=60))):
        check(report, sizes)


def test_the_stride_by_dcp_fault_is_wrong_content_on_the_decode_instance():
    row = run_case("nixl-stride-by-dcp", "nixl-pcp", world=WorldOptions(timeout=60))
    assert row.outcome == "detected" and row.kind == "wrong-content", row
    assert row.report.startswith("decode instance: FAIL at step 0: ")
    assert "P: W=2 I=64 PCP=2" in row.config
