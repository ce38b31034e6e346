"""The [disaggregated] table: parsing, the NIXL interleave default, validation messages naming the field."""

from __future__ import annotations

import tomllib

import pytest

from dcpsim.cli import main
from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.harness.pd import PDJob, prepare_pd
from dcpsim.scenarios.load import load_scenario, scenario_from_dict
from dcpsim.scenarios.pd import instance_layout, instance_scenario, shard_ranks
from dcpsim.scenarios.registry import builtin_scenario_path


def pd_data(**tables):
    data = tomllib.loads(builtin_scenario_path("pd-dsv3").read_text())
    for role, fields in tables.items():
        if role == "kv_connector":
            data["disaggregated"]["kv_connector"] = fields
        else:
            data["disaggregated"][role] = fields
    return data


def test_the_builtin_resolves_the_nixl_interleave_to_the_block_size():
    s = load_scenario("pd-dsv3")
    assert s.disaggregated.kv_connector == "nixl"
    assert instance_layout(s, "prefill").cp_kv_cache_interleave_size == 64
    decode = instance_scenario(s, "decode")
    assert decode.config.decode_context_parallel_size == 4 and decode.config.cp_kv_cache_interleave_size == 64
    prefill = instance_scenario(s, "prefill")
    assert {r.output_len for r in prefill.requests} == {1}
    assert [r.output_len for r in decode.requests] == [r.output_len for r in s.requests]


def test_resharding_keeps_the_scenario_interleave_and_takes_any_sizes():
    s = scenario_from_dict(
        pd_data(kv_connector="resharding", decode={"decode_context_parallel_size": 3, "block_size": 32, "cp_kv_cache_interleave_size": 4}),
        source="f.toml",
    )
    assert instance_layout(s, "prefill").cp_kv_cache_interleave_size == 64  # [config]'s
    lay = instance_layout(s, "decode")
    assert (lay.decode_context_parallel_size, lay.cp_kv_cache_interleave_size, lay.block_size) == (3, 4, 32)


@pytest.mark.parametrize(
    "tables, message",
    [
        (
            dict(decode={"decode_context_parallel_size": 0}),
            "f.toml: disaggregated.decode.decode_context_parallel_size: must be an integer >= 1",
        ),
        (dict(decode={"dcp": 2}), "f.toml: disaggregated.decode.dcp: unknown field"),
        (dict(kv_connector="mooncake"), "f.toml: disaggregated.kv_connector: must be one of nixl, resharding"),
        (
            dict(decode={"decode_context_parallel_size": 4, "cp_kv_cache_interleave_size": 16}),
            "decode instance's cp_kv_cache_interleave_size \\(16\\) equal to its block_size \\(64\\)",
        ),
        (
            dict(decode={"decode_context_parallel_size": 2, "prefill_context_parallel_size": 2}),
            "disaggregated.decode.prefill_context_parallel_size: the NIXL connector supports PCP on the prefill",
        ),
        (dict(decode={"decode_context_parallel_size": 3}), "must divide one another, got prefill 2 and decode 3"),
    ],
)
def test_a_bad_table_names_the_field(tables, message):
    with pytest.raises(ScenarioError, match=message):
        scenario_from_dict(pd_data(**tables), source="f.toml")


def test_a_pcp_prefill_is_its_w_shards_and_its_world_is_pcp_times_tp():
    s = scenario_from_dict(pd_data(prefill={"decode_context_parallel_size": 2, "prefill_context_parallel_size": 2}), source="f.toml")
    prepare_pd(PDJob(s))
    config = instance_scenario(s, "prefill").config
    assert (config.prefill_context_parallel_size, config.parallel_layout.tp, config.decode_context_parallel_size) == (2, 1, 2)
    lay = instance_layout(s, "prefill")  # vLLM 0.33.0: DCP spans the PCP group, one DCP rank per PCP rank
    assert (lay.prefill_context_parallel_size, lay.decode_context_parallel_size, lay.cp_size) == (2, 1, 2)
    assert PDJob(s).sizes == (2, 4) and s.disaggregated.world_size == 6
    assert shard_ranks(s, "prefill") == [0, 1]
    replicated = scenario_from_dict(
        pd_data(
            prefill={"decode_context_parallel_size": 1, "prefill_context_parallel_size": 2, "tensor_parallel_size": 2},
            decode={"decode_context_parallel_size": 1},
        ),
        source="f.toml",
    )
    lay = instance_layout(replicated, "prefill")
    assert lay.cp_size == 1 and shard_ranks(replicated, "prefill") == [0] and PDJob(replicated).sizes == (4, 1)


@pytest.mark.parametrize(
    "prefill, decode, message",
    [
        (
            {"decode_context_parallel_size": 2, "prefill_context_parallel_size": 2, "tensor_parallel_size": 2},
            4,
            "the NIXL connector takes PCP \\+ DCP only at TP 1 with DCP spanning the full PCP group",
        ),
        (
            {"decode_context_parallel_size": 4, "prefill_context_parallel_size": 2},
            4,
            "prefill_context_parallel_size 2 with decode_context_parallel_size 4 and tensor_parallel_size 2",
        ),
        (
            {"decode_context_parallel_size": 1, "prefill_context_parallel_size": 2},
            4,
            "cannot pair replicated PCP \\(prefill PCP 2, DCP 1\\) with a DCP-sharded decode instance",
        ),
    ],
)
def test_nixl_refuses_the_pcp_prefills_vllm_refuses(prefill, decode, message):
    with pytest.raises(ScenarioError, match=message):
        scenario_from_dict(pd_data(prefill=prefill, decode={"decode_context_parallel_size": decode}), source="f.toml")
    # the re-sharding connector takes them
    s = scenario_from_dict(
        pd_data(kv_connector="resharding", prefill=prefill, decode={"decode_context_parallel_size": decode}), source="f.toml"
    )
    prepare_pd(PDJob(s))


def test_the_cli_runs_a_pcp_prefill_and_refuses_what_nixl_cannot_take(capsys):
    assert main(["run", "pd-dsv3", "--prefill-pcp", "2", "--prefill-tp", "2"]) == 2
    assert "TP 1 with DCP spanning the full PCP group" in capsys.readouterr().err
    assert main(["run", "pd-dsv3", "--decode-tp", "8", "--kv-connector", "resharding"]) == 2
    assert "the decode instance of a P/D run is one DCP group" in capsys.readouterr().err


def test_unsupported_groups_and_flags_are_exit_2(capsys, tmp_path):
    data = tomllib.loads(builtin_scenario_path("dsv41-hybrid").read_text())
    data["disaggregated"] = {"kv_connector": "resharding", "prefill": {}, "decode": {"decode_context_parallel_size": 2}}
    with pytest.raises(ConfigError, match="is not supported in P/D runs yet"):
        prepare_pd(PDJob(scenario_from_dict(data, source="f.toml")))
    assert main(["run", "dsv3", "--decode-dcp", "2"]) == 2
    assert "need a scenario with a [disaggregated] table" in capsys.readouterr().err
    assert main(["run", "pd-dsv3", "--in-process"]) == 2
    assert main(["run", "pd-dsv3", "--dcp", "4"]) == 2
    assert "take --prefill-dcp and --decode-dcp" in capsys.readouterr().err
    assert main(["run", "pd-dsv3", "--inject", "no-such-fault"]) == 2
    assert "P/D faults: nixl-stride-by-dcp" in capsys.readouterr().err
    assert main(["run", "pd-dsv3", "--inject", "reshard-ignores-interleave"]) == 2
    assert "the fault is in the resharding connector; this run uses kv_connector = nixl" in capsys.readouterr().err


def test_a_written_scenario_keeps_its_disaggregated_table():
    """``scenario_to_toml`` writes ``[disaggregated]`` back (a shrunk ``fuzz --pd`` failure reruns as P/D)."""
    from dcpsim.scenarios.dump import scenario_to_dict, scenario_to_toml

    s = load_scenario("pd-dsv3")
    data = pd_data(kv_connector="resharding", prefill={"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 2})
    changed = scenario_from_dict(data, source="x")
    for original in (s, changed):
        again = scenario_from_dict(tomllib.loads(scenario_to_toml(original)), source="written")
        assert again.disaggregated == original.disaggregated and again.requests == original.requests
        assert scenario_from_dict(scenario_to_dict(original), source="dict").disaggregated == original.disaggregated
    assert changed.disaggregated.prefill.cp_kv_cache_interleave_size == 2
