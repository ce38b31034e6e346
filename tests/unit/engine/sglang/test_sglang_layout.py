"""SGLang's widened ids (docs/dcp-semantics.md section 13) are section 2's layout at I = 1,
B = P, and the probe of the write kernels reads a row back only when a token wrote all of it
(no SGLang source needed)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from dcpsim.engine.loading.interpreter import evenly_spaced
from dcpsim.engine.sglang.adapter import widened_ids
from dcpsim.engine.sglang.writes import read_back
from dcpsim.model.layout import PAD, slot_mapping


@given(
    W=st.integers(1, 8),
    B=st.sampled_from([1, 2, 16, 64]),
    blocks=st.lists(st.integers(1, 500), min_size=1, max_size=6, unique=True),
    data=st.data(),
)
def test_owner_and_row_of_a_widened_id_are_the_slot_mapping_at_interleave_1(W, B, blocks, data):
    n = len(blocks) * B * W
    start = data.draw(st.integers(0, n - 1))
    positions = np.arange(start, n, dtype=np.int64)
    loc = widened_ids(positions, np.array(blocks), B, W)
    for r in range(W):
        sglang = np.where(loc % W == r, loc // W, PAD)
        want = slot_mapping(range(start, n), np.array(blocks), block_size=B, dcp_size=W, dcp_rank=r, interleave_size=1)
        assert (sglang == want).all()


@given(n=st.integers(0, 300), programs=st.integers(0, 40))
def test_the_sample_takes_both_ends_and_at_most_programs(n, programs):
    chosen = evenly_spaced(n, programs)
    assert len(chosen) <= max(min(n, programs), 0) and len(set(chosen.tolist())) == len(chosen)
    if n and programs >= 2:
        assert chosen[0] == 0 and chosen[-1] == n - 1
    if n <= programs:
        assert chosen.tolist() == list(range(n))


def test_a_row_written_in_part_is_no_tokens_slot():
    buffer = torch.zeros((6, 3), dtype=torch.int64)
    buffer[4] = 1  # token 0, whole row
    buffer[2] = torch.tensor([2, 2, 0])  # token 1 wrote its nope part only
    assert read_back(buffer, 3).tolist() == [4, PAD, PAD]


def test_req_to_token_holds_the_widened_ids_and_minus_one_past_the_blocks():
    from dcpsim.engine.sglang.reads import req_to_token

    rows = [np.array([3, 1]), np.array([5])]
    table = req_to_token(rows, 20, 2, 4).numpy()  # P = 2, W = 4: pages of 8 ids
    assert table.shape == (2, 20) and table.dtype == np.int32
    assert (table[0, :16] == widened_ids(np.arange(16), rows[0], 2, 4)).all() and (table[0, 16:] == -1).all()
    assert (table[1, :8] == widened_ids(np.arange(8), rows[1], 2, 4)).all() and (table[1, 8:] == -1).all()
