"""Sparse attention under ``--engine vllm`` (semantics section 14): vLLM's DCP filter of the
top-k ids, ``vllm/v1/attention/backends/mla/sparse_utils.py::triton_filter_and_convert_dcp_index``
(a Triton kernel, under the interpreter), on the first and last 128 ids of the last query token
of each (group, request) of a step, through an identity block table so that its slots are local
indices; the other ids, and the other sparse decisions, are the reference's (``SPARSE_DECISIONS``
says why)."""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.engine.vllm.functions import call

SPARSE_MODULE, SPARSE_FUNCTION = "vllm.v1.attention.backends.mla.sparse_utils", "triton_filter_and_convert_dcp_index"
SPARSE_ARGS = ("req_id", "block_table", "token_indices", "dcp_size", "dcp_rank", "cp_kv_cache_interleave_size")
SPARSE_TOPK_BLOCK = 128
"""vLLM's ``BLOCK_N``: the kernel's top-k width must be a multiple of it (padded with -1)."""
SPARSE_DECISIONS = {
    "indexer_local_rows": "reference (vLLM's deinterleave index, vllm/v1/attention/backends/mla/indexer.py "
    "build_pcp_global_chunk_plan, is not run: it needs vLLM's pinned-memory and device-copy helpers stubbed)",
    "select_topk": "reference (vLLM's top-k runs in CUDA kernels: DeepGEMM's fp8 MQA logits and top_k_per_row)",
    "sparse_local_keys": f"vllm {SPARSE_MODULE}.{SPARSE_FUNCTION} (a Triton kernel, under the interpreter) on the first "
    "and last 128 ids of the last query token of each (group, request) of a step, through an identity block table so "
    "that its slots are local indices; the other ids: reference",
}
"""The sparse-attention decisions (semantics section 14) and why the reference makes them."""


def filter_last_token(fn, geometry, selected, local, dcp_rank) -> np.ndarray:
    """``local`` (the reference's local keys) with its last row's first and last tile of 128 ids
    replaced by vLLM's filter's: the kernel maps each tile on its own (no compaction), one
    interpreted program a tile."""
    last = np.asarray(selected, dtype=np.int64)[-1]
    k, n = len(last), SPARSE_TOPK_BLOCK
    tiles = sorted({0, (k - 1) // n})
    tokens = np.full((1, n * len(tiles)), -1, dtype=np.int32)
    for i, t in enumerate(tiles):
        part = last[t * n : (t + 1) * n]
        tokens[0, i * n : i * n + len(part)] = part
    row = tokens.astype(np.int64)
    page = geometry.states_per_page
    table = torch.arange(int(row.max(initial=0)) // page + 2, dtype=torch.int32).reshape(1, -1)  # slot = local index
    out = call(
        f"{SPARSE_MODULE}.{SPARSE_FUNCTION}",
        fn,
        torch.zeros(1, dtype=torch.int32),
        table,
        torch.from_numpy(tokens),
        dcp_size=geometry.dcp_size,
        dcp_rank=dcp_rank,
        cp_kv_cache_interleave_size=geometry.interleave_size,
        BLOCK_SIZE=page,
        NUM_TOPK_TOKENS=tokens.shape[1],
        compact_valid_to_front=False,
    )
    for i, t in enumerate(tiles):
        m = len(last[t * n : (t + 1) * n])
        local[-1, t * n : t * n + m] = out.numpy()[0, i * n : i * n + m]
    return local
