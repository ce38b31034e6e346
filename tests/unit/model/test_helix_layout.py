"""The engine's Helix layout math (``dcpsim.model.helix``) against the naive walk of
``prepare_resources`` (``tests/support/helix_walk.py``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.model.arith import cdiv
from dcpsim.model.helix import (
    decode_block_of,
    helix_blocks_needed,
    helix_local_keys,
    helix_local_seq_lens,
    helix_placement,
    helix_slot_mapping,
)
from dcpsim.model.layout import PAD
from support.helix_walk import expected_from_walk


@settings(max_examples=300, deadline=None)
@given(B=st.integers(1, 8), W=st.integers(1, 5), prompt_len=st.integers(1, 70), decode=st.integers(0, 90))
def test_placement_matches_the_walk(B, W, prompt_len, decode):
    length = prompt_len + decode
    owner, local = expected_from_walk(prompt_len, length, B, W)
    got_owner, got_local = helix_placement(np.arange(length), prompt_len=prompt_len, block_size=B, dcp_size=W)
    np.testing.assert_array_equal(got_owner, owner)
    np.testing.assert_array_equal(got_local, local)
    busiest = max(int(local[owner == r].max()) // B + 1 if (owner == r).any() else 0 for r in range(W))
    assert busiest <= helix_blocks_needed(length, B, W)
    row = np.arange(100, 100 + helix_blocks_needed(length, B, W), dtype=np.int64)[::-1].copy()
    for r in range(W):
        slots = helix_slot_mapping(np.arange(length), row, prompt_len=prompt_len, block_size=B, dcp_size=W, dcp_rank=r)
        mine = owner == r
        np.testing.assert_array_equal(slots[~mine], PAD)
        np.testing.assert_array_equal(slots[mine], row[local[mine] // B] * B + local[mine] % B)
        pos, keys = helix_local_keys(length, prompt_len=prompt_len, block_size=B, dcp_size=W, dcp_rank=r)
        np.testing.assert_array_equal(pos, np.flatnonzero(mine))
        np.testing.assert_array_equal(keys, local[mine])
        lens = np.arange(length + 1)
        counts = helix_local_seq_lens(lens, prompt_len=prompt_len, block_size=B, dcp_size=W, dcp_rank=r)
        np.testing.assert_array_equal(counts, [int(mine[:n].sum()) for n in lens])


def test_blocks_needed_bound_is_reached():
    """``cdiv(L, B * W) + 1`` holds the busiest rank for every prompt length, and some prompt
    length needs it all (so no smaller prompt-blind count would do)."""
    for B, W in ((4, 2), (3, 4), (16, 1), (2, 3)):
        reached = 0
        for length in range(2, 60):
            worst = 0
            for P in range(1, length + 1):
                owner, local = expected_from_walk(P, length, B, W)
                worst = max(worst, max(int(local[owner == r].max()) // B + 1 for r in set(owner.tolist())))
            assert worst <= helix_blocks_needed(length, B, W) <= worst + 1, (B, W, length)
            reached += worst == helix_blocks_needed(length, B, W)
        assert reached > 0, (B, W)
    assert helix_blocks_needed(0, 4, 2) == 0 and helix_blocks_needed(1, 4, 2) == cdiv(1, 8) + 1


def test_decode_block_clamp():
    """TensorRT-LLM's ``(max(1, it) - 1) // B``: a first iteration counted as 0 stays on block 0
    with the clamp and is block -1 (rank W - 1) without it (TensorRT-LLM#17795)."""
    t = np.arange(6)
    np.testing.assert_array_equal(decode_block_of(t, 4), [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(decode_block_of(t, 4, first_iteration=0), [0, 0, 0, 0, 0, 1])
    assert decode_block_of(np.array([0]), 4, first_iteration=0, clamp=False)[0] % 4 == 3
