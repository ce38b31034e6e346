"""Attention metadata under ``--engine vllm``: the local lengths
(``vllm/v1/attention/backends/utils.py::get_dcp_local_seq_lens``; the per-token bound of query
token ``j`` is the local length of ``start + j + 1``) and the kernel block table when ``Bk < B``
(``vllm/v1/worker/utils.py::AttentionGroup.map_to_kernel_block_table``, called on a stand-in for
the attention group that holds only what it reads)."""

from __future__ import annotations

import types

import numpy as np
import torch

from dcpsim.engine.vllm.functions import call

LENS_MODULE, LENS_FUNCTION = "vllm.v1.attention.backends.utils", "get_dcp_local_seq_lens"
LENS_ARGS = ("seq_lens", "dcp_size", "dcp_rank", "cp_kv_cache_interleave_size")
KERNEL_TABLE_MODULE, KERNEL_TABLE_FUNCTION = "vllm.v1.worker.utils", "AttentionGroup.map_to_kernel_block_table"
KERNEL_TABLE_ARGS = ("self", "block_table", "ubatch_idx")


def kernel_block_table(fn, geometry, block_row) -> np.ndarray:
    page, bk = geometry.states_per_page, geometry.kernel_block_size
    if bk is None or bk == page:
        return np.asarray(block_row, dtype=np.int64)
    k = page // bk
    row = torch.as_tensor(np.asarray(block_row), dtype=torch.int32).reshape(1, -1)
    group = types.SimpleNamespace(  # what map_to_kernel_block_table reads of an AttentionGroup
        kernel_block_size=bk,
        kv_cache_spec=types.SimpleNamespace(block_size=page),
        kernel_block_table=torch.zeros((1, 1, row.shape[1] * k), dtype=torch.int32),
        kernel_block_offsets=torch.arange(k, dtype=torch.int32),
        kernel_block_stride=0,
    )
    out = call(f"{KERNEL_TABLE_MODULE}.{KERNEL_TABLE_FUNCTION}", fn, group, row)
    return out.reshape(-1).numpy().astype(np.int64)


def local_seq_lens(fn, geometry, seq_lens, dcp_rank) -> np.ndarray:
    lens = np.asarray(seq_lens, dtype=np.int64)
    if not geometry.sharded:
        return lens
    out = call(f"{LENS_MODULE}.{LENS_FUNCTION}", fn, torch.from_numpy(lens), geometry.dcp_size, dcp_rank, geometry.interleave_size)
    return out.numpy().astype(np.int64)
