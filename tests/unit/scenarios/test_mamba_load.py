"""``kind = "mamba"`` in scenario files: the Qwen3-Next built-in, the fields vLLM derives from
the config (block size, speculative blocks), errors that name the file and field (exit 2), a
dump round trip, ``with_overrides(mamba_cache_mode=..., block_size=...)``, and a fuzz test that
a Mamba layer table only ever raises ``ScenarioError`` / ``ConfigError``."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpsim.cli import main
from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.model.specs import FullAttentionSpec, MambaSpec
from dcpsim.scenarios.dump import scenario_to_dict, scenario_to_toml
from dcpsim.scenarios.load import load_scenario, scenario_from_dict
from support.helpers import geometries

SRC = "m.toml"


def mamba_layer(**fields):
    return {
        "name": "l.{i}.linear_attn",
        "layers": [0, 1],
        "kind": "mamba",
        "shapes": [[3, 64], [4, 8, 8]],
        "dtypes": ["bfloat16", "float32"],
        **fields,
    }


def data(*layers, **config):
    cfg = {"max_model_len": 1024, "max_num_batched_tokens": 64, "num_speculative_tokens": 1, **config}
    return {
        "config": cfg,
        "layers": [{"name": "l.2.attn", "kind": "full_attention", "block_size": 16, "num_kv_heads": 1, "head_size": 8}, *layers],
        "requests": [{"prompt_len": 100, "output_len": 5}],
    }


def problem_lines(d) -> list[str]:
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(d, source=SRC)
    return str(exc.value).splitlines()


def test_the_qwen3_next_builtin():
    sc = load_scenario("qwen3-next-hybrid")
    gdn = [s for s in sc.layers.values() if isinstance(s, MambaSpec)]
    att = [s for s in sc.layers.values() if isinstance(s, FullAttentionSpec)]
    assert len(gdn) == 36 and len(att) == 12  # 48 layers, every 4th full attention
    assert "model.layers.3.self_attn.attn" in sc.layers and "model.layers.47.self_attn.attn" in sc.layers
    assert "model.layers.4.linear_attn" in sc.layers and "model.layers.3.linear_attn" not in sc.layers
    spec = gdn[0]
    # filled from the config as vLLM derives them: none mode, mamba_block_size = max_model_len, k = 2
    assert spec.mamba_cache_mode == "none" and spec.block_size == 8192 and spec.num_speculative_blocks == 2
    assert spec.shapes == ((5, 8192), (32, 128, 128)) and spec.real_page_size_bytes == 1_130_496
    # the padded page equals the 560-token attention page: 560 * 2 * (256 + 256) * 2 bytes
    assert spec.page_size_bytes == att[0].page_size_bytes == 1_146_880
    state, full = sorted(geometries(sc), key=lambda g: g.storage != "state")
    assert state.replicated and state.manager_block_size == 8192 and state.block_table_width == 3
    assert full.sharded and full.manager_block_size == 560 * 2


def test_block_size_and_speculative_blocks_are_derived():
    sc = scenario_from_dict(data(mamba_layer()), source=SRC)
    spec = sc.layers["l.0.linear_attn"]
    assert spec.block_size == 1024 and spec.num_speculative_blocks == 1
    # align mode needs its block size from the file
    lines = problem_lines(data(mamba_layer(mamba_cache_mode="align")))
    assert lines == [f"{SRC}: layers[1].block_size: is required for kind 'mamba'"]
    align = scenario_from_dict(data(mamba_layer(mamba_cache_mode="align", block_size=16)), source=SRC)
    assert align.layers["l.1.linear_attn"].block_size == 16


@pytest.mark.parametrize(
    "fields,path,text",
    [
        ({"shapes": [[3, "x"]]}, "layers[1].shapes", "must be a non-empty list of state shapes"),
        ({"shapes": []}, "layers[1].shapes", "must be a non-empty list of state shapes"),
        ({"dtypes": ["bfloat16"]}, "layers[1].dtypes", "must list one dtype per state shape (2)"),
        ({"dtypes": ["bfloat16", "fp4"]}, "layers[1].dtypes", "entry 'fp4' is not known"),
        ({"mamba_cache_mode": "all"}, "layers[1].mamba_cache_mode", "must be one of ['none', 'align']"),
        ({"block_size": 512}, "layers[1].block_size", "must be >= max_model_len (1024) in mamba_cache_mode 'none'"),
        ({"num_speculative_blocks": 3}, "layers[1].num_speculative_blocks", "must equal num_speculative_tokens (1)"),
        ({"page_size_padded": 10}, "layers[1].page_size_padded", "must be >= the real page size (1408)"),
        ({"shape": [[1]]}, "layers[1].shape", "unknown field (did you mean 'shapes'?)"),
    ],
)
def test_errors_name_the_file_and_field(fields, path, text):
    # the real page: 3 * 64 * 2 + 4 * 8 * 8 * 4 = 384 + 1024 = 1408 bytes
    lines = problem_lines(data(mamba_layer(**fields)))
    assert any(line.startswith(f"{SRC}: {path}: ") and text in line for line in lines), lines


def test_missing_shapes_and_dtypes_are_reported_together():
    layer = mamba_layer()
    del layer["shapes"], layer["dtypes"]
    lines = problem_lines(data(layer))
    assert f"{SRC}: layers[1].shapes: is required for kind 'mamba'" in lines
    assert f"{SRC}: layers[1].dtypes: is required for kind 'mamba'" in lines


def test_a_bad_mamba_layer_is_exit_2_before_any_rank_starts(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(
        scenario_to_toml(scenario_from_dict(data(mamba_layer()), source=SRC)).replace(
            'dtypes = ["bfloat16", "float32"]', 'dtypes = ["bfloat16", "float64"]'
        )
    )
    code = main(["run", str(path), "--json"])
    err = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and err["kind"] == "ScenarioError"
    assert f"{path}: layers[1].dtypes: MambaSpec.dtypes entry 'float64' is not known" in err["message"]


def test_dump_round_trip():
    sc = load_scenario("qwen3-next-hybrid")
    again = scenario_from_dict(scenario_to_dict(sc), source=sc.source)
    assert again.layers == sc.layers and again.config == sc.config and again.requests == sc.requests
    text = scenario_to_toml(sc)
    assert 'kind = "mamba"' in text and "shapes = [[5, 8192], [32, 128, 128]]" in text


def test_with_overrides_mamba_cache_mode_and_block_size():
    sc = load_scenario("qwen3-next-hybrid")
    gdn = "model.layers.0.linear_attn"
    # --block-size leaves a none-mode state alone (its block is the whole request)
    assert sc.with_overrides(ScenarioOverrides(block_size=16)).layers[gdn].block_size == 8192
    # align: the cache block size (the attention layers' 560), or --block-size
    align = sc.with_overrides(ScenarioOverrides(mamba_cache_mode="align"))
    assert align.layers[gdn].mamba_cache_mode == "align" and align.layers[gdn].block_size == 560
    small = sc.with_overrides(ScenarioOverrides(mamba_cache_mode="align", block_size=16))
    assert small.layers[gdn].block_size == 16 and small.layers["model.layers.3.self_attn.attn"].block_size == 16
    (state,) = [g for g in geometries(small) if g.storage == "state"]
    assert state.block_table_width == 8192 // 16 + 2 and state.manager_block_size == 16
    # and back: none mode takes max_model_len again
    back = small.with_overrides(ScenarioOverrides(mamba_cache_mode="none"))
    assert back.layers[gdn].block_size == 8192 and back.layers[gdn].mamba_cache_mode == "none"
    with pytest.raises(ConfigError, match=r"mamba_cache_mode must be one of \['none', 'align'\], got 'all'"):
        sc.with_overrides(ScenarioOverrides(mamba_cache_mode="all"))


def test_the_cli_flag(capsys):
    code = main(["run", "qwen3-next-hybrid", "--mamba-cache-mode", "align", "--block-size", "64", "--in-process", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["failure"]
    state = next(g for g in report["engine"]["groups"] if g["name"].startswith("Mamba"))
    assert state["manager_block_size"] == 64 and state["block_table_width"] == 8192 // 64 + 2


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 20000),
    st.text(max_size=8),
    st.sampled_from(["none", "align", "bfloat16", "float32", "gdn_attn"]),
    st.lists(st.one_of(st.integers(-1, 9), st.text(max_size=3), st.lists(st.integers(-1, 9), max_size=3)), max_size=3),
)
KEYS = ["block_size", "shapes", "dtypes", "page_size_padded", "mamba_type", "mamba_cache_mode", "num_speculative_blocks", "kind"]


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=4))
def test_fuzz_mamba_tables_only_raise_scenario_errors(changes):
    layer = {**mamba_layer(), **changes}
    try:
        scenario_from_dict(data(layer), source=SRC)
    except (ScenarioError, ConfigError) as exc:
        assert str(exc).startswith(f"{SRC}: "), str(exc)


def test_the_documented_mamba_layer_joins_the_documented_example(tmp_path):
    """docs/scenarios.md: its first ```toml block is the example, its second the Mamba layer."""
    import re
    from pathlib import Path

    from dcpsim.campaigns.fuzz import check

    page = (Path(__file__).resolve().parents[3] / "docs" / "scenarios.md").read_text()
    example, layer = re.findall(r"```toml\n(.*?)```", page, flags=re.S)[:2]
    assert 'kind = "mamba"' in layer
    head, requests = example.split("[[requests]]", 1)
    path = tmp_path / "tiny-mamba.toml"
    path.write_text(head + layer + "\n[[requests]]" + requests)
    sc = load_scenario(str(path))
    spec = sc.layers["model.layers.0.linear_attn"]
    assert spec.block_size == sc.config.max_model_len and spec.num_speculative_blocks == 2
    report = check(sc)
    assert report.passed, report.text()
    assert any(g["storage"] == "state" for g in report.groups)
