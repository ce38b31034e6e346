"""The MLA spec's rope part (``qk_rope_head_dim``): DeepSeek's 64 by default, 0 for an entry
without one (the built-in ``mla-norope``), never negative."""

from __future__ import annotations

import pytest

from dcpsim.errors import ConfigError
from dcpsim.model.specs import MLAAttentionSpec
from dcpsim.scenarios.load import load_scenario


def test_the_rope_part_defaults_to_deepseeks_and_mla_norope_has_none():
    assert MLAAttentionSpec(block_size=64, head_size=576, dtype="bfloat16").qk_rope_head_dim == 64
    specs = load_scenario("mla-norope").layers.values()
    assert specs and all(isinstance(s, MLAAttentionSpec) and s.qk_rope_head_dim == 0 for s in specs)
    assert all(s.qk_rope_head_dim == 64 for s in load_scenario("dsv3").layers.values())


def test_a_negative_rope_part_is_refused():
    with pytest.raises(ConfigError, match="qk_rope_head_dim must be an integer >= 0"):
        MLAAttentionSpec(block_size=64, head_size=576, dtype="bfloat16", qk_rope_head_dim=-1)
