"""vLLM's choice of KV cache manager layout under ``--engine vllm`` (issue 30): its
``VllmConfig.__post_init__`` turns the hybrid manager off for a model with chunked local
attention, and ``unify_hybrid_kv_cache_specs`` decides what the layers then become. A layout it
changes is exit 2 naming both (dcpsim does not run the unified layout); one it leaves alone runs
as the hybrid manager, where vLLM 0.31.0 and later assert at the first prefix lookup of a
replicated chunked-local group beside sharded full attention (``llama4-chunked-prefix``, the
fuzz's finding of ``--examples 60 --seed 11``)."""

from __future__ import annotations

import json

import pytest

import dcpsim
from dcpsim.cli import main
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.vllm.releases import VLLM_RELEASES
from dcpsim.scenarios.load import load_scenario

pytestmark = pytest.mark.slow

SHRUNK = """
name = "fuzz-chunked"
seed = 0
verify_every = 1
kv_cache_tokens = 18

[config]
max_model_len = 3
max_num_batched_tokens = 4
decode_context_parallel_size = {W}
cp_kv_cache_interleave_size = 1
enable_prefix_caching = true
num_speculative_tokens = {k}
speculative_method = "{method}"

[[layers]]
names = ["attn.0"]
kind = "full_attention"
block_size = 4
num_kv_heads = 2
head_size = 16

[[layers]]
names = ["chunk.1"]
kind = "chunked_local"
block_size = 4
num_kv_heads = 2
head_size = 16
{replicated}
attention_chunk_size = 12

[[requests]]
id = "r0"
prompt_len = 1
output_len = 1
"""
"""The fuzz's shrunk schedule (``fuzz --engine vllm --examples 60 --seed 11`` on vLLM 0.33.0)."""
FINDING = "llama4-chunked-prefix"
ASSERTION = "KV cache groups with different block sizes are not compatible with chunked local attention now"
SHOWN_FROM = "0.31.0"


def _scenario(tmp_path, W=2, replicated=True, k=0, method="ngram") -> str:
    path = tmp_path / f"shrunk-{W}-{replicated}-{method}.toml"
    text = SHRUNK.format(W=W, k=k, method=method, replicated="dcp_replicated = true" if replicated else "")
    path.write_text(text, encoding="utf-8")
    return str(path)


def _run(capsys, source, *argv) -> tuple[int, dict | str]:
    code = main(["run", *argv, "--engine", "vllm", "--vllm-source", str(source), "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code in (0, 1) else out.err


def test_the_fuzz_finding_is_vllms_crash_at_its_first_prefix_lookup(capsys, tmp_path, vllm_source):
    """The shrunk schedule: vLLM turns its hybrid manager off, promotes no layer (the replicated
    chunked-local layer is alone among the replicated ones), and asserts at step 0."""
    code, report = _run(capsys, vllm_source, _scenario(tmp_path))
    assert code == 1, report
    layout = report["engine"]["scheduler_decisions"]["manager layout"]
    assert "off for chunked local attention unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1" in layout, layout
    assert "vllm/config/vllm.py:2246" in layout and "promotes no layer" in layout, layout
    failure = report["failure"]
    assert failure["kind"] == "engine-error" and failure["step"] == 0 and ASSERTION in failure["message"], failure
    where = "ChunkedLocalAttentionManager.find_longest_cache_hit, vllm/v1/core/single_type_kv_cache_manager.py:1338"
    assert failure["details"][0].endswith(where), failure["details"]
    # with vLLM's switch the hybrid manager is on: the same layout, the same assertion
    code, report = _run(capsys, vllm_source, _scenario(tmp_path), "--vllm-allow-chunked-local-hybrid")
    assert code == 1 and ASSERTION in report["failure"]["message"], report
    assert report["engine"]["scheduler_decisions"]["manager layout"].startswith("vLLM's hybrid KV cache manager on: VLLM_ALLOW")


def test_a_layout_vllm_unifies_is_exit_2_quoting_the_rule_and_the_promotion(capsys, tmp_path, vllm_source):
    """At W = 1 with the chunked-local layer not replicated, vLLM stores it as full attention:
    exit 2 (and the fuzz leaves it out), unless vLLM's switch keeps the hybrid manager."""
    path = _scenario(tmp_path, W=1, replicated=False)
    code, err = _run(capsys, vllm_source, path)
    assert code == 2, err
    assert "vllm/config/vllm.py:2246" in err and "unify_hybrid_kv_cache_specs (vllm/v1/core/kv_cache_planning.py:853" in err, err
    assert "stores the layers chunk.1 as FullAttentionSpec(block_size=4)" in err and "dcpsim does not run that unified layout" in err
    engine = EngineChoice("vllm", vllm_source=str(vllm_source))
    assert "unify_hybrid_kv_cache_specs" in engine.refusal(load_scenario(path))
    code, report = _run(capsys, vllm_source, path, "--vllm-allow-chunked-local-hybrid")
    assert code == 0, report
    # beside an EAGLE drafter vLLM turns the manager off whatever the switch says
    path = _scenario(tmp_path, W=1, replicated=False, k=1, method="eagle")
    code, err = _run(capsys, vllm_source, path, "--vllm-allow-chunked-local-hybrid")
    assert code == 2 and "beside an EAGLE-style drafter" in err and "vllm/config/vllm.py:2239: if self.speculative_config" in err, err


def test_engine_info_says_the_rule(capsys, vllm_source):
    assert main(["engine", "info", "--engine", "vllm", "--vllm-source", str(vllm_source), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    rule = info["scheduler_decisions"]["manager layout"]
    assert rule.startswith("vllm vllm.config.vllm.VllmConfig.__post_init__ (vllm/config/vllm.py:2235-2255)"), rule
    assert "vllm.v1.core.kv_cache_planning.unify_hybrid_kv_cache_specs" in rule
    assert info["bindings"]["kv_cache_layout"].endswith("[planning]") and info["bindings"]["hybrid_manager_rule"].endswith("[post-init]")


@pytest.mark.dist
@pytest.mark.parametrize("release", VLLM_RELEASES)
def test_the_finding_shows_from_0_31_0(release, release_source):
    """README's upstream-bug table: ``llama4-chunked-prefix`` ends in vLLM's assertion in every
    release with ``dcp_sharded`` (0.31.0 on), exit 2 before (no replicated group there); it
    passes at W = 1 and under the reference."""
    source = str(release_source("vllm", release))
    if VLLM_RELEASES.index(release) < VLLM_RELEASES.index(SHOWN_FROM):
        with pytest.raises(dcpsim.ConfigError, match="ChunkedLocalAttentionSpec has no dcp_sharded field"):
            dcpsim.run(FINDING, engine="vllm", vllm_source=source)
        return
    report = dcpsim.run(FINDING, engine="vllm", vllm_source=source)
    assert not report.passed and report.failure.kind == "engine-error" and ASSERTION in report.failure.message, report.text()
    assert dcpsim.run(FINDING, engine="vllm", vllm_source=source, dcp=1).passed
    assert dcpsim.run(FINDING).passed
