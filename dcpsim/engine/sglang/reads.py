"""SGLang's read-index builders (``kernels/ops/attention/dcp_kernels.py``), run under Triton's
interpreter on the widened ids of a request's ``req_to_token`` row: which of a rank's rows its
attention reads.

* ``token_slots``: ``create_triton_kv_indices_for_dcp_triton``, the Triton backend's per-token
  read ids (``srt/layers/attention/triton_backend.py::_dcp_kv_indices``): for the rank's
  ``local_len`` keys, ``req_to_token[first + j * W] // W``, ``first`` the rank's first
  position. One program per request (its loop is over blocks of 512 keys, vectorized).
* ``page_table``: ``create_mla_kv_page_table_for_dcp``, the MLA backends' page table
  (``trtllm_mla_backend.py::_fill_dcp_block_kv_indices``, ``aiter_backend.py``), on a static
  pool (``HAS_V2P = False``): page ``k`` of the rank's slice is
  ``req_to_token[r + k * P * W] // W // P``. One program per request (grid ``(requests, 1)``,
  ``PAGES_PER_BLOCK`` the next power of two of the widest request's pages).

The kernels are called as SGLang's backends call them (the same argument order and
constants), with ``req_to_token`` rows holding the widened ids of every position the row's
blocks cover (``-1`` past them).
"""

from __future__ import annotations

import numpy as np
import torch

TOKEN_INDICES = "create_triton_kv_indices_for_dcp_triton"
PAGE_TABLE = "create_mla_kv_page_table_for_dcp"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def req_to_token(rows: list[np.ndarray], width: int, block_size: int, dcp_size: int) -> torch.Tensor:
    """``[len(rows), width]`` int32: position ``p`` of request ``i`` holds its widened id
    ``rows[i][p // (P * W)] * P * W + p % (P * W)`` (SGLang's allocator, section 13 of the
    semantics), ``-1`` past its blocks."""
    span = block_size * dcp_size
    table = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)
    positions = np.arange(table.shape[1], dtype=np.int64)
    for i, row in enumerate(rows):
        row = np.asarray(row, dtype=np.int64)
        inside = positions[positions // span < len(row)]
        table[i, : len(inside)] = row[inside // span] * span + inside % span
    return torch.from_numpy(table.astype(np.int32))


def token_slots(kernel, block_row: np.ndarray, local_len: int, *, block_size: int, dcp_size: int, dcp_rank: int) -> np.ndarray:
    """The rank's rows of its ``local_len`` keys of one request, by SGLang's Triton builder."""
    if local_len <= 0:
        return np.zeros(0, dtype=np.int64)
    width = dcp_rank + local_len * dcp_size  # past the rank's last position
    table = req_to_token([block_row], width, block_size, dcp_size)
    lens = torch.tensor([local_len], dtype=torch.int32)
    indptr = torch.tensor([0, local_len], dtype=torch.int32)
    out = torch.full((local_len,), -1, dtype=torch.int64)
    kernel[(1,)](table, torch.zeros(1, dtype=torch.int64), lens, indptr, None, out, table.stride(0), dcp_size, dcp_rank)
    return out.numpy()


def page_table(
    kernel, block_rows: list[np.ndarray], local_lens: np.ndarray, *, shape: str, block_size: int, dcp_size: int, dcp_rank: int
) -> list[np.ndarray]:
    """Each request's page ids of the rank's slice (``cdiv(local_len, P)`` each), by SGLang's
    MLA builder of ``shape`` (``releases.PAGE_TABLE``: ``v2p``, ``v2p-mult`` with a sub-pool
    multiplier of 1, ``no-v2p``), all requests in one launch, with no virtual-to-physical map."""
    lens = np.asarray(local_lens, dtype=np.int64)
    pages = -(-lens // block_size)
    if not len(lens) or not pages.max():
        return [np.zeros(int(n), dtype=np.int64) for n in pages]
    width = dcp_rank + int(pages.max()) * block_size * dcp_size
    table = req_to_token(block_rows, width, block_size, dcp_size)
    per_block = _next_pow2(int(pages.max()))
    out = torch.full((len(lens), per_block), -1, dtype=torch.int32)
    v2p = {"v2p": (None,), "v2p-mult": (None,), "no-v2p": ()}[shape]
    mult = (1,) if shape == "v2p-mult" else ()
    flags = {} if shape == "no-v2p" else dict(HAS_V2P=False)
    kernel[(len(lens), 1)](
        table,
        torch.arange(len(lens), dtype=torch.int64),
        torch.from_numpy(lens.astype(np.int32)),
        out,
        *v2p,
        table.stride(0),
        out.stride(0),
        *mult,
        PHYSICAL_PAGE_SIZE=block_size,
        DCP_SIZE=dcp_size,
        DCP_RANK=dcp_rank,
        PAGES_PER_BLOCK=per_block,
        **flags,
    )
    got = out.numpy().astype(np.int64)
    return [got[i, : int(n)] for i, n in enumerate(pages)]
