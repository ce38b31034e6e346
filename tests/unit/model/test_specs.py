"""Unit tests of the KV-cache spec rules from the dcp_replicated seed (docs sections 3-4).

Every expected number is computed by hand in a comment next to it, never by
calling the code under test.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from dcpsim.errors import ConfigError
from dcpsim.model.config import SimConfig
from dcpsim.model.grouping import KVCacheGroupSpec, check_groups_for_dcp, group_layer_specs
from dcpsim.model.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    get_block_table_width,
    is_dcp_replicated_spec,
    is_dcp_sharded_spec,
)

# W = 4, max_model_len = 1000, at most 256 tokens of one request in flight per step.
CFG_W4 = SimConfig(max_model_len=1000, max_num_batched_tokens=256, decode_context_parallel_size=4)
CFG_W2 = SimConfig(max_model_len=1000, max_num_batched_tokens=256, decode_context_parallel_size=2)
CFG_W1 = SimConfig(max_model_len=1000, max_num_batched_tokens=256, decode_context_parallel_size=1)


def full(rep=False, **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("num_kv_heads", 8)
    kw.setdefault("head_size", 128)
    return FullAttentionSpec(dcp_replicated=rep, **kw)


def mla(rep=False, **kw):
    kw.setdefault("block_size", 64)
    kw.setdefault("head_size", 576)
    return MLAAttentionSpec(dcp_replicated=rep, **kw)


def swa(rep=False, **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_size", 64)
    kw.setdefault("sliding_window", 128)
    return SlidingWindowSpec(dcp_replicated=rep, **kw)


def swa_mla(rep=False, **kw):
    kw.setdefault("block_size", 64)
    kw.setdefault("head_size", 512)
    kw.setdefault("sliding_window", 128)
    return SlidingWindowMLASpec(dcp_replicated=rep, **kw)


def chunked(rep=False, **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("num_kv_heads", 2)
    kw.setdefault("head_size", 64)
    kw.setdefault("attention_chunk_size", 512)
    return ChunkedLocalAttentionSpec(dcp_replicated=rep, **kw)


def ring(rep=False, **kw):
    kw.setdefault("block_size", 8)
    kw.setdefault("num_kv_heads", 1)
    kw.setdefault("head_size", 512)
    return CircularBufferSpec(dcp_replicated=rep, **kw)


FACTORIES = [full, mla, swa, swa_mla, chunked, ring]
FACTORY_IDS = ["full", "mla", "swa", "swa_mla", "chunked", "ring"]


# --------------------------------------------------------------------------------------
# UniformTypeKVCacheSpecs.is_uniform_type
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", FACTORIES, ids=FACTORY_IDS)
def test_is_uniform_type_refuses_mixed_dcp_replicated(make):
    a = make(rep=True)
    b = make(rep=False, num_kv_heads=4) if make is full else make(rep=False)
    assert UniformTypeKVCacheSpecs.is_uniform_type({"a": a, "b": b}) is False
    assert UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b}) is None
    with pytest.raises(ConfigError, match="dcp_replicated=True.*dcp_replicated=False"):
        UniformTypeKVCacheSpecs(block_size=a.block_size, kv_cache_specs={"a": a, "b": b})
    # same flag on both sides is uniform (for either value)
    for rep in (True, False):
        assert UniformTypeKVCacheSpecs.is_uniform_type({"a": make(rep=rep), "b": make(rep=rep)}) is True


def test_is_uniform_type_same_kind_different_geometry():
    specs = {"a": full(rep=True, num_kv_heads=8), "b": full(rep=True, num_kv_heads=2)}
    assert UniformTypeKVCacheSpecs.is_uniform_type(specs) is True
    group = UniformTypeKVCacheSpecs.from_specs(specs)
    # pages: 8 * 16 * (128 + 128) * 2 = 65536 and 2 * 16 * 512 = 16384 -> sum 81920
    assert group.page_size_bytes == 81920
    # replicated: cdiv(1000, 16) = 63 block-table entries
    assert group.max_num_blocks_per_req(CFG_W4, 1000) == 63
    # memory: 63 * 65536 + 63 * 16384 = 4128768 + 1032192 = 5160960
    assert group.max_memory_usage_bytes(CFG_W4) == 5160960
    # different block sizes or kinds are not uniform
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": full(), "b": full(block_size=32)})
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": full(), "b": swa()})


# --------------------------------------------------------------------------------------
# merge and is_same_kind
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", FACTORIES, ids=FACTORY_IDS)
@pytest.mark.parametrize("rep", [True, False])
def test_merge_keeps_dcp_replicated(make, rep):
    specs = [make(rep=rep), make(rep=rep), make(rep=rep)]
    merged = type(specs[0]).merge(specs)
    assert type(merged) is type(specs[0])
    assert merged.dcp_replicated is rep
    assert merged == specs[0]


@pytest.mark.parametrize("make", FACTORIES, ids=FACTORY_IDS)
def test_merge_refuses_mixed_replicated_and_sharded(make):
    for order in ((True, False), (False, True)):
        specs = [make(rep=order[0]), make(rep=order[1])]
        with pytest.raises(ConfigError, match="different kinds.*dcp_replicated"):
            type(specs[0]).merge(specs)


def test_merge_refuses_other_mismatches():
    with pytest.raises(ConfigError, match="empty"):
        FullAttentionSpec.merge([])
    with pytest.raises(ConfigError, match=r"field num_kv_heads differs \(8 vs 4\)"):
        FullAttentionSpec.merge([full(), full(num_kv_heads=4)])
    with pytest.raises(ConfigError, match="different kinds"):
        FullAttentionSpec.merge([full(), swa()])
    with pytest.raises(ConfigError, match="different kinds"):
        SlidingWindowSpec.merge([swa(), swa(sliding_window=256)])


@pytest.mark.parametrize("make", FACTORIES, ids=FACTORY_IDS)
def test_every_is_same_kind_compares_dcp_replicated(make):
    rep, shard = make(rep=True), make(rep=False)
    assert rep.is_same_kind({"x": make(rep=True)}) is True
    assert shard.is_same_kind({"x": make(rep=False)}) is True
    assert rep.is_same_kind({"x": shard}) is False
    assert shard.is_same_kind({"x": rep}) is False
    # one mismatching member among several is enough to refuse
    assert rep.is_same_kind({"x": make(rep=True), "y": shard}) is False


def test_is_same_kind_other_fields():
    assert not swa().is_same_kind({"x": swa(sliding_window=64)})
    assert not swa().is_same_kind({"x": swa(extra_retained_tokens=4)})
    assert not swa_mla().is_same_kind({"x": swa_mla(sliding_window=64)})
    assert not chunked().is_same_kind({"x": chunked(attention_chunk_size=256)})
    assert not ring().is_same_kind({"x": full()})
    # MLA is full attention, but a different compression ratio is a different kind
    assert full().is_same_kind({"x": mla()})
    assert not mla().is_same_kind({"x": mla(tokens_per_state=4)})


def test_uniform_group_is_same_kind_compares_dcp_replicated():
    g_rep = UniformTypeKVCacheSpecs.from_specs({"a": full(rep=True), "b": full(rep=True, num_kv_heads=2)})
    g_rep2 = UniformTypeKVCacheSpecs.from_specs({"c": full(rep=True), "d": full(rep=True, num_kv_heads=4)})
    g_shard = UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": full(num_kv_heads=2)})
    assert g_rep.is_same_kind({"x": g_rep2})
    assert not g_rep.is_same_kind({"x": g_shard})
    assert not g_shard.is_same_kind({"x": g_rep})


# --------------------------------------------------------------------------------------
# Block-table width and memory
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [full, mla, swa, swa_mla, chunked], ids=FACTORY_IDS[:5])
def test_max_num_blocks_per_req(make):
    spec_rep, spec_shard = make(rep=True), make(rep=False)
    B = spec_rep.block_size
    if B == 16:
        # replicated: cdiv(1000, 16) = 63 (62 * 16 = 992 < 1000)
        assert spec_rep.max_num_blocks_per_req(CFG_W4, 1000) == 63
        # sharded: cdiv(1000, 16 * 4) = cdiv(1000, 64) = 16 (15 * 64 = 960 < 1000)
        assert spec_shard.max_num_blocks_per_req(CFG_W4, 1000) == 16
        # W = 1: both cdiv(1000, 16) = 63
        assert spec_shard.max_num_blocks_per_req(CFG_W1, 1000) == 63
    else:
        assert B == 64
        # replicated: cdiv(1000, 64) = 16
        assert spec_rep.max_num_blocks_per_req(CFG_W4, 1000) == 16
        # sharded: cdiv(1000, 256) = 4 (3 * 256 = 768 < 1000)
        assert spec_shard.max_num_blocks_per_req(CFG_W4, 1000) == 4
        assert spec_shard.max_num_blocks_per_req(CFG_W1, 1000) == 16


def test_max_num_blocks_per_req_w3():
    # W = 3, B = 16, max_len 100: replicated cdiv(100, 16) = 7, sharded cdiv(100, 48) = 3
    cfg = SimConfig(max_model_len=100, decode_context_parallel_size=3)
    assert full(rep=True).max_num_blocks_per_req(cfg, 100) == 7
    assert full(rep=False).max_num_blocks_per_req(cfg, 100) == 3


def test_ring_is_one_block_per_request():
    for rep in (True, False):
        assert ring(rep=rep).max_num_blocks_per_req(CFG_W4, 1000) == 1
        assert ring(rep=rep).max_num_blocks_per_req(CFG_W1, 10**6) == 1
    # memory is one page: 1 head * 8 rows * (512 + 512) * 2 bytes = 16384
    assert ring(rep=True).max_memory_usage_bytes(CFG_W4) == 16384
    assert ring(rep=True).capacity == 8


def test_full_attention_memory_sharded_vs_replicated():
    page = 65536  # 8 heads * 16 tokens * (128 + 128) * 2 bytes
    assert full().page_size_bytes == page
    # sharded W=4: cdiv(cdiv(1000, 4), 16) * page = cdiv(250, 16) * page = 16 * 65536 = 1048576
    assert full(rep=False).max_memory_usage_bytes(CFG_W4) == 1048576
    # replicated W=4: no divide, cdiv(1000, 16) * page = 63 * 65536 = 4128768
    assert full(rep=True).max_memory_usage_bytes(CFG_W4) == 4128768
    # W=1, sharded flag irrelevant: 63 * 65536
    assert full(rep=False).max_memory_usage_bytes(CFG_W1) == 4128768
    # W=3, max_model_len=1001: cdiv(1001, 3) = 334, cdiv(334, 16) = 21 -> 21 * 65536 = 1376256
    cfg3 = SimConfig(max_model_len=1001, decode_context_parallel_size=3)
    assert full().max_memory_usage_bytes(cfg3) == 1376256
    # replicated W=3: cdiv(1001, 16) = 63 -> 4128768
    assert full(rep=True).max_memory_usage_bytes(cfg3) == 4128768


def test_mla_memory_sharded_vs_replicated():
    page = 73728  # 1 latent head * 64 tokens * (576 + 0) * 2 bytes (bfloat16)
    assert mla().page_size_bytes == page
    # sharded W=4: cdiv(1000, 4) = 250, cdiv(250, 64) = 4 -> 4 * 73728 = 294912
    assert mla().max_memory_usage_bytes(CFG_W4) == 294912
    # replicated: cdiv(1000, 64) = 16 -> 16 * 73728 = 1179648
    assert mla(rep=True).max_memory_usage_bytes(CFG_W4) == 1179648


@pytest.mark.parametrize("make", [swa, swa_mla], ids=["swa", "swa_mla"])
def test_sharded_sliding_window_under_dcp_is_an_error(make):
    for cfg in (CFG_W2, CFG_W4):
        with pytest.raises(ConfigError, match="dcp_replicated") as info:
            make(rep=False).max_memory_usage_bytes(cfg)
        assert f"decode_context_parallel_size={cfg.decode_context_parallel_size}" in str(info.value)


def test_sliding_window_memory():
    page = 8192  # 2 heads * 16 tokens * (64 + 64) * 2 bytes
    assert swa().page_size_bytes == page
    # tokens = min(128 - 1 + 0 + 256, 1000) = 383; cdiv(383, 16) = 24; + 1 = 25 blocks
    assert swa().max_admission_blocks_per_request(max_in_flight_tokens=256, max_model_len=1000) == 25
    # W = 1, not replicated: works, 25 * 8192 = 204800
    assert swa(rep=False).max_memory_usage_bytes(CFG_W1) == 204800
    # replicated under W = 4: same bound, no divide: 204800
    assert swa(rep=True).max_memory_usage_bytes(CFG_W4) == 204800
    # extra_retained_tokens=10: min(127 + 10 + 256, 1000) = 393; cdiv(393, 16) = 25; + 1 = 26 -> 212992
    assert swa(rep=True, extra_retained_tokens=10).max_memory_usage_bytes(CFG_W4) == 26 * 8192 == 212992
    # capped by max_model_len = 100: cdiv(100, 16) = 7; + 1 = 8 -> 65536
    cfg = SimConfig(max_model_len=100, max_num_batched_tokens=256)
    assert swa().max_memory_usage_bytes(cfg) == 65536
    # first needed position after 300 tokens: 300 - 128 + 1 = 173 (and 163 with 10 extra)
    assert swa().first_needed_position(300) == 173
    assert swa(extra_retained_tokens=10).first_needed_position(300) == 163
    assert swa().first_needed_position(5) == 0


def test_sliding_window_mla_memory():
    page = 65536  # 1 head * 64 tokens * (512 + 0) * 2 bytes
    assert swa_mla().page_size_bytes == page
    # min(127 + 256, 1000) = 383; cdiv(383, 64) = 6; + 1 = 7 -> 7 * 65536 = 458752
    assert swa_mla(rep=True).max_memory_usage_bytes(CFG_W4) == 458752


def test_chunked_local_memory():
    page = 8192  # 2 heads * 16 * (64 + 64) * 2
    # min(512 + 256, 1000) = 768; cdiv(768, 16) = 48 -> 48 * 8192 = 393216
    assert chunked().max_memory_usage_bytes(CFG_W1) == 393216
    assert chunked(rep=True).max_memory_usage_bytes(CFG_W4) == 393216
    assert chunked().page_size_bytes == page
    # chunk of 512, 1300 committed -> positions < 1024 released
    assert chunked().first_needed_position(1300) == 1024


# --------------------------------------------------------------------------------------
# is_dcp_replicated_spec / is_dcp_sharded_spec
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,replicated,sharded",
    [
        (full(rep=False), False, True),
        (full(rep=True), True, False),
        (mla(rep=False), False, True),
        (mla(rep=True), True, False),
        (swa(rep=True), True, False),
        (swa(rep=False), False, False),  # neither: a non-replicated sliding window
        (swa_mla(rep=True), True, False),
        (swa_mla(rep=False), False, False),
        (chunked(rep=False), False, False),
        (chunked(rep=True), True, False),
        (ring(rep=True), True, False),
        (ring(rep=False), False, False),
        (KVCacheSpec(block_size=16), False, False),  # not an attention spec
    ],
)
def test_is_dcp_replicated_and_sharded_on_layer_specs(spec, replicated, sharded):
    assert is_dcp_replicated_spec(spec) is replicated
    assert is_dcp_sharded_spec(spec) is sharded


def test_is_dcp_replicated_and_sharded_on_groups():
    g_rep = UniformTypeKVCacheSpecs.from_specs({"a": full(rep=True), "b": full(rep=True, num_kv_heads=2)})
    assert is_dcp_replicated_spec(g_rep) and not is_dcp_sharded_spec(g_rep)
    g_shard = UniformTypeKVCacheSpecs.from_specs({"a": mla(), "b": mla(head_size=512)})
    assert is_dcp_sharded_spec(g_shard) and not is_dcp_replicated_spec(g_shard)
    g_swa_rep = UniformTypeKVCacheSpecs.from_specs({"a": swa(rep=True), "b": swa(rep=True, num_kv_heads=4)})
    assert is_dcp_replicated_spec(g_swa_rep) and not is_dcp_sharded_spec(g_swa_rep)
    g_neither = UniformTypeKVCacheSpecs.from_specs({"a": swa(), "b": swa(num_kv_heads=4)})
    assert not is_dcp_replicated_spec(g_neither)
    assert not is_dcp_sharded_spec(g_neither)


def _unchecked_group(layers: dict) -> UniformTypeKVCacheSpecs:
    """A group object that skips the uniform-type check, to probe the 'every layer' rule."""
    g = object.__new__(UniformTypeKVCacheSpecs)
    object.__setattr__(g, "block_size", 16)
    object.__setattr__(g, "kv_cache_specs", layers)
    return g


def test_is_dcp_replicated_and_sharded_look_at_every_layer():
    # replicated first, sharded second: neither predicate may judge by the first layer alone
    mixed = _unchecked_group({"a": full(rep=True), "b": full(rep=False)})
    assert not is_dcp_replicated_spec(mixed)
    assert not is_dcp_sharded_spec(mixed)
    mixed2 = _unchecked_group({"a": full(rep=False), "b": swa(rep=False)})
    assert not is_dcp_sharded_spec(mixed2)
    # a layer that is not an attention spec at all
    assert not is_dcp_replicated_spec(_unchecked_group({"a": swa(rep=True), "b": KVCacheSpec(block_size=16)}))
    # an empty group is neither
    assert not is_dcp_replicated_spec(_unchecked_group({}))
    assert not is_dcp_sharded_spec(_unchecked_group({}))


# --------------------------------------------------------------------------------------
# Page sizes
# --------------------------------------------------------------------------------------


def test_page_size_plain_and_head_size_v_default():
    s = full()
    assert s.head_size_v == 128
    # 8 * 16 * (128 + 128) * 2 = 65536
    assert s.page_size_bytes == s.real_page_size_bytes == 65536
    # explicit head_size_v=64, float32: 8 * 16 * (128 + 64) * 4 = 98304
    assert full(head_size_v=64, dtype="float32").page_size_bytes == 98304
    # fp8: 8 * 16 * 256 * 1 = 32768
    assert full(dtype="fp8").page_size_bytes == 32768


def test_mla_head_size_v_is_zero_single_head():
    s = mla()
    assert s.head_size_v == 0
    assert s.num_kv_heads == 1
    # 1 * 64 * (576 + 0) * 2 = 73728
    assert s.page_size_bytes == 73728
    w = swa_mla()
    assert w.head_size_v == 0 and w.num_kv_heads == 1
    assert mla(cache_dtype_str="fp8_ds_mla").cache_dtype_str == "fp8_ds_mla"


def test_page_size_integer_tokens_per_state():
    s = mla(tokens_per_state=4)  # B = 64, N = 64 / 4 = 16 records per page
    assert s.states_per_block == 16
    # 1 * 16 * 576 * 2 = 18432
    assert s.page_size_bytes == 18432
    # tokens_per_state = 2 on B = 16 full attention: N = 8 -> 8 * 8 * 256 * 2 = 32768
    assert full(tokens_per_state=2).page_size_bytes == 32768


def test_page_size_fraction_tokens_per_state():
    s = full(tokens_per_state=Fraction(1, 4))  # B = 16, N = 16 * 4 = 64 states per page
    assert s.states_per_block == 64
    # 8 * 64 * 256 * 2 = 262144
    assert s.page_size_bytes == 262144
    # Fraction(2, 1) is normalised to int 2
    assert full(tokens_per_state=Fraction(2, 1)).tokens_per_state == 2
    assert isinstance(full(tokens_per_state=Fraction(2, 1)).tokens_per_state, int)


def test_page_size_num_head_slots_and_state_content_bytes():
    # num_head_slots replaces num_kv_heads: 4 * 64 * 576 * 2 = 294912
    assert mla(num_head_slots=4).page_size_bytes == 294912
    # state_content_bytes replaces (head_size + head_size_v) * dtype: 1 * (64 / 4) * 656 = 10496
    s = mla(tokens_per_state=4, state_content_bytes=656, dtype="fp8")
    assert s.page_size_bytes == 10496
    # both: 2 * 16 * 656 = 20992
    assert mla(tokens_per_state=4, state_content_bytes=656, num_head_slots=2).page_size_bytes == 20992


def test_page_size_padded():
    s = mla(tokens_per_state=4, state_content_bytes=656, page_size_padded=16384)
    assert s.real_page_size_bytes == 10496
    assert s.page_size_bytes == 16384
    # equal to the real size is allowed
    assert mla(tokens_per_state=4, state_content_bytes=656, page_size_padded=10496).page_size_bytes == 10496
    # memory uses the padded page: replicated, cdiv(1000, 64) = 16 pages -> 16 * 16384 = 262144
    assert mla(rep=True, tokens_per_state=4, state_content_bytes=656, page_size_padded=16384).max_memory_usage_bytes(CFG_W4) == 262144
    with pytest.raises(ConfigError, match=r"page_size_padded \(10000\).*real page size \(10496\)"):
        mla(tokens_per_state=4, state_content_bytes=656, page_size_padded=10000)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(block_size=0), r"block_size.*got 0"),
        (dict(num_kv_heads=0), r"num_kv_heads.*got 0"),
        (dict(head_size=-1), r"head_size.*got -1"),
        (dict(dtype="float7"), r"dtype 'float7'"),
        (dict(rep=1), r"dcp_replicated must be true or false, got 1"),
        (dict(tokens_per_state=3), r"block_size \(16\).*tokens_per_state=3"),
        (dict(tokens_per_state=0), r"tokens_per_state.*got 0"),
        (dict(num_head_slots=0), r"num_head_slots.*got 0"),
    ],
)
def test_invalid_spec_fields(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        full(**kwargs)


# --------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------


def test_group_layer_specs_never_mixes_replicated_and_sharded():
    layers = {
        "l0.attn": full(rep=False),
        "l1.attn": full(rep=True),
        "l2.attn": full(rep=False),
        "l3.attn": full(rep=True),
        "l0.swa": swa(rep=True),
        "l1.swa": swa(rep=False),
        "l0.ring": ring(rep=True),
        "l1.ring": ring(rep=False),
    }
    groups = group_layer_specs(layers)
    by_layers = {g.layer_names: g for g in groups}
    assert set(by_layers) == {
        ("l0.attn", "l2.attn"),
        ("l1.attn", "l3.attn"),
        ("l0.swa",),
        ("l1.swa",),
        ("l0.ring",),
        ("l1.ring",),
    }
    for g in groups:
        flags = {layers[n].dcp_replicated for n in g.layer_names}
        assert len(flags) == 1
        assert g.kv_cache_spec.dcp_replicated in flags
    assert by_layers[("l0.attn", "l2.attn")].sharded and not by_layers[("l0.attn", "l2.attn")].replicated
    assert by_layers[("l1.attn", "l3.attn")].replicated and not by_layers[("l1.attn", "l3.attn")].sharded
    assert by_layers[("l1.swa",)].replicated is False and by_layers[("l1.swa",)].sharded is False


def test_group_identical_specs_get_the_merged_spec():
    layers = {"a": mla(rep=True), "b": mla(rep=True), "c": mla(rep=True)}
    (g,) = group_layer_specs(layers)
    assert g.layer_names == ("a", "b", "c")
    assert type(g.kv_cache_spec) is MLAAttentionSpec
    assert g.kv_cache_spec == mla(rep=True)
    assert g.kv_cache_spec.dcp_replicated is True
    assert g.name == "MLAAttention[a+2]"


def test_group_differing_geometry_gets_uniform_type_specs():
    layers = {"a": full(num_kv_heads=8), "b": full(num_kv_heads=2), "c": full(num_kv_heads=8)}
    (g,) = group_layer_specs(layers)
    assert isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert set(g.kv_cache_spec.kv_cache_specs) == {"a", "b", "c"}
    # 65536 + 16384 + 65536 = 147456
    assert g.kv_cache_spec.page_size_bytes == 147456
    assert g.sharded and not g.replicated


def test_group_keys_split_block_size_type_and_compression():
    layers = {
        "full16": full(),
        "full32": full(block_size=32),
        "mla": mla(),
        "mla_c4": mla(tokens_per_state=4),
        "swa128": swa(rep=True),
        "swa256": swa(rep=True, sliding_window=256),
    }
    groups = group_layer_specs(layers)
    assert [g.layer_names for g in groups] == [(n,) for n in layers]


def test_group_layer_specs_rejects_bad_input():
    with pytest.raises(ConfigError, match="at least one layer"):
        group_layer_specs({})
    u = UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": full(num_kv_heads=2)})
    with pytest.raises(ConfigError, match="not a UniformTypeKVCacheSpecs"):
        group_layer_specs({"u": u})


def test_check_groups_for_dcp():
    # replicated sliding window + sharded full attention: fine under W = 4
    check_groups_for_dcp(group_layer_specs({"attn": full(), "swa": swa(rep=True), "ring": ring(rep=True)}), CFG_W4)
    # non-replicated sliding window under W = 2: the memory bound refuses it, naming the group
    with pytest.raises(ConfigError, match=r"group SlidingWindow\[swa\].*dcp_replicated"):
        check_groups_for_dcp(group_layer_specs({"attn": full(), "swa": swa()}), CFG_W2)
    # W = 1: the same layers are fine
    check_groups_for_dcp(group_layer_specs({"attn": full(), "swa": swa()}), CFG_W1)
    # a non-replicated non-full group (chunked local, ring) under W > 1 is refused
    with pytest.raises(ConfigError, match=r"ChunkedLocalAttention\[loc\].*only full attention.*dcp_replicated"):
        check_groups_for_dcp(group_layer_specs({"loc": chunked()}), CFG_W2)
    with pytest.raises(ConfigError, match=r"CircularBuffer\[ring\].*decode_context_parallel_size=4"):
        check_groups_for_dcp(group_layer_specs({"ring": ring()}), CFG_W4)
    # replicated, they pass
    check_groups_for_dcp(group_layer_specs({"loc": chunked(rep=True), "ring": ring(rep=True)}), CFG_W4)
    # a group that is not an attention spec is not simulated
    with pytest.raises(ConfigError, match="KVCacheSpec is not simulated"):
        check_groups_for_dcp([KVCacheGroupSpec(("x",), KVCacheSpec(block_size=16))], CFG_W1)


# --------------------------------------------------------------------------------------
# UniformTypeKVCacheSpecs under vLLM 0.33.0's rules
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OddMemorySpec(FullAttentionSpec):
    """A layer whose worst case is not a whole number of pages (one byte over)."""

    extra_pages: int = 0

    def max_memory_usage_bytes(self, config):
        return (10 + self.extra_pages) * self.page_size_bytes + 1


def test_uniform_memory_is_the_most_pages_any_layer_needs_times_the_group_page():
    a = _OddMemorySpec(block_size=16, num_kv_heads=8, head_size=128)  # page 65536: cdiv -> 11 pages
    b = _OddMemorySpec(block_size=16, num_kv_heads=2, head_size=128, extra_pages=3)  # page 16384: 14 pages
    group = UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b})
    assert group.page_size_bytes == 65536 + 16384
    # max(11, 14) * 81920; the old sum(mem_i) would give 11 * 65536 + 14 * 16384 + 2
    assert group.max_memory_usage_bytes(CFG_W4) == 14 * 81920


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WidthSpec(FullAttentionSpec):
    width: int = 4

    def max_num_blocks_per_req(self, config, max_len):
        return self.width


def test_uniform_layers_must_need_one_block_table_width():
    same = UniformTypeKVCacheSpecs.from_specs(
        {"a": _WidthSpec(block_size=16, num_kv_heads=1, head_size=64), "b": _WidthSpec(block_size=16, num_kv_heads=2, head_size=64)}
    )
    assert same.max_num_blocks_per_req(CFG_W4, 1000) == 4
    mixed = UniformTypeKVCacheSpecs.from_specs(
        {
            "a": _WidthSpec(block_size=16, num_kv_heads=1, head_size=64),
            "b": _WidthSpec(block_size=16, num_kv_heads=1, head_size=64, width=8),
        }
    )
    with pytest.raises(ConfigError, match=r"different block-table widths \[4, 8\]"):
        mixed.max_num_blocks_per_req(CFG_W4, 1000)


@pytest.mark.parametrize(
    "n, B, align, want",
    [
        (63, 16, 128, 64),  # 128 tokens = 8 entries of 16: 63 -> 64
        (8192, 64, 128, 8192),  # already a multiple of 2 entries
        (5, 64, 128, 6),
        (5, 256, 128, 5),  # an entry spans more than 128 tokens: no rounding
        (5, 48, 128, 8),  # 128 / gcd(128, 48) = 8 entries
        (5, 16, None, 5),  # rings and state caches: never widened
    ],
)
def test_get_block_table_width(n, B, align, want):
    assert get_block_table_width(n, B, token_alignment=align) == want


def test_block_table_width_is_aligned_for_attention_not_for_rings():
    cfg = SimConfig(max_model_len=1000, max_num_batched_tokens=256, decode_context_parallel_size=4)
    assert full().max_num_blocks_per_req(cfg, 1000) == 16  # cdiv(1000, 16 * 4)
    assert full().block_table_width(cfg, 1000) == 16  # a multiple of 8 entries (128 tokens) already
    assert full(rep=True).block_table_width(cfg, 1000) == 64  # 63 -> 64
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=64, dcp_replicated=True)
    assert ring.block_table_width(cfg, 1000) == 1


def test_async_scheduling_doubles_the_in_flight_tokens_of_window_caps():
    sync = SimConfig(max_model_len=8192, max_num_batched_tokens=256)
    both = SimConfig(max_model_len=8192, max_num_batched_tokens=256, async_scheduling=True)
    assert (sync.max_in_flight_tokens, both.max_in_flight_tokens) == (256, 512)
    w = swa(rep=True, sliding_window=128)
    # cdiv(127 + in-flight, 16) + 1 pages
    assert w.max_memory_usage_bytes(sync) == (cdiv(127 + 256, 16) + 1) * w.page_size_bytes
    assert w.max_memory_usage_bytes(both) == (cdiv(127 + 512, 16) + 1) * w.page_size_bytes
    with pytest.raises(ConfigError, match="async_scheduling must be true or false"):
        SimConfig(async_scheduling=1)


def test_alignment_pads_mla_pages_as_deepseek_v4_does():
    # 64 states x 584 B = 37,376 B -> the next multiple of 576 is 37,440
    main = MLAAttentionSpec(block_size=128, tokens_per_state=2, head_size=512, dtype="fp8_ds_mla", state_content_bytes=584, alignment=576)
    assert (main.real_page_size_bytes, main.page_size_bytes) == (37376, 37440)
    swa_ = SlidingWindowMLASpec(block_size=64, head_size=512, dtype="bfloat16", sliding_window=128, alignment=512)
    assert swa_.real_page_size_bytes == 64 * 1024 and swa_.page_size_padded is None  # already aligned
    # the padded page is derived: a spec rebuilt with another block size gets its own
    half = dataclasses.replace(main, block_size=64)
    assert (half.real_page_size_bytes, half.page_size_bytes) == (18688, 19008)  # 32 x 584 -> 33 x 576
    with pytest.raises(ConfigError, match="alignment"):
        MLAAttentionSpec(block_size=64, head_size=512, alignment=0)
