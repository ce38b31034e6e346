"""The context gather of a chunked prefill over a cached context (the engine's math).

vLLM 0.33.0's MLA prefill (``build_mla_chunked_context_metadata`` and
``plan_mla_context_chunks`` in ``model_executor/layers/attention/mla_attention.py``)
attends to the cached context of its prefill rows in workspace-sized chunks: each rank
gathers its own shard of a chunk's context into a workspace of ``S`` rows, the ranks
all-gather the pieces and attention runs over them, chunk after chunk
(``docs/dcp-semantics.md``, section 10). This module is the reference engine's arithmetic;
the checker derives the same plan on its own (``dcpsim.verify.context_gather``).

Rules (``W`` the group's shard count, 1 for a replicated group; ``I`` the interleave;
``B`` the page size; ``S`` the workspace rows):

* ``S`` defaults to ``min(max(8 * max_model_len, 4 * max_num_seqs * B), 65536)``
  (``determine_chunked_prefill_workspace_size``), and is rounded up to a multiple of
  ``A0 = lcm(B, W * I)`` (``B`` without DCP): ``align_mla_chunked_context_workspace_size``.
* A chunk's rows: ``padded(n) = cdiv(n, W * I) * I`` rows per rank for ``n`` context
  tokens under DCP, ``n`` without; a chunk holds at most ``S // W`` rows.
* Requests are packed in batch order; a request that does not fit what is left is split
  at the largest multiple of ``A = lcm(B, W * I)`` (``B`` without DCP) that fits, is at
  most ``S`` and leaves at least one token; the chunk closes and the rest starts the next.
* Entry (chunk, request) covers context tokens ``[s, s + n)``; rank ``r`` gathers its
  local rows ``[padded(s), padded(s) + min(local(c, r) - padded(s), padded(s + n) - padded(s))]``
  (``c`` the request's context; never below 0): vllm#28526 gave it ``local(c, r)``.
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.model.arith import cdiv
from dcpsim.model.layout import local_seq_lens

WORKSPACE_CAP = 64 * 1024
"""vLLM's cap on the chunked-prefill workspace: 64K rows."""


def workspace_size(
    configured: int | None, *, max_model_len: int, max_num_seqs: int, block_size: int, dcp_size: int, interleave_size: int
) -> int:
    """The workspace rows ``S`` (``configured``, or vLLM's default), aligned."""
    size = configured if configured is not None else min(max(8 * max_model_len, 4 * max_num_seqs * block_size), WORKSPACE_CAP)
    align = math.lcm(block_size, dcp_size * interleave_size) if dcp_size > 1 else block_size
    return cdiv(max(size, align), align) * align


def padded_rows(n: int, dcp_size: int, interleave_size: int) -> int:
    """Rows per rank ``n`` context tokens take in the workspace."""
    if dcp_size == 1:
        return n
    return cdiv(n, dcp_size * interleave_size) * interleave_size


def plan_chunks(
    contexts: list[int], *, workspace: int, block_size: int, dcp_size: int, interleave_size: int
) -> list[tuple[int, int, int, int]]:
    """``(chunk, request, start, length)`` of every gather entry, in order, for the context
    lengths of the step's prefill rows (``request`` indexes ``contexts``)."""
    W, I = dcp_size, interleave_size
    align = math.lcm(block_size, W * I) if W > 1 else block_size
    budget = workspace // W
    top = workspace // align * align

    def rows(a: int, b: int) -> int:
        return padded_rows(b, W, I) - padded_rows(a, W, I)

    def split(start: int, remaining: int, available: int) -> int:
        best = min(top, (remaining - 1) // align * align)
        while best > 0 and rows(start, start + best) > available:
            best -= align
        return max(best, 0)

    out: list[tuple[int, int, int, int]] = []
    chunk, request, start = 0, 0, 0
    while request < len(contexts):
        if contexts[request] <= 0:
            request += 1
            continue
        used, opened = 0, False
        while request < len(contexts) and contexts[request] > 0:
            need = rows(start, contexts[request])
            if used + need > budget:
                n = split(start, contexts[request] - start, budget - used)
                if n > 0:
                    out.append((chunk, request, start, n))
                    start, opened = start + n, True
                break
            out.append((chunk, request, start, contexts[request] - start))
            used, opened, request, start = used + need, True, request + 1, 0
        chunk += opened
    return out


def local_gather(context: int, start: int, length: int, *, dcp_size: int, interleave_size: int, dcp_rank: int) -> tuple[int, int]:
    """``(local start, local length)`` rank ``dcp_rank`` gathers of context tokens
    ``[start, start + length)`` of a request with ``context`` cached tokens."""
    W, I = dcp_size, interleave_size
    local_start = padded_rows(start, W, I)
    padded = padded_rows(start + length, W, I) - local_start
    if W == 1:
        return local_start, length
    mine = int(local_seq_lens(np.array([context]), dcp_size=W, interleave_size=I, dcp_rank=dcp_rank)[0])
    return local_start, min(max(0, mine - local_start), padded)
