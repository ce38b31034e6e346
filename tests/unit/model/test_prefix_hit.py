"""``dcpsim.model.prefix_hit``: hashes per GCD block, hits in whole LCM units (upstream 0.33.0),
against brute force: a hit is the longest prefix every group holds, cut to a whole unit."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from dcpsim.model.prefix_hit import (
    block_key_hash_block,
    blocks_in_hit,
    hash_block_tokens,
    hit_alignment,
    longest_prefix_hit,
)

spans_st = st.lists(st.sampled_from([16, 32, 48, 64, 128, 256, 512]), min_size=1, max_size=4)


def brute_force_hit(cached, tokens, align, limit):
    best = 0
    for n in range(0, max(0, limit) + 1):
        if n % align == 0 and all(n <= c * t for c, t in zip(cached, tokens)):
            best = n
    return best


@given(spans=spans_st, data=st.data())
def test_hit_is_the_longest_whole_unit_every_group_holds(spans, data):
    align = hit_alignment(spans)
    cached = [data.draw(st.integers(0, 2 * align // s + 3)) for s in spans]
    limit = data.draw(st.integers(-1, 3 * align))
    hit = longest_prefix_hit(cached, spans, align, limit)
    assert hit == brute_force_hit(cached, spans, align, limit)
    assert hit % align == 0 and 0 <= hit <= max(0, limit)
    # whole blocks of every group, none of them past what the group has cached
    for c, s in zip(cached, spans):
        assert blocks_in_hit(hit, s) * s == hit and blocks_in_hit(hit, s) <= c


@given(spans=spans_st)
def test_hash_block_divides_every_span_and_the_unit_is_their_lcm(spans):
    g, u = hash_block_tokens(spans), hit_alignment(spans)
    assert all(s % g == 0 and u % s == 0 for s in spans)
    assert g == math.gcd(*spans) and u == math.lcm(*spans)


@given(spans=spans_st, block=st.integers(0, 40))
def test_a_block_is_found_by_the_hash_block_ending_where_it_ends(spans, block):
    g = hash_block_tokens(spans)
    for s in spans:
        h = block_key_hash_block(s, g, block)
        assert (h + 1) * g == (block + 1) * s  # the key's prefix ends at the block's last token


def test_worked_example_compressed_beside_plain():
    # W = 2: MLA pages of 16 tokens (span 32), C4 pages of 64 tokens = 16 records (span 128)
    spans = [32, 128]
    assert hash_block_tokens(spans) == 32 and hit_alignment(spans) == 128
    # a 300-token common prefix: 9 plain blocks and 2 compressed ones are cached
    assert longest_prefix_hit([9, 2], spans, 128, 299) == 256
    # crediting a compressed block with 16 records * W = 32 tokens (R forgotten), aligned to 32:
    # the hit stops at 64, inside the first compressed block, which the group cannot reuse
    assert longest_prefix_hit([9, 2], [32, 32], 32, 299) == 64
    assert blocks_in_hit(64, 128) == 0
