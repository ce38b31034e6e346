"""The cache block size (``[config] block_size``, vLLM's ``--block-size``): layers without their
own ``block_size`` take it, and under DCP the interleave is validated against it as vLLM 0.33.0's
``validate_block_size`` does, beside the seed's per-group rule (semantics section 2)."""

from __future__ import annotations

import pytest

from dcpsim.cli import main
from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario, scenario_from_dict


def data(W=2, I=1, B=16, layers=None):
    return {
        "config": {
            "max_model_len": 512,
            "max_num_batched_tokens": 64,
            "decode_context_parallel_size": W,
            "cp_kv_cache_interleave_size": I,
            "block_size": B,
        },
        "layers": layers
        or [
            {"name": "mla", "kind": "mla", "head_size": 64},
            {"name": "c4", "kind": "mla", "head_size": 64, "tokens_per_state": 4},
            {"name": "own", "kind": "mla", "head_size": 64, "block_size": 32},
        ],
        "requests": [{"prompt_len": 100, "output_len": 4}],
    }


def test_layers_without_a_block_size_take_the_cache_block_size():
    sc = scenario_from_dict(data(B=16), source="f.toml")
    assert sc.config.block_size == 16
    assert sc.layers["mla"].block_size == 16
    assert sc.layers["c4"].block_size == 64  # 16 records of R = 4 tokens
    assert sc.layers["own"].block_size == 32


@pytest.mark.parametrize("I,B", [(32, 16), (12, 16), (32, 48)])
def test_the_interleave_must_fit_the_cache_block_size_under_dcp(I, B):
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data(I=I, B=B), source="f.toml")
    first = str(exc.value).splitlines()[0]
    assert first.startswith("f.toml: config.block_size: ")
    assert f"block_size ({B}) should be greater than or equal to and divisible by cp_kv_cache_interleave_size ({I})" in first


@pytest.mark.parametrize("I,B", [(1, 16), (4, 16), (16, 16), (16, 48)])
def test_an_interleave_that_fits_is_accepted(I, B):
    sc = scenario_from_dict(data(I=I, B=B), source="f.toml")
    assert sc.config.cp_kv_cache_interleave_size == I


def test_without_dcp_the_interleave_is_not_checked_as_vllm_does():
    sc = scenario_from_dict(data(W=1, I=32, B=16), source="f.toml")
    assert sc.config.cp_kv_cache_interleave_size == 32


def test_block_size_override_sets_the_cache_block_size_and_is_validated():
    sc = load_scenario("dsv3").with_overrides(ScenarioOverrides(block_size=16))
    assert sc.config.block_size == 16
    with pytest.raises(ConfigError, match=r"block_size \(16\) should be .* cp_kv_cache_interleave_size \(32\)"):
        sc.with_overrides(ScenarioOverrides(cp_kv_cache_interleave_size=32))


def test_the_seed_rule_still_checks_each_sharded_group(capsys):
    # no cache block size: a sharded group whose page the interleave does not divide is refused,
    # naming the group (the seed's per-group rule)
    sc = load_scenario("dsv3").with_overrides(ScenarioOverrides(cp_kv_cache_interleave_size=128))
    assert sc.config.block_size is None
    code = main(["run", "dsv3", "--interleave", "128", "--in-process"])
    err = capsys.readouterr().err
    assert code == 2
    assert "group MLAAttention[" in err and "cp_kv_cache_interleave_size (128) must be <= block_size (64)" in err


def test_run_refuses_a_misfit_interleave_with_exit_2(capsys):
    code = main(["run", "dsv3", "--block-size", "16", "--interleave", "32", "--in-process"])
    err = capsys.readouterr().err
    assert code == 2
    assert "block_size (16) should be greater than or equal to and divisible by cp_kv_cache_interleave_size (32)" in err
