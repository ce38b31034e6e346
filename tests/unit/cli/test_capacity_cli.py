"""`python -m dcpsim capacity`: JSON columns, the text table, per-column invalid sizes and
usage errors."""

from __future__ import annotations

import pytest

from dcpsim.cli import main

SHARDED_WINDOW = """
name = "sharded-window"
kv_cache_tokens = 1024
[config]
max_model_len = 1024
max_num_batched_tokens = 64
[[layers]]
name = "layers.{i}.attn"
layers = "0-1"
kind = "full_attention"
block_size = 16
num_kv_heads = 2
head_size = 64
[[layers]]
name = "layers.{i}.swa"
layers = [1]
kind = "sliding_window"
block_size = 16
num_kv_heads = 2
head_size = 64
sliding_window = 64
[[requests]]
id = "r"
prompt_len = 100
output_len = 10
"""


def test_json_columns_for_each_dcp_size(run_json):
    code, doc = run_json("capacity", "dsv3", "--dcp", "1,2,4,8")
    assert code == 0 and doc["pool"] == {"mode": "scenario", "kv_cache_tokens": 3072, "num_gpu_blocks": None}
    cols = doc["columns"]
    assert [c["decode_context_parallel_size"] for c in cols] == [1, 2, 4, 8]
    groups = [c["groups"][0] for c in cols]
    # the page and the pool's tokens stay; what a rank spends per token and per request shrinks with W
    assert {g["page_size_bytes"] for g in groups} == {61 * 64 * 656}
    assert [g["bytes_per_token"] for g in groups] == [61 * 656 / w for w in (1, 2, 4, 8)]
    assert [g["blocks_per_request"] for g in groups] == [64, 32, 16, 8]
    assert [g["pool_blocks"] for g in groups] == [48, 24, 12, 6] and {g["pool_tokens"] for g in groups} == {3072}
    assert [c["context_tokens"] for c in cols] == [3072] * 4 and cols[0]["concurrency"] == 0.75


def test_gpu_memory_budget(run_json):
    code, doc = run_json("capacity", "llama-draft", "--dcp", "1,4", "--gpu-memory-gib", "80", "--gpu-memory-utilization", "0.5")
    assert code == 0 and doc["pool"]["budget_bytes_per_rank"] == 40 << 30
    assert any("no weights, activations or CUDA graphs" in n for n in doc["notes"])
    w1, w4 = doc["columns"]
    assert w1["num_blocks"] == w4["num_blocks"] == (40 << 30) // w1["block_bytes"]
    target, draft = w4["groups"]
    assert target["sharded"] and not draft["sharded"] and draft["dcp_replicated"]
    # the replicated draft is a quarter of what the target costs per token at W = 4 only when sharded too
    assert draft["if_sharded_bytes"] == draft["max_memory_usage_bytes"] // 4
    assert w4["concurrency"] == w4["num_blocks"] / (target["blocks_per_request"] + draft["blocks_per_request"])
    assert w4["context_tokens"] > w1["context_tokens"]


def test_an_invalid_size_is_a_column_that_says_why(run_json, tmp_path):
    path = tmp_path / "sw.toml"
    path.write_text(SHARDED_WINDOW, encoding="utf-8")
    code, doc = run_json("capacity", str(path), "--dcp", "1,2")
    assert code == 0
    ok, bad = doc["columns"]
    assert ok["error"] is None and len(ok["groups"]) == 2
    assert bad["groups"] == [] and "mark the spec dcp_replicated" in bad["error"]


def test_text_table(capsys, tmp_path):
    path = tmp_path / "sw.toml"
    path.write_text(SHARDED_WINDOW, encoding="utf-8")
    assert main(["capacity", str(path), "--dcp", "1,2"]) == 0
    out = capsys.readouterr().out
    blocks = [line.split()[-2:] for line in out.splitlines() if line.startswith("  blocks per request")]
    # full attention: cdiv(1024, 16); the window's admission cap: cdiv(min(63 + 64, 1024), 16) + 1
    assert blocks == [["64", "-"], ["9", "-"]]
    assert "W=2: invalid:" in out and "pool from the scenario: kv_cache_tokens = 1024" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dcp", "1,x"], "--dcp: 'x' is not an integer"),
        (["--dcp", "0"], "--dcp: decode_context_parallel_size must be an integer >= 1, got 0"),
        (["--dcp", "1,-2"], "--dcp: decode_context_parallel_size must be an integer >= 1, got -2 (in 1,-2)"),
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization needs --gpu-memory-gib"),
        (["--gpu-memory-gib", "80", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--gpu-memory-gib", "0"], "--gpu-memory-gib must be > 0"),
    ],
)
def test_usage_errors_are_exit_2(capsys, argv, message):
    assert main(["capacity", "dsv3", *argv]) == 2
    assert message in capsys.readouterr().err
