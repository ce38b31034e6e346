"""SGLang's read-index builders, run from its source under Triton's interpreter, read the rank's
slots of section 2 at I = 1, B = P (its per-token ids) and the block table's pages (its MLA page
table): what the engine hands its attention and metadata."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.sglang import reads
from dcpsim.engine.sglang.adapter import MERGE_MODULE
from dcpsim.engine.sglang.loader import SourceTree
from dcpsim.model.layout import local_seq_lens, slot_mapping


@pytest.fixture(scope="module")
def kernels(sglang_source):
    return SourceTree(sglang_source).load([MERGE_MODULE])[MERGE_MODULE]


@pytest.mark.parametrize("W,P", [(2, 4), (4, 16), (8, 1)])
def test_token_ids_are_the_ranks_slots(kernels, W, P):
    row = np.array([7, 2, 9, 4, 11])
    seq = len(row) * P * W - 3
    for r in range(W):
        local = int(local_seq_lens(np.array([seq]), dcp_size=W, interleave_size=1, dcp_rank=r)[0])
        got = reads.token_slots(kernels.create_triton_kv_indices_for_dcp_triton, row, local, block_size=P, dcp_size=W, dcp_rank=r)
        slots = slot_mapping(range(seq), row, block_size=P, dcp_size=W, dcp_rank=r, interleave_size=1)
        assert (got == slots[slots >= 0]).all(), (r, got)


@pytest.mark.parametrize("W,P", [(2, 4), (4, 16)])
def test_mla_page_table_is_the_block_row(kernels, W, P):
    rows = [np.array([7, 2, 9]), np.array([5]), np.array([1, 8])]
    lens = np.array([3 * P * W - 1, P * W, 2 * P * W])
    for r in range(W):
        local = local_seq_lens(lens, dcp_size=W, interleave_size=1, dcp_rank=r)
        got = reads.page_table(kernels.create_mla_kv_page_table_for_dcp, rows, local, shape="v2p", block_size=P, dcp_size=W, dcp_rank=r)
        for row, pages, n in zip(rows, got, local):
            assert (pages == row[: -(-n // P)]).all(), (r, pages)
