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

Cost: a prefill over a long context gathers it every step, so nothing here walks it. The plan
is computed per request (``plan_chunk_arrays``; ``plan_chunks_walk`` is vLLM's chunk-by-chunk
loop, the same entries), and the reference engine keeps each request's gathered slots across
steps (``ContextSlots``): a step maps only the local keys its context added, while the
request's block-table row under the kept keys is unchanged.
"""

from __future__ import annotations

import math
import threading

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
    arrays = plan_chunk_arrays(contexts, workspace=workspace, block_size=block_size, dcp_size=dcp_size, interleave_size=interleave_size)
    return list(zip(*(a.tolist() for a in arrays)))


def plan_chunk_arrays(
    contexts: list[int], *, workspace: int, block_size: int, dcp_size: int, interleave_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``plan_chunks`` as four int64 arrays (chunks, requests, starts, lengths), computed per
    request rather than per chunk: its cost grows with the requests, not with their contexts.

    Every split lies on a multiple of ``A`` (a multiple of ``W * I``), so a piece of ``n``
    tokens at a split takes ``padded(n)`` rows; a fresh chunk takes ``full`` tokens of a
    context whose rest does not fit it (the largest multiple of ``A`` that is at most the
    aligned workspace and whose rows fit a chunk), and the rest fits once it is at most
    ``fits`` tokens. A request therefore takes: a piece of the current chunk (the whole
    context, or a split of what is left of the chunk), whole chunks of ``full`` tokens,
    and its tail, which opens the chunk the next request packs into. A zero context closes
    an open chunk. Falls back to ``plan_chunks_walk`` when a chunk cannot take one
    alignment (the walk's own degenerate case)."""
    W, I = dcp_size, interleave_size
    align = math.lcm(block_size, W * I) if W > 1 else block_size
    budget = workspace // W
    full = min(workspace // align * align, budget * W // align * align)
    if full <= 0:
        walked = plan_chunks_walk(contexts, workspace=workspace, block_size=block_size, dcp_size=W, interleave_size=I)
        return tuple(np.array([e[k] for e in walked], dtype=np.int64) for k in range(4))
    fits = budget // I * W * I if W > 1 else budget
    parts: list[tuple[int, int, int, int, int]] = []  # (first chunk, request, first start, pieces, piece length)
    chunk, used = 0, 0
    for request, c in enumerate(contexts):
        if c <= 0:
            chunk, used = chunk + (used > 0), 0
            continue
        need = padded_rows(c, W, I)
        if used + need <= budget:
            parts.append((chunk, request, 0, 1, c))
            used += need
            continue
        first = max(0, min(full, (c - 1) // align * align, (budget - used) * W // align * align))
        if first > 0:
            parts.append((chunk, request, 0, 1, first))
        chunk, start, used = chunk + (first > 0 or used > 0), first, 0
        whole = cdiv(c - start - fits, full) if c - start > fits else 0
        if whole:
            parts.append((chunk, request, start, whole, full))
            chunk, start = chunk + whole, start + whole * full
        parts.append((chunk, request, start, 1, c - start))
        used = padded_rows(c - start, W, I)
    return _expand(parts)


def _expand(parts: list[tuple[int, int, int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The entries of runs ``(first chunk, request, first start, pieces, piece length)``."""
    if not parts:
        empty = np.zeros(0, np.int64)
        return empty, empty.copy(), empty.copy(), empty.copy()
    first, request, start, count, length = (np.array(col, dtype=np.int64) for col in zip(*parts))
    run = np.arange(len(parts), dtype=np.int64).repeat(count)
    step = np.arange(len(run), dtype=np.int64) - (count.cumsum() - count)[run]
    return first[run] + step, request[run], start[run] + step * length[run], length[run]


def plan_chunks_walk(
    contexts: list[int], *, workspace: int, block_size: int, dcp_size: int, interleave_size: int
) -> list[tuple[int, int, int, int]]:
    """``plan_chunks`` the way vLLM's loop walks it: chunk after chunk, every split walked
    down one alignment at a time (the plan from scratch; ``plan_chunks`` computes the same
    entries per request)."""
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
                if n <= 0 and not opened:  # an empty chunk that cannot take one aligned span
                    raise ValueError(f"a workspace of {workspace} rows cannot hold one span of {align} tokens over {W} ranks at I = {I}")
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


def local_gathers(
    contexts: np.ndarray, starts: np.ndarray, lengths: np.ndarray, *, dcp_size: int, interleave_size: int, dcp_rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """``local_gather`` of every entry at once: ``(local starts, local lengths)`` of entries
    ``[starts, starts + lengths)`` of requests with ``contexts`` cached tokens."""
    W, I = dcp_size, interleave_size
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if W == 1:
        return starts.copy(), lengths.copy()
    local_start = -(-starts // (W * I)) * I
    padded = -(-(starts + lengths) // (W * I)) * I - local_start
    mine = local_seq_lens(np.asarray(contexts, dtype=np.int64), dcp_size=W, interleave_size=I, dcp_rank=dcp_rank)
    return local_start, np.minimum(np.maximum(0, mine - local_start), padded)


class ContextSlots:
    """The slots of each request's gathered local keys, kept across steps so that a step
    maps only the keys its context adds (the plan of a chunk over an unchanged prefix).

    A request's slots are those of its local keys ``[0, filled)`` through its block-table
    row, in a buffer only ever appended to: a key below ``filled`` keeps its slot while the
    row's entries that hold those keys are unchanged. Each call compares them with the
    step's row (a preempted request, a reused id, another geometry: a new buffer) and maps
    only the keys past ``filled``, so an array handed out earlier (a view of the buffer)
    never changes. Only keys the row covers are kept (past it the caller maps them itself).
    Kept per (group, rank, thread), for the requests of the group's last step only; a copy
    or a pickle starts empty."""

    def __init__(self) -> None:
        self._scopes: dict[tuple, dict[str, _Kept]] = {}

    def __reduce__(self):
        return (ContextSlots, ())

    def __deepcopy__(self, memo):
        return ContextSlots()

    def step(self, group: int, rank: int) -> _StepSlots:
        """The kept slots of one group's step on one rank (in this thread: a thread world's
        ranks may share one engine): what the step asks for stays kept, the other requests
        are dropped when it ends (``close``)."""
        key = (group, rank, threading.get_ident())
        return _StepSlots(self._scopes, key, self._scopes.get(key, {}))


class _Kept:
    __slots__ = ("buffer", "filled", "row", "unit")

    def __init__(self, unit: tuple[int, ...], capacity: int) -> None:
        self.unit, self.buffer, self.filled, self.row = unit, np.empty(capacity, np.int64), 0, np.zeros(0, np.int64)


class _StepSlots:
    def __init__(self, scopes: dict, key: tuple, kept: dict[str, _Kept]) -> None:
        self._scopes, self._key, self._kept, self._now = scopes, key, kept, {}

    def slots(self, request_id: str, row: np.ndarray, need: int, keys_per_entry: int, unit: tuple[int, ...], read) -> np.ndarray | None:
        """A buffer whose first ``need`` items are the slots of local keys ``[0, need)``
        through ``row`` (``keys_per_entry`` keys per row entry; ``unit``: everything else
        the mapping depends on), mapping the missing ones with ``read(row_part, keys)``
        (keys relative to the part). None: the row does not cover the keys."""
        if need > len(row) * keys_per_entry:
            return None
        kept = self._kept.get(request_id)
        if kept is not None and (kept.unit != unit or len(row) < len(kept.row) or not np.array_equal(row[: len(kept.row)], kept.row)):
            kept = None  # the row (or the geometry) changed under the kept keys: map them again
        if kept is None:
            kept = _Kept(unit, need + need // 8)
        if need > kept.filled:
            if need > len(kept.buffer):  # a new buffer: the views handed out keep the old one
                buffer = np.empty(need + need // 8, np.int64)  # an eighth to spare: a copy every few steps, little unused
                buffer[: kept.filled] = kept.buffer[: kept.filled]
                kept.buffer = buffer
            first = kept.filled // keys_per_entry
            part = np.asarray(row[first : cdiv(need, keys_per_entry)], dtype=np.int64)
            keys = np.arange(kept.filled - first * keys_per_entry, need - first * keys_per_entry, dtype=np.int64)
            kept.buffer[kept.filled : need] = read(part, keys)
            kept.filled, kept.row = need, np.array(row[: cdiv(need, keys_per_entry)], dtype=np.int64)
        self._now[request_id] = kept
        return kept.buffer

    def close(self) -> None:
        """Keep only the requests this step asked for."""
        if self._now:
            self._scopes[self._key] = self._now
        else:
            self._scopes.pop(self._key, None)
