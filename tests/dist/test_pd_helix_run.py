"""P/D into Helix decode ranks (``kv_cache_layout = "helix"``, built-in ``pd-helix``) on real gloo
worlds: the reference passes at several (prefill W, decode W) pairs through the re-sharding
connector and through NIXL's block matching; a connector that routes by vLLM's owner instead of
Helix's fails the decode instance's checker, which derives Helix's placement itself."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.harness.pd import run_pd, run_pd_batch
from dcpsim.harness.pd_job import PDJob
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.pd import Instance
from support.pd_helix_bug import VllmOwnerJob

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PAIRS = [(2, 4), (1, 3), (3, 2)]


def pd_helix(prefill_w: int, decode_w: int, connector: str = "resharding", prefill_pcp: int = 1):
    s = load_scenario("pd-helix")
    pd = dataclasses.replace(
        s.disaggregated,
        prefill=Instance(decode_context_parallel_size=prefill_w, prefill_context_parallel_size=prefill_pcp),
        decode=Instance(decode_context_parallel_size=decode_w),
        kv_connector=connector,
    )
    return dataclasses.replace(s, disaggregated=pd)


def check_passed(report, scenario, P, D):
    assert report.passed, (report.prefill.failure, report.decode.failure, report.notices)
    assert len(report.prefill.ranks) == P and len(report.decode.ranks) == D
    prompts = sum(r.prompt_len for r in scenario.requests)
    assert report.entries_sent == report.entries_written == prompts  # one group: every prompt position once
    assert report.decode.schedule["finished"] == len(scenario.requests)
    assert report.decode.verified_indices > prompts


def test_the_reference_passes_pd_helix_at_several_pairs():
    scenarios = [pd_helix(P, D) for P, D in PAIRS]
    reports = run_pd_batch([PDJob(s) for s in scenarios], world=WorldOptions(timeout=60))
    for (P, D), s, report in zip(PAIRS, scenarios, reports):
        check_passed(report, s, P, D)
        assert report.layouts["decode"]["cp_kv_cache_interleave_size"] == 8  # Helix deals whole blocks of B = 8


def test_a_pcp_prefill_instance_feeds_helix_decode_ranks():
    """Prefill PCP 2 (TP 1, DCP spanning it: two KV shards) -> Helix decode W = 4."""
    s = pd_helix(2, 4, prefill_pcp=2)
    report = run_pd(PDJob(s), world=WorldOptions(timeout=60))
    check_passed(report, s, 2, 4)
    assert report.layouts["prefill"]["prefill_context_parallel_size"] == 2


def test_nixl_block_matching_delivers_helix_prompt_blocks_whole():
    s = pd_helix(2, 4, "nixl")
    check_passed(run_pd(PDJob(s), world=WorldOptions(timeout=60)), s, 2, 4)


def test_a_connector_routing_to_vllms_owner_fails_the_decode_checker():
    s = load_scenario("pd-helix")
    report = run_pd(VllmOwnerJob(s), world=WorldOptions(timeout=60))
    assert not report.passed
    assert report.prefill.passed  # the prefill instance is vLLM's layout and right
    failure = report.decode.failure
    assert failure is not None and failure.kind == "wrong-content", failure
    assert any("request tiny notified of" in line and "it owns 5" in line for line in report.notices), report.notices
