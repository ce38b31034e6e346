"""The hybrid KV cache manager rule as ``dcpsim.engine.vllm.hybrid_layout`` reads it from a tree's
``VllmConfig.__post_init__`` (``ast`` only: a stand-in ``vllm/config/vllm.py`` is enough)."""

from __future__ import annotations

from dcpsim.engine.vllm.hybrid_layout import ENV, FLAG, Layout, has_chunk, manager_on, read_rule
from dcpsim.model.specs import ChunkedLocalAttentionSpec, FullAttentionSpec

CONFIG = """
class VllmConfig:
    def __post_init__(self):
        need_disable_hybrid_kv_cache_manager = False
        if (
            self.model_config is not None
            and self.model_config.attention_chunk_size is not None
        ):
            if (
                self.speculative_config is not None
                and self.speculative_config.use_eagle()
            ):
                need_disable_hybrid_kv_cache_manager = True
            elif not envs.VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE:
                need_disable_hybrid_kv_cache_manager = True
"""


def _tree(tmp_path, text: str) -> str:
    (tmp_path / "vllm" / "config").mkdir(parents=True)
    (tmp_path / "vllm" / "config" / "vllm.py").write_text(text, encoding="utf-8")
    return str(tmp_path)


def test_the_rule_is_read_with_its_lines(tmp_path):
    rule = read_rule(_tree(tmp_path, CONFIG))
    assert (rule.first, rule.last) == (5, 15)
    assert rule.drafter == "self.speculative_config is not None and self.speculative_config.use_eagle()"
    assert (rule.drafter_line, rule.env_line) == (9, 14)
    assert rule.where() == "vllm/config/vllm.py:5-15"


def test_a_tree_without_the_rule_keeps_the_manager(tmp_path):
    rule = read_rule(_tree(tmp_path, "class VllmConfig:\n    def __post_init__(self):\n        pass\n"))
    assert rule is None
    on, why = manager_on(rule, "9.9", chunk=True, eagle=False, allow=False)
    assert on and "has no rule for chunked local attention" in why


def test_vllms_decisions_per_model(tmp_path):
    rule = read_rule(_tree(tmp_path, CONFIG))
    assert manager_on(rule, "0.33.0", chunk=False, eagle=True, allow=False) == (True, "on (the model has no attention_chunk_size)")
    on, why = manager_on(rule, "0.33.0", chunk=True, eagle=False, allow=False)
    assert not on and f"unless {ENV}=1 (vllm/config/vllm.py:14; {FLAG} sets it)" in why
    on, why = manager_on(rule, "0.33.0", chunk=True, eagle=False, allow=True)
    assert on and ENV in why
    on, why = manager_on(rule, "0.33.0", chunk=True, eagle=True, allow=True)  # the drafter wins over the switch
    assert not on and "vllm/config/vllm.py:9: if self.speculative_config" in why


def test_a_chunk_makes_the_model_chunked_and_the_layout_says_it():
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16)
    chunk = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, attention_chunk_size=64, dcp_replicated=True)
    assert has_chunk({"a": full, "b": chunk}) and not has_chunk({"a": full})
    assert "promotes no layer" in Layout(False, "off for chunked local attention").describe()
    text = Layout(False, "off", ("b",), "FullAttentionSpec(block_size=16)").describe()
    assert text.endswith("stores the layers b as FullAttentionSpec(block_size=16)")
