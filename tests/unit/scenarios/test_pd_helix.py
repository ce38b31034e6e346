"""P/D into Helix decode ranks (``pd-helix``, docs section 15): the prefill instance keeps vLLM's
layout, the decode instance takes Helix's; both connectors deliver every prompt position to the
rank and local slot the checker's own Helix derivation (``dcpsim.verify.helix.helix_map``) gives
it, and routing by vLLM's owner of the decode instance does not; a Helix prefill instance
cannot be asked for (exit 2)."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from dcpsim.errors import ScenarioError
from dcpsim.harness.pd import judge_notices
from dcpsim.harness.pd_job import PDJob, prepare_pd
from dcpsim.model.connector import InstanceLayout, block_matches, token_routes
from dcpsim.scenarios.load import load_scenario, scenario_from_dict
from dcpsim.scenarios.pd import instance_layout, instance_scenario
from dcpsim.scenarios.registry import builtin_scenario_path
from dcpsim.verify.helix import helix_map


def delivered(routes) -> dict:
    """(decode rank, decode local) -> (prefill rank, prefill local); a duplicate fails."""
    got = {}
    for r in routes:
        for s, t in zip(r.src_local.tolist(), r.dst_local.tolist()):
            assert (r.dst_rank, t) not in got, f"decode rank {r.dst_rank} local {t} delivered twice"
            got[(r.dst_rank, t)] = (r.src_rank, s)
    return got


def helix_wanted(P: int, src: InstanceLayout, B: int, W: int) -> dict:
    """Where the checker says each prompt position lives on the Helix decode ranks."""
    owner, local = helix_map(P, P, B, W)
    pos = np.arange(P)
    return {(int(o), int(loc)): (int(sr), int(sl)) for o, loc, sr, sl in zip(owner, local, src.owner(pos), src.local_index(pos))}


@pytest.mark.parametrize("P", [1, 5, 8, 12, 31, 33, 77, 100])
@pytest.mark.parametrize("pw,pi,W", [(2, 1, 4), (1, 1, 3), (3, 2, 2), (4, 8, 4), (2, 8, 1)])
def test_resharding_routes_every_prompt_position_to_its_helix_place(P, pw, pi, W):
    B = 8
    src = InstanceLayout(decode_context_parallel_size=pw, cp_kv_cache_interleave_size=pi, block_size=B)
    dst = InstanceLayout(decode_context_parallel_size=W, cp_kv_cache_interleave_size=1, block_size=B, kv_cache_layout="helix")
    assert delivered(token_routes(P, src, dst)) == helix_wanted(P, src, B, W)


@pytest.mark.parametrize("P", [1, 5, 12, 33, 77])
@pytest.mark.parametrize("pw,W", [(2, 4), (4, 2), (2, 2), (1, 4)])
def test_nixl_block_matching_is_helix_prompt_round_robin(P, pw, W):
    """NIXL needs I = B on both sides; Helix's prompt layout is vLLM's with I = B, so whole
    blocks land where Helix puts them (the last partial block stays partial)."""
    B = 8
    src = InstanceLayout(decode_context_parallel_size=pw, cp_kv_cache_interleave_size=B if pw > 1 else 1, block_size=B)
    dst = InstanceLayout(decode_context_parallel_size=W, block_size=B, kv_cache_layout="helix")
    assert delivered(block_matches(P, src, dst)) == helix_wanted(P, src, B, W)


def test_vllms_owner_of_the_decode_instance_is_not_helixs():
    """What the planted bug of tests/dist/test_pd_helix_run.py routes by: it misses the checker's places."""
    src = InstanceLayout(decode_context_parallel_size=2, cp_kv_cache_interleave_size=1, block_size=8)
    vllm = InstanceLayout(decode_context_parallel_size=4, cp_kv_cache_interleave_size=1, block_size=8)
    assert delivered(token_routes(77, src, vllm)) != helix_wanted(77, src, 8, 4)


def test_the_builtin_runs_helix_on_the_decode_instance_only():
    s = load_scenario("pd-helix")
    assert s.config.kv_cache_layout == "helix" and s.disaggregated.kv_connector == "resharding"
    prefill, decode = instance_scenario(s, "prefill"), instance_scenario(s, "decode")
    assert prefill.config.kv_cache_layout == "vllm" and prefill.config.cp_kv_cache_interleave_size == 1
    assert decode.config.kv_cache_layout == "helix" and decode.config.decode_context_parallel_size == 4
    assert instance_layout(s, "decode").kv_cache_layout == "helix"
    assert instance_layout(s, "decode").cp_kv_cache_interleave_size == 8
    assert instance_layout(s, "prefill").kv_cache_layout == "vllm"
    prepare_pd(PDJob(s))  # both instances validate and dry-run
    # prompts shorter than one stripe (B * W = 32): decode ranks 2 and 3 own none of "tiny" and "short"
    short = [r.prompt_len for r in s.requests if r.prompt_len < 32]
    assert short and all(r.prompt_len % 32 for r in s.requests)


def test_notices_are_judged_by_helix_ownership():
    s = load_scenario("pd-helix")
    notices = PDJob(s).notices()
    for d in range(4):
        assert judge_notices(s, d, notices[d]) == []
    tiny = [r.request_id for r in s.requests].index("tiny")
    assert [int(notices[d, tiny, 0]) for d in range(4)] == [5, 0, 0, 0]
    wrong = notices.copy()
    wrong[2, tiny] = (1, 1)
    assert judge_notices(s, 2, wrong[2]) and "owns 0" in judge_notices(s, 2, wrong[2])[0]


def test_a_helix_prefill_instance_cannot_be_asked_for():
    data = tomllib.loads(builtin_scenario_path("pd-helix").read_text())
    data["disaggregated"]["prefill"]["kv_cache_layout"] = "helix"
    with pytest.raises(ScenarioError, match=r"disaggregated\.prefill\.kv_cache_layout"):
        scenario_from_dict(data, source="pd-helix.toml")
