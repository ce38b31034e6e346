"""``MambaSpec``: the page of a recurrent state, block-table widths and memory in both cache
modes (never scaled by W), the grouping rule, the replicated predicates, bad fields, and the
state write math of ``dcpsim.model.layout``.

Every expected number is computed by hand in a comment next to it.
"""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.errors import ConfigError
from dcpsim.model.config import SimConfig
from dcpsim.model.grouping import check_groups_for_dcp, group_layer_specs
from dcpsim.model.kinds import Retention, Storage, retention_of, storage_of
from dcpsim.model.layout import state_slot_mapping, state_writes
from dcpsim.model.specs import (
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    is_dcp_replicated_spec,
    is_dcp_sharded_spec,
)

# Qwen3-Next Gated DeltaNet at TP 1 with 2 speculative tokens: conv [5, 8192], SSM [32, 128, 128], bf16.
GDN_SHAPES = ((5, 8192), (32, 128, 128))
GDN_BYTES = 5 * 8192 * 2 + 32 * 128 * 128 * 2  # 81,920 + 1,048,576 = 1,130,496


def gdn(mode="none", B=8192, k=2, **kw):
    return MambaSpec(
        block_size=B,
        shapes=GDN_SHAPES,
        dtypes=("bfloat16", "bfloat16"),
        mamba_cache_mode=mode,
        num_speculative_blocks=k,
        mamba_type="gdn_attn",
        **kw,
    )


def cfg(W=2, k=2, max_model_len=8192):
    return SimConfig(max_model_len=max_model_len, max_num_batched_tokens=512, decode_context_parallel_size=W, num_speculative_tokens=k)


def test_page_is_the_state_bytes_or_the_padded_page():
    assert GDN_BYTES == 1_130_496
    assert gdn().real_page_size_bytes == gdn().page_size_bytes == 1_130_496
    # vLLM pads the state page to the 560-token attention page: 560 * 2 heads * 512 * 2 bytes
    assert gdn(page_size_padded=1_146_880).page_size_bytes == 1_146_880
    # mixed dtypes: a float32 SSM state doubles its part: 81,920 + 2 * 1,048,576
    mixed = MambaSpec(block_size=16, shapes=GDN_SHAPES, dtypes=("bfloat16", "float32"))
    assert mixed.page_size_bytes == 81_920 + 2_097_152


@pytest.mark.parametrize("W", [1, 2, 4, 8])
def test_none_mode_width_and_memory_are_one_plus_k_pages_at_any_W(W):
    spec = gdn()
    assert spec.max_num_blocks_per_req(cfg(W), 8192) == 3  # 1 running state + 2 speculative
    assert spec.max_memory_usage_bytes(cfg(W)) == 3 * 1_130_496
    no_spec = gdn(k=0)
    assert no_spec.max_num_blocks_per_req(cfg(W, k=0), 8192) == 1
    assert no_spec.max_memory_usage_bytes(cfg(W, k=0)) == 1_130_496


@pytest.mark.parametrize("W", [1, 2, 4])
def test_align_mode_width_covers_the_sequence_never_divided_by_W(W):
    spec = gdn("align", B=560)
    # cdiv(8192, 560) = 15 position-indexed entries + 2 speculative; a sharded group would have cdiv(8192, 560*W)
    assert spec.max_num_blocks_per_req(cfg(W), 8192) == 17
    # resident: the state read (previous step), the new one, 2 drafts
    assert spec.max_memory_usage_bytes(cfg(W)) == 4 * 1_130_496
    # no 128-token block-table alignment: 16-token blocks, max_len 1000 -> cdiv(1000, 16) + 2 = 63 + 2
    assert gdn("align", B=16).max_num_blocks_per_req(cfg(W), 1000) == 65


def test_a_state_is_replicated_never_sharded():
    spec = gdn()
    assert spec.dcp_replicated
    assert is_dcp_replicated_spec(spec) and not is_dcp_sharded_spec(spec)
    assert storage_of(spec) is Storage.STATE and retention_of(spec) is Retention.STATE


def test_mamba_layers_form_their_own_groups():
    att = FullAttentionSpec(block_size=560, num_kv_heads=2, head_size=256)
    swa = SlidingWindowSpec(block_size=560, num_kv_heads=2, head_size=256, sliding_window=128, dcp_replicated=True)
    other = MambaSpec(block_size=8192, shapes=((3, 4096), (16, 128, 128)), dtypes=("bfloat16", "bfloat16"), num_speculative_blocks=2)
    layers = {"l0.attn": att, "l1.gdn": gdn(), "l2.swa": swa, "l3.gdn": gdn(), "l4.mamba": other, "l5.attn": att}
    groups = group_layer_specs(layers)
    by_layers = {g.layer_names: g for g in groups}
    assert set(by_layers) == {("l0.attn", "l5.attn"), ("l1.gdn", "l3.gdn"), ("l2.swa",), ("l4.mamba",)}
    gdn_group = by_layers[("l1.gdn", "l3.gdn")]
    assert gdn_group.kv_cache_spec == gdn() and gdn_group.replicated and not gdn_group.sharded
    for g in groups:  # never attention and state in one group
        assert len({isinstance(layers[n], MambaSpec) for n in g.layer_names}) == 1
    # a group check at W = 4 accepts the state group (replicated) next to sharded attention
    check_groups_for_dcp(groups, cfg(4))
    # uniform-type specs refuse a state mixed with attention
    assert UniformTypeKVCacheSpecs.from_specs({"a": att, "b": gdn()}) is None


def test_same_kind_compares_block_size_mode_and_speculative_blocks():
    assert gdn().is_same_kind({"x": gdn(), "y": gdn(page_size_padded=2_000_000)})
    assert not gdn().is_same_kind({"x": gdn(k=1)})
    assert not gdn().is_same_kind({"x": gdn("align", B=8192)})
    assert not gdn().is_same_kind({"x": FullAttentionSpec(block_size=8192, num_kv_heads=1, head_size=8)})


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(shapes=()), r"MambaSpec\.shapes must be a non-empty list"),
        (dict(shapes=((5, 0),)), r"MambaSpec\.shapes must be"),
        (dict(shapes=((5, 8192),), dtypes=("bfloat16", "bfloat16")), r"MambaSpec\.dtypes must list one dtype per state shape \(1\)"),
        (dict(dtypes=("bfloat16", "float99")), r"MambaSpec\.dtypes entry 'float99' is not known"),
        (dict(mamba_cache_mode="all"), r"MambaSpec\.mamba_cache_mode must be one of \['none', 'align'\]"),
        (dict(mamba_type="s4"), r"MambaSpec\.mamba_type must be one of"),
        (dict(num_speculative_blocks=-1), r"MambaSpec\.num_speculative_blocks must be an integer >= 0"),
        (dict(page_size_padded=1000), r"MambaSpec\.page_size_padded \(1000\) must be >= the real page size \(1130496\)"),
        (dict(block_size=0), r"MambaSpec\.block_size must be an integer >= 1"),
    ],
)
def test_invalid_fields_name_the_field(kwargs, pattern):
    values = dict(block_size=8192, shapes=GDN_SHAPES, dtypes=("bfloat16", "bfloat16"))
    values.update(kwargs)
    with pytest.raises(ConfigError, match=pattern):
        MambaSpec(**values)


def test_shapes_from_toml_lists_become_hashable_tuples():
    spec = MambaSpec(block_size=16, shapes=[[5, 8192], [32, 128, 128]], dtypes=["bfloat16", "bfloat16"])
    assert spec.shapes == GDN_SHAPES and spec.dtypes == ("bfloat16", "bfloat16")
    assert hash(spec) == hash(MambaSpec(block_size=16, shapes=GDN_SHAPES, dtypes=("bfloat16", "bfloat16")))


def test_what_the_config_fixes_of_a_state():
    with pytest.raises(ConfigError, match=r"block_size \(4096\) must be >= max_model_len \(8192\) in mamba_cache_mode 'none'"):
        gdn(B=4096).check_config(cfg())
    gdn("align", B=16).check_config(cfg())  # align: any block size
    with pytest.raises(ConfigError, match=r"num_speculative_blocks \(2\) must equal num_speculative_tokens \(3\)"):
        gdn().check_config(cfg(k=3))
    # through the group check, naming the group
    with pytest.raises(ConfigError, match=r"group Mamba\[l0\] \(layers l0\): MambaSpec\.block_size"):
        check_groups_for_dcp(group_layer_specs({"l0": gdn(B=4096)}), cfg())


# ----------------------------------------------------------------------------- the state writes


def test_a_prefill_chunk_writes_one_state_after_its_last_token():
    # none mode: positions [0, 512) -> the state after 511, in column 0
    pos, col = state_writes(0, 512, 0, block_size=8192)
    assert pos.tolist() == [511] and col.tolist() == [0]
    # align mode, B = 16: the chunk [512, 1024) ends in block 1023 // 16 = 63
    pos, col = state_writes(512, 1024, 0, block_size=16, align=True)
    assert pos.tolist() == [1023] and col.tolist() == [63]


def test_a_decode_step_writes_one_state_per_token():
    # one true token at 700 and 2 drafts: states after 700, 701, 702 in columns 0, 1, 2
    pos, col = state_writes(700, 703, 2, block_size=8192)
    assert pos.tolist() == [700, 701, 702] and col.tolist() == [0, 1, 2]
    # align, B = 16: the step's last token 702 is in block 702 // 16 = 43 -> columns 43, 44, 45
    pos, col = state_writes(700, 703, 2, block_size=16, align=True)
    assert col.tolist() == [43, 44, 45]
    # a plain decode (no drafts) is one state in the first column
    assert state_writes(5, 6, 0, block_size=8192)[1].tolist() == [0]


def test_state_slots_are_the_block_ids_and_the_null_block_past_the_row():
    row = np.array([7, 3, 9])
    np.testing.assert_array_equal(state_slot_mapping([0, 1, 2], row), [7, 3, 9])
    np.testing.assert_array_equal(state_slot_mapping([2, 3, 5], row), [9, 0, 0])
    np.testing.assert_array_equal(state_slot_mapping([0], np.zeros(0, np.int64)), [0])
