"""The P/D matrix's pair syntax and the P/D fault catalogue (no worlds)."""

from __future__ import annotations

import pytest

from dcpsim.campaigns.pd_faults import PD_FAULTS, get_pd_fault
from dcpsim.campaigns.pd_matrix import pair_scenario, parse_pairs
from dcpsim.campaigns.pd_selftest import route_audit
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


def test_the_route_audit_catches_the_stride_by_dcp_matching_and_passes_the_correct_one():
    assert route_audit("none").outcome == "pass"
    row = route_audit("nixl-stride-by-dcp")
    assert row.outcome == "detected" and row.kind == "routes" and "chat-0" in row.report


def test_every_pd_fault_names_a_public_report_or_its_bug():
    assert set(PD_FAULTS) == {"none", "nixl-stride-by-dcp", "nixl-interleave-not-block-size", "reshard-ignores-interleave"}
    assert "vllm#38433" in get_pd_fault("nixl-stride-by-dcp").bug_class
    assert "pegaflow#428" in get_pd_fault("nixl-stride-by-dcp").bug_class
    assert "vllm#54457" in get_pd_fault("nixl-interleave-not-block-size").bug_class
    with pytest.raises(ConfigError, match="not a P/D fault"):
        get_pd_fault("interleave-off-by-one")
