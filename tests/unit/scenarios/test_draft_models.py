"""Draft models (MTP / EAGLE): layers marked ``draft = true``, the draft's own
``draft_decode_context_parallel_size`` (the target's, or 1 over a replicated cache), and the
drafter's attention metadata judged beside the target's."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.scenarios.dump import scenario_to_dict
from dcpsim.scenarios.load import scenario_from_dict
from helpers import builtin, geometries, run


def draft_scenario(draft_w=None, replicated=False, W=4):
    cfg = {"decode_context_parallel_size": W, "num_speculative_tokens": 2, "max_model_len": 2048}
    if draft_w is not None:
        cfg["draft_decode_context_parallel_size"] = draft_w
    return {
        "config": cfg,
        "layers": [
            {"name": "t.{i}", "layers": [0, 1], "kind": "mla", "block_size": 16, "head_size": 64},
            {"name": "mtp", "kind": "mla", "block_size": 16, "head_size": 64, "draft": True,
             "dcp_replicated": replicated},
        ],
        "requests": [{"id": "a", "prompt_len": 100, "output_len": 8, "acceptance": [2, 0, 1]}],
    }


def test_draft_layers_and_their_parallel_config_load():
    s = scenario_from_dict(draft_scenario(), source="f.toml")
    assert s.config.draft_layers == ("mtp",) and s.config.draft_dcp_size == 4
    [g] = geometries(s)  # a sharded draft of the target's shape shares the target's group
    assert g.draft and g.sharded
    rep = scenario_from_dict(draft_scenario(draft_w=1, replicated=True), source="f.toml")
    assert rep.config.draft_dcp_size == 1
    assert [g.draft for g in geometries(rep)] == [False, True]


def test_a_draft_at_w1_against_a_sharded_cache_is_refused_naming_the_layer():
    with pytest.raises(ScenarioError, match=r"f.toml: .*layer 'mtp' is sharded over 4 ranks; mark the draft's layers "
                                            "dcp_replicated"):
        scenario_from_dict(draft_scenario(draft_w=1), source="f.toml")
    ok = scenario_from_dict(draft_scenario(draft_w=1, replicated=True), source="f.toml")
    with pytest.raises(ConfigError, match="is sharded over 4 ranks"):  # also when an override makes it so
        dataclasses.replace(ok, layers={n: dataclasses.replace(s, dcp_replicated=False) for n, s in ok.layers.items()})


@pytest.mark.parametrize("bad, where", [
    ({"draft_w": 3}, "draft_decode_context_parallel_size 3"),
])
def test_draft_size_must_be_one_or_the_targets(bad, where):
    with pytest.raises(ScenarioError, match=where):
        scenario_from_dict(draft_scenario(**{"draft_w": bad["draft_w"]}), source="f.toml")


def test_draft_size_without_draft_layers_and_a_bad_flag():
    data = draft_scenario(draft_w=1, replicated=True)
    data["layers"][1]["draft"] = "yes"
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(data, source="f.toml")
    assert "layers[1].draft: must be true or false" in str(exc.value)
    assert "config.draft_decode_context_parallel_size: is set but no layer says draft = true" in str(exc.value)


def test_draft_flags_survive_a_dump():
    s = builtin("llama-draft", 2)
    again = scenario_from_dict(scenario_to_dict(s), source="again")
    assert again.config.draft_layers == s.config.draft_layers == ("draft.model.layers.0.self_attn.attn",)
    assert again.config.draft_decode_context_parallel_size == 1


@pytest.mark.parametrize("name", ["dsv3-mtp", "llama-draft"])
def test_the_drafter_metadata_is_judged(name):
    report = run(builtin(name, 2))
    assert report.passed
    groups = geometries(builtin(name, 2))
    per_step = sum(1 + g.draft for g in groups if g.storage.value in ("paged", "records"))
    assert report.metadata_checks == per_step * report.steps


@pytest.mark.parametrize("fault, field", [("draft-drops-dcp", "draft block_table_width"),
                                          ("draft-indptr-global", "draft kv_indptr")])
def test_draft_faults_are_caught_on_the_drafters_metadata(fault, field):
    report = run(builtin("dsv3-mtp", 4), inject=fault)
    assert report.failure.kind == "attention-metadata"
    assert any(field in d for d in report.failure.details), report.failure.details
    assert run(builtin("dsv3-mtp", 4)).passed
