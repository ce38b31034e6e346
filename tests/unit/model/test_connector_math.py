"""The connector's block and rank matching between two instance layouts (dcpsim.model.connector)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.errors import ConfigError
from dcpsim.model.connector import (
    InstanceLayout,
    block_matches,
    check_block_matching,
    rank_global_blocks,
    routes_cover,
    token_routes,
)
from dcpsim.model.layout import owner_rank, slot_mapping


def test_cp_rank_is_pcp_rank_times_dcp_plus_dcp_rank():
    layout = InstanceLayout(decode_context_parallel_size=2, prefill_context_parallel_size=2)
    assert [layout.cp_rank(p, d) for p in range(2) for d in range(2)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="pcp_rank"):
        layout.cp_rank(2, 0)


def test_a_rank_owns_every_pcp_times_dcp_th_block():
    """vllm#38433: with pcp = dcp = 2, rank 0 holds blocks 0, 4, 8; striding by dcp alone reads 0, 2, 4."""
    layout = InstanceLayout(decode_context_parallel_size=2, prefill_context_parallel_size=2, cp_kv_cache_interleave_size=16, block_size=16)
    assert rank_global_blocks(layout, 0, 12).tolist() == [0, 4, 8]
    assert rank_global_blocks(layout, 0, 6, stride=2).tolist() == [0, 2, 4]
    assert rank_global_blocks(layout, 3, 12).tolist() == [3, 7, 11]


def test_the_layout_agrees_with_the_dcp_slot_mapping_at_pcp_1():
    """At PCP = 1 the connector's layout is the DCP layout of dcpsim.model.layout."""
    for W, I, B in ((1, 1, 16), (2, 1, 16), (4, 4, 16), (4, 16, 16), (3, 2, 8)):
        layout = InstanceLayout(decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, block_size=B)
        pos = np.arange(500)
        assert (layout.owner(pos) == owner_rank(pos, dcp_size=W, interleave_size=I)).all()
        table = np.arange(1, 500 // (B * W) + 3)
        for r in range(W):
            mine = pos[layout.owner(pos) == r]
            local = layout.local_index(mine)
            slots = slot_mapping(mine, table, block_size=B, dcp_size=W, dcp_rank=r, interleave_size=I)
            assert (slots == table[local // B] * B + local % B).all()


def layouts(block_size=None, interleave_is_block=False):
    def build(w, p, i, b):
        b = block_size or b
        return InstanceLayout(
            decode_context_parallel_size=w,
            prefill_context_parallel_size=p,
            cp_kv_cache_interleave_size=b if interleave_is_block else min(i, b),
            block_size=b,
        )

    return st.builds(
        build, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4, 16]), st.sampled_from([4, 8, 16])
    )


@settings(max_examples=150, deadline=None)
@given(src=layouts(), dst=layouts(), num_tokens=st.integers(1, 400))
def test_resharding_lands_every_position_at_its_decode_owner_and_index(src, dst, num_tokens):
    assert routes_cover(token_routes(num_tokens, src, dst), num_tokens, src, dst)


@settings(max_examples=150, deadline=None)
@given(
    src=layouts(block_size=16, interleave_is_block=True),
    dst=layouts(block_size=16, interleave_is_block=True),
    num_tokens=st.integers(1, 600),
)
def test_nixl_block_matching_lands_every_block_at_its_owner(src, dst, num_tokens):
    if src.cp_size % dst.cp_size and dst.cp_size % src.cp_size:
        return
    check_block_matching(src, dst)
    routes = block_matches(num_tokens, src, dst)
    assert routes_cover(routes, num_tokens, src, dst)
    # whole blocks: one route per decode local block, from one prefill block
    for r in routes:
        assert len(r.dst_local) <= 16 and r.dst_local[0] % 16 == 0 and r.src_local[0] % 16 == 0


def test_striding_by_dcp_alone_breaks_as_soon_as_pcp_is_above_1():
    """pegaflow#428 ("load block mismatch"): the stride-by-dcp matching reads other blocks."""
    src = InstanceLayout(decode_context_parallel_size=2, prefill_context_parallel_size=2, cp_kv_cache_interleave_size=16, block_size=16)
    dst = InstanceLayout(decode_context_parallel_size=4, cp_kv_cache_interleave_size=16, block_size=16)
    good = block_matches(200, src, dst)
    bad = block_matches(200, src, dst, src_stride=src.decode_context_parallel_size)
    assert routes_cover(good, 200, src, dst) and not routes_cover(bad, 200, src, dst)
    # decode rank 2 needs global block 6 (prefill rank 2, its second block: local 16..31); the bug reads its fourth
    pick = lambda routes: next(r for r in routes if r.dst_rank == 2 and r.dst_local[0] == 16)
    assert pick(good).src_rank == 2 and pick(good).src_local[0] == 16
    assert pick(bad).src_local[0] == 32
    same = InstanceLayout(decode_context_parallel_size=2, cp_kv_cache_interleave_size=16, block_size=16)
    assert routes_cover(block_matches(200, same, dst, src_stride=2), 200, same, dst)  # pcp = 1: no difference


def test_a_decode_interleave_the_connector_ignores_misplaces_entries():
    src = InstanceLayout(decode_context_parallel_size=2, cp_kv_cache_interleave_size=1, block_size=16)
    dst = InstanceLayout(decode_context_parallel_size=2, cp_kv_cache_interleave_size=8, block_size=16)
    believed = InstanceLayout(decode_context_parallel_size=2, cp_kv_cache_interleave_size=1, block_size=16)
    assert not routes_cover(token_routes(64, src, dst, dst_as=believed), 64, src, dst)


@pytest.mark.parametrize(
    "src, dst, message",
    [
        (dict(cp_kv_cache_interleave_size=1), dict(), "prefill instance's cp_kv_cache_interleave_size \\(1\\) equal to its block_size"),
        (dict(), dict(block_size=32, cp_kv_cache_interleave_size=32), "equal block_size"),
        (dict(decode_context_parallel_size=3), dict(), "must divide one another"),
    ],
)
def test_block_matching_refuses_what_it_cannot_pair(src, dst, message):
    base = dict(decode_context_parallel_size=2, cp_kv_cache_interleave_size=16, block_size=16)
    with pytest.raises(ConfigError, match=message):
        check_block_matching(InstanceLayout(**{**base, **src}), InstanceLayout(**{**base, "decode_context_parallel_size": 4, **dst}))
