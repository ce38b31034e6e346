"""Draft models (MTP / EAGLE): layers marked ``draft = true``, the draft's own
``draft_decode_context_parallel_size`` (the target's, or 1 over a replicated cache), and the
drafter's attention metadata judged beside the target's."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.scenarios.dump import scenario_to_dict
from dcpsim.scenarios.load import scenario_from_dict
from support.helpers import builtin, geometries, run


def draft_scenario(draft_w=None, replicated=False, W=4):
    cfg = {"decode_context_parallel_size": W, "num_speculative_tokens": 2, "max_model_len": 2048}
    if draft_w is not None:
        cfg["draft_decode_context_parallel_size"] = draft_w
    return {
        "config": cfg,
        "layers": [
            {"name": "t.{i}", "layers": [0, 1], "kind": "mla", "block_size": 16, "head_size": 64},
            {"name": "mtp", "kind": "mla", "block_size": 16, "head_size": 64, "draft": True, "dcp_replicated": replicated},
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
    with pytest.raises(
        ScenarioError,
        match=r"f.toml: .*layer 'mtp' is sharded over 4 ranks; mark the draft's layers "
        "dcp_replicated",
    ):
        scenario_from_dict(draft_scenario(draft_w=1), source="f.toml")
    ok = scenario_from_dict(draft_scenario(draft_w=1, replicated=True), source="f.toml")
    with pytest.raises(ConfigError, match="is sharded over 4 ranks"):  # also when an override makes it so
        dataclasses.replace(ok, layers={n: dataclasses.replace(s, dcp_replicated=False) for n, s in ok.layers.items()})


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"draft_w": 3}, "draft_decode_context_parallel_size 3"),
    ],
)
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


def test_draft_indptr_is_caught_on_the_drafters_metadata():
    report = run(builtin("dsv3-mtp", 4), inject="draft-indptr-global")
    assert report.failure.kind == "attention-metadata"
    assert any("draft kv_indptr" in d for d in report.failure.details), report.failure.details
    assert run(builtin("dsv3-mtp", 4)).passed


def test_a_drafter_at_w1_writes_its_kv_over_the_sharded_cache():
    # draft-drops-dcp: the MTP layer's KV is written with the drafter's W = 1 slot mapping, every
    # position at block_table[p // B] * B + p % B on every rank, onto slots the sharded layout
    # gives other positions (and, past the blocks held, into the null block)
    report = run(builtin("dsv3-mtp", 4), inject="draft-drops-dcp")
    assert report.failure.kind == "write-violation", report.failure.lines()
    assert report.failure.group.startswith("MLAAttention[model.layers.0")


class _ShardedDrafter(ReferenceEngine):
    """A drafter that believes the replicated draft cache is sharded at the target's W."""

    def draft_geometry(self, geometry):
        draft = super().draft_geometry(geometry)
        if geometry.draft_only and geometry.replicated:
            draft = dataclasses.replace(draft, sharded=True, dcp_size=2, interleave_size=1)
        return draft


class _ShiftedDrafter(ReferenceEngine):
    """A drafter whose owner is one rank off (its writes land where the target's do not)."""

    def write_slots(self, geometry, write, block_row, dcp_rank):
        if geometry.model == "draft" and geometry.sharded:
            dcp_rank = (dcp_rank + 1) % geometry.dcp_size
        return super().write_slots(geometry, write, block_row, dcp_rank)


def test_draft_layers_are_written_with_the_drafters_own_slot_mapping():
    # llama-draft: the draft group (draft layers only) takes the drafter's mapping: a drafter at
    # W = 1 writes every position on every rank, and one that shards leaves holes on every rank
    assert run(builtin("llama-draft", 2)).passed
    holes = run(builtin("llama-draft", 2), engine=_ShardedDrafter())
    assert holes.failure.kind == "wrong-content" and "draft" in holes.failure.group
    assert holes.failure.expected_owner == "all"
    # dsv3-mtp: the MTP layer shares the target's group; its drafter's writes go to the store too
    shifted = run(builtin("dsv3-mtp", 2), engine=_ShiftedDrafter())
    assert not shifted.passed and shifted.failure.kind in ("write-violation", "wrong-content")
