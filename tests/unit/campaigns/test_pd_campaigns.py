"""The P/D matrix's pair syntax and the P/D fault catalogue (no worlds)."""

from __future__ import annotations

import pytest

from dcpsim.campaigns.pd_matrix import pair_scenario, parse_pairs
from dcpsim.campaigns.pd_selftest import _scenario, pd_fault_names
from dcpsim.engine.faults import PD_FAULTS, get_pd_fault
from dcpsim.errors import ConfigError
from dcpsim.scenarios.load import load_scenario


def test_pairs_parse_and_bad_ones_name_the_flag():
    assert parse_pairs("1:2, 2:4,4:2") == [(1, 2), (2, 4), (4, 2)]
    for bad in ("1-2", "0:2", "a:b"):
        with pytest.raises(ConfigError, match="--pd"):
            parse_pairs(bad)


def test_a_pair_the_connector_cannot_take_is_refused():
    s = load_scenario("pd-dsv3")
    assert pair_scenario(s, 4, 2).disaggregated.decode.decode_context_parallel_size == 2
    with pytest.raises(ConfigError, match="divide one another"):
        pair_scenario(s, 2, 3)


def test_the_pcp_selftest_case_misroutes_only_with_the_stride_by_dcp_matching():
    """The run selftest makes of nixl-stride-by-dcp: prefill PCP = W = 2 at TP 1, whose two
    shards the fault reads with a stride of 1; the correct connector delivers every position."""
    from dcpsim.engine.connector import CONNECTORS
    from dcpsim.model.connector import routes_cover
    from dcpsim.scenarios.pd import instance_layout

    s = _scenario("nixl-pcp")
    assert s.disaggregated.prefill.prefill_context_parallel_size == 2 and s.disaggregated.world_size == 6
    src, dst = instance_layout(s, "prefill"), instance_layout(s, "decode")
    assert (src.cp_size, src.decode_context_parallel_size) == (2, 1)
    bad = get_pd_fault("nixl-stride-by-dcp").connector("nixl")
    for r in s.requests:
        assert routes_cover(CONNECTORS["nixl"]().routes(r.prompt_len, src, dst), r.prompt_len, src, dst)
        # a prompt of more than two blocks (64 tokens each) reads some block from the wrong local block
        assert routes_cover(bad.routes(r.prompt_len, src, dst), r.prompt_len, src, dst) == (r.prompt_len <= 128)
    assert get_pd_fault("nixl-stride-by-dcp").needs_pcp and "nixl-stride-by-dcp" in pd_fault_names()


def test_every_pd_fault_names_a_public_report_or_its_bug():
    assert set(PD_FAULTS) == {
        "none",
        "nixl-stride-by-dcp",
        "nixl-interleave-not-block-size",
        "reshard-ignores-interleave",
        "nixl-one-source-rank",
        "nixl-pulls-outside-intersection",
        "prefill-frees-per-pull",
        "nixl-skips-empty-rank-notice",
        "nixl-page-tail-not-cleared",
    }
    assert "vllm#54875" in get_pd_fault("nixl-page-tail-not-cleared").bug_class
    assert get_pd_fault("nixl-page-tail-not-cleared").scenario == "pd-async-recycled"
    assert "vllm#53205" in get_pd_fault("nixl-pulls-outside-intersection").bug_class
    assert "vllm#57389" in get_pd_fault("nixl-one-source-rank").bug_class
    assert "vllm#38433" in get_pd_fault("nixl-stride-by-dcp").bug_class
    assert "pegaflow#428" in get_pd_fault("nixl-stride-by-dcp").bug_class
    assert "vllm#54457" in get_pd_fault("nixl-interleave-not-block-size").bug_class
    with pytest.raises(ConfigError, match="not a P/D fault"):
        get_pd_fault("interleave-off-by-one")


def test_a_pd_fault_runs_on_the_builtin_it_names():
    from dcpsim.campaigns.pd_selftest import PD_BASELINES
    from dcpsim.campaigns.selftest_run import split_faults
    from dcpsim.cli.selftest import _pd_entries

    entry = _pd_entries(["nixl-page-tail-not-cleared"])[0]
    assert entry["runs"] == [{"scenario": "pd-async-recycled", "config": "nixl P/D run"}]
    assert _pd_entries(["nixl-one-source-rank"])[0]["scenarios"] == ["pd-dsv3"]
    assert split_faults(None, ["pd-async-recycled"])[1] == ["nixl-page-tail-not-cleared"]
    assert "nixl-page-tail-not-cleared" not in split_faults(None, ["pd-dsv3"])[1]
    assert PD_BASELINES == 4 and _scenario("nixl", "pd-async-recycled").disaggregated.load_steps == 2


def test_the_selftest_counts_every_pd_run():
    from dcpsim.campaigns.selftest_plan import Plan
    from dcpsim.campaigns.selftest_run import runs_of

    assert runs_of(Plan(cases=[]), ["nixl-page-tail-not-cleared", "nixl-one-source-rank"]) == 2 + 4  # the faults, then the baselines
    assert runs_of(Plan(cases=[]), []) == 0
