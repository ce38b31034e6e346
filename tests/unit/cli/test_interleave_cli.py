"""`python -m dcpsim interleave`: the JSON numbers, the plot's pixels, and usage errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dcpsim.cli import main

DECODE_ONLY = """
name = "decode-only"
[config]
max_model_len = 256
max_num_batched_tokens = 32
decode_context_parallel_size = 4
num_speculative_tokens = {k}
[[layers]]
name = "layers.{{i}}.attn"
layers = "0-1"
kind = "mla"
block_size = 16
head_size = 64
[[requests]]
id = "r"
prompt_len = 1
output_len = 16
"""
GROUP = "MLAAttention[layers.0.attn+1]"


@pytest.fixture
def decode_only(tmp_path):
    def make(k=0):
        path = tmp_path / f"decode-only-{k}.toml"
        path.write_text(DECODE_ONLY.format(k=k), encoding="utf-8")
        return str(path)

    return make


def test_json_rows_per_interleave(run_json, decode_only):
    code, doc = run_json("interleave", decode_only(), "--interleave", "1,4,B,32")
    assert code == 0
    assert doc["decode_context_parallel_size"] == 4 and doc["block_size"] == 16 and doc["groups"] == [GROUP]
    one, four, block, too_big = doc["rows"]
    assert [r["label"] for r in doc["rows"]] == ["1", "4", "16 (B)", "32"]
    assert one["groups"][GROUP]["stored"] == [4, 4, 4, 4] and four["groups"][GROUP]["stored"] == [4, 4, 4, 4]
    assert block["groups"][GROUP]["stored"] == [16, 0, 0, 0]
    assert block["groups"][GROUP]["empty_shards"] == [0, 1, 1, 1]
    assert [r["groups"][GROUP]["imbalance_max"] for r in (one, four, block)] == [1, 4, 16]
    assert not too_big["valid"] and "cp_kv_cache_interleave_size (32) must be <= block_size (16)" in too_big["error"]
    assert [r["id"] for r in too_big["rules"]][0] == "interleave-divides-block"
    assert [r["rules"] for r in (one,)] == [[]]


def test_speculative_rows_name_the_mtp_rule(run_json, decode_only):
    code, doc = run_json("interleave", decode_only(k=3), "--interleave", "1,B")
    assert code == 0
    one, block = doc["rows"]
    assert one["groups"][GROUP]["speculative_one_rank_share"] == 0
    assert block["groups"][GROUP]["speculative_one_rank_share"] > 0.7
    (mtp,) = [r for r in block["rules"] if r["id"] == "mtp-needs-interleave-support"]
    assert "cp_utils.py" in mtp["source"] and mtp["kind"] == "backend"
    assert not any(r["id"] == "mtp-needs-interleave-support" for r in one["rules"])


def test_text_table(capsys, decode_only):
    assert main(["interleave", decode_only(), "--interleave", "1,B"]) == 0
    out = capsys.readouterr().out
    assert f"{GROUP} (positions)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  1")}
    assert rows["1"][1:7] == ["4", "4", "4", "4", "1", "0.75"]
    assert rows["16"][2:12] == ["16", "0", "0", "0", "16", "8.50", "-", "-", "0", "1"]


def bar_heights(png, colour) -> list[int]:
    """Heights in pixels of the bars of ``colour`` standing on the lowest row of that colour,
    left to right (a legend patch, which does not stand on it, is left out)."""
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    rgb = imread(png)[..., :3]
    mask = np.all(np.abs(rgb - np.array(to_rgb(colour))) < 1 / 255, axis=-1)
    rows, _ = np.nonzero(mask)
    base = rows.max()
    heights, current = [], 0
    for x in range(mask.shape[1]):
        h = 0
        while base - h >= 0 and mask[base - h, x]:
            h += 1
        if h:
            current = max(current, h)
        elif current:
            heights.append(current)
            current = 0
    return heights


def test_png_bars_follow_the_json_numbers(run_json, tmp_path, decode_only):
    from dcpsim.views.interleave_plot import MAX_COLOUR, MEAN_COLOUR

    png = tmp_path / "imbalance.png"
    code, doc = run_json("interleave", decode_only(), "--interleave", "1,4,B", "--png", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for colour, key in ((MAX_COLOUR, "imbalance_max"), (MEAN_COLOUR, "imbalance_mean")):
        values = [row["groups"][GROUP][key] for row in doc["rows"]]
        heights = bar_heights(str(png), colour)
        assert len(heights) == 3, (colour, heights)
        # bar heights in proportion to the numbers (within two pixels)
        scale = heights[-1] / values[-1]
        assert all(abs(h - v * scale) <= 2 for h, v in zip(heights, values)), (heights, values)
        assert heights[0] < heights[1] < heights[2]


def test_png_leaves_an_invalid_interleave_without_bars(run_json, tmp_path, decode_only):
    from dcpsim.views.interleave_plot import MAX_COLOUR

    png = tmp_path / "imbalance.png"
    code, doc = run_json("interleave", decode_only(), "--interleave", "B,32", "--png", str(png))
    assert code == 0 and [r["valid"] for r in doc["rows"]] == [True, False]
    assert len(bar_heights(str(png), MAX_COLOUR)) == 1


def test_png_without_matplotlib_is_exit_2_naming_the_extra(capsys, monkeypatch, tmp_path, decode_only):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["interleave", decode_only(), "--png", str(tmp_path / "x.png")]) == 2
    assert "pip install 'dcpsim[views]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--interleave", "1,x"], "--interleave: 'x' is not an integer or B"),
        (["--dcp", "1"], "no sharded group at W=1"),
        (["--dcp", "0"], "decode_context_parallel_size must be an integer >= 1"),
    ],
)
def test_usage_errors_are_exit_2(capsys, decode_only, argv, message):
    assert main(["interleave", decode_only(), *argv]) == 2
    assert message in capsys.readouterr().err


def test_every_size_invalid_is_exit_2_after_the_reasons(capsys, decode_only):
    assert main(["interleave", decode_only(), "--interleave", "32,64"]) == 2  # both > B = 16
    captured = capsys.readouterr()
    assert "I=32: invalid" in captured.out and "I=64: invalid" in captured.out
    assert "--interleave: no size is valid here (32, 64" in captured.err
    assert main(["interleave", decode_only(), "--interleave", "32,1"]) == 0, "one valid size is a comparison"
