"""The checker's Helix layout against a naive per-token walk of TensorRT-LLM's
``KVCacheManager.prepare_resources``, written here and sharing nothing with either side."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.verify.helix import helix_held_below, helix_local_of, helix_map, helix_owner_of
from support.helix_walk import expected_from_walk


@settings(max_examples=400, deadline=None)
@given(
    B=st.integers(1, 8),
    W=st.integers(1, 5),
    prompt_len=st.integers(1, 70),
    decode=st.integers(0, 90),
)
def test_checker_owner_and_slot_match_the_walk(B, W, prompt_len, decode):
    length = prompt_len + decode
    owner, local = expected_from_walk(prompt_len, length, B, W)
    got_owner, got_local = helix_map(prompt_len, length, B, W)
    np.testing.assert_array_equal(got_owner, owner)
    np.testing.assert_array_equal(got_local, local)
    index = np.arange(length, dtype=np.int64)[::-1]
    np.testing.assert_array_equal(helix_owner_of(index, prompt_len, B, W), owner[index])
    np.testing.assert_array_equal(helix_local_of(index, prompt_len, B, W), local[index])
    # held keys below every length, and the local blocks they span, per rank
    lengths = np.arange(length + 1, dtype=np.int64)
    for r in range(W):
        held, pages = helix_held_below(lengths, r, prompt_len, B, W)
        mine = [(owner[:n] == r) for n in lengths]
        np.testing.assert_array_equal(held, [int(m.sum()) for m in mine])
        np.testing.assert_array_equal(pages, [int(local[:n][m].max()) // B + 1 if m.any() else 0 for n, m in zip(lengths, mine)])


def test_equals_vllm_layout_when_the_prompt_fills_whole_rounds():
    """With P a multiple of B * W Helix is vLLM's layout with I = B (owner (p // B) % W)."""
    B, W = 4, 2
    for P in (8, 16, 24):
        owner, _ = helix_map(P, P + 37, B, W)
        np.testing.assert_array_equal(owner, (np.arange(P + 37) // B) % W)
    owner, _ = helix_map(9, 9 + 37, B, W)  # a partial prompt block: not vLLM's
    assert not np.array_equal(owner, (np.arange(9 + 37) // B) % W)


def test_first_decode_token_goes_to_rank_zero():
    """TensorRT-LLM#17795: the clamp keeps the first decode iteration on decode block 0."""
    for W in (2, 4):
        owner, local = helix_map(5, 7, 4, W)
        assert owner[5] == 0 and owner[6] == 0
        assert local[5] == 4  # rank 0's second block: the prompt's block 0 first
