"""The head model: which heads each rank holds, and the DCP rule that a group's gathered queries
find their KV heads on every member, checked against a brute-force walk of the rank grid."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from dcpsim.errors import ConfigError
from dcpsim.model.heads import check_dcp_heads, kv_heads, query_heads
from dcpsim.model.parallel import ParallelLayout, check_parallel_sizes
from support.helpers import builtin


def test_tp_splits_query_heads_and_splits_or_replicates_kv_heads():
    assert [list(query_heads(t, 4, 32)) for t in (0, 3)] == [list(range(8)), list(range(24, 32))]
    assert [list(kv_heads(t, 4, 8)) for t in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(kv_heads(t, 8, 2)) for t in range(8)] == [[0]] * 4 + [[1]] * 4  # each on tp / kv = 4 ranks


def _admissible(pcp, tp, dcp, H, kv) -> bool:
    """Brute force: every rank of every DCP group holds the KV head of every query head any
    member holds (query head h on TP rank h // (H / tp), KV head h // (H / kv); a TP rank holds KV
    head k when its KV range covers it, replicas included)."""
    world = [(p, t) for p in range(pcp) for t in range(tp)]
    groups = ParallelLayout(pcp, tp, dcp).dcp_groups()
    for members in groups:
        coords = [world[r] for r in members]
        used = {h // (H // kv) for _, t in coords for h in range(H) if h // (H // tp) == t}
        for _, t in coords:
            held = {k for k in range(kv) if (k // (kv // tp) == t if kv >= tp else t // (tp // kv) == k)}
            if not used <= held:
                return False
    return True


SIZES = [
    (pcp, tp, dcp, H, kv)
    for pcp, tp, dcp in itertools.product((1, 2), (1, 2, 4, 8), (1, 2, 4, 8))
    for H, kv in ((32, 1), (32, 2), (32, 4), (32, 8), (32, 32), (16, 16))
]


@pytest.mark.parametrize("pcp, tp, dcp, H, kv", SIZES)
def test_the_rule_matches_a_walk_of_the_grid(pcp, tp, dcp, H, kv):
    try:
        check_parallel_sizes(pcp, tp, dcp)
    except ConfigError:
        return  # not a layout vLLM 0.33.0 builds
    if kv % tp and tp % kv:
        return  # TP cannot split these heads (check_tp_heads)
    layout = ParallelLayout(pcp, tp, dcp)
    if _admissible(pcp, tp, dcp, H, kv):
        check_dcp_heads(layout, H, kv)
    else:
        with pytest.raises(ConfigError, match="KV heads do not follow its queries under DCP"):
            check_dcp_heads(layout, H, kv)


def _with_heads(scenario, **heads):
    return dataclasses.replace(scenario, config=dataclasses.replace(scenario.config, **heads))


def test_a_scenario_with_too_few_kv_heads_is_refused_before_any_rank_starts():
    sc = builtin("llama-gqa", 4)  # TP 4, DCP 4 over the TP ranks
    assert _with_heads(sc, num_attention_heads=32, num_key_value_heads=1).config.num_key_value_heads == 1  # kv * dcp <= tp
    with pytest.raises(ConfigError, match=r"rank 0 holds KV heads \[0\]"):
        _with_heads(sc, num_attention_heads=32, num_key_value_heads=2)


def test_a_dcp_group_spanning_the_pcp_axis_is_admissible_whatever_the_kv_heads():
    # vllm#55030: vLLM checks tp > kv and dcp <= tp // kv ignoring PCP, and refuses TP 2, PCP 2,
    # DCP 2 with 2 KV heads; each DCP group here is one TP rank's two PCP ranks, same KV heads
    sc = builtin("glm-pcp2-dcp2", 2)
    gqa = {name: builtin("llama-gqa", 2).layers["model.layers.0.self_attn.attn"] for name in ("attn.0",)}
    sc = dataclasses.replace(sc, layers=gqa, config=dataclasses.replace(sc.config, tensor_parallel_size=2))
    assert _with_heads(sc, num_attention_heads=8, num_key_value_heads=2).config.tp_size == 2


def test_mla_layers_and_replicated_layers_gather_no_kv_heads():
    assert _with_heads(builtin("dsv3", 4), num_attention_heads=128, num_key_value_heads=128).config.num_attention_heads == 128


def test_heads_are_given_in_pairs():
    with pytest.raises(ConfigError, match="given together"):
        _with_heads(builtin("dsv3", 2), num_attention_heads=8)


@pytest.mark.parametrize("command", ["run", "capacity"])
def test_run_and_capacity_refuse_the_layout_with_exit_2_naming_the_file(command, tmp_path, capsys):
    from dcpsim.cli import main
    from dcpsim.scenarios.registry import builtin_scenario_path

    heads = "[config]\nnum_attention_heads = 32\nnum_key_value_heads = 2\n"
    text = builtin_scenario_path("llama-gqa").read_text().replace("[config]\n", heads, 1)
    path = tmp_path / "gqa-heads.toml"
    path.write_text(text)
    argv = [command, str(path)] + (["--dcp", "2,4"] if command == "capacity" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{path}:" in err and "KV heads do not follow its queries under DCP" in err and "rank 0 holds KV heads [0]" in err
