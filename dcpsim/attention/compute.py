"""Attention math and the keys each query token sees.

Two sides, kept apart:

* the simulated engine (``engine_view`` + ``attend``): on one rank, over the rank's own
  shard, with the local bounds of ``dcpsim.layout`` (``query_local_seq_lens`` for paged
  groups, ``local_seq_lens`` of the record counts for compressed groups), float32, in the
  configured LSE base; the fault hooks act here;
* the reference (``reference_context`` + ``reference_attention``): the whole context of one
  request from plan data (global positions, naive masks), float64, ``torch.softmax`` and
  ``torch.logsumexp``; no layout math, no fault, no store.

Masks: a query token at position ``p`` sees positions ``<= p`` (full attention), within
``(p - sliding_window, p]`` (sliding window), or within its chunk ``[p - p % C, p]``
(chunked local); for compressed records, the records emitted at positions ``<= p``
(record ``c`` is emitted at ``(c + 1) * R - 1``, so ``c < (p + 1) // R``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dcpsim.group_layout import CHUNK, RECORDS, RING, WINDOW, GroupLayout
from dcpsim.layout import local_seq_lens, query_local_seq_lens

_LOG2E = 1.0 / math.log(2.0)
_NEG_INF = float("-inf")


# --- which keys a query token sees ----------------------------------------------------


def _window_lo(layout: GroupLayout, positions: np.ndarray) -> np.ndarray:
    """First position each query token may attend to (window / chunk), else 0."""
    if layout.retention == WINDOW:
        return np.maximum(0, positions - layout.spec.sliding_window + 1)
    if layout.retention == CHUNK:
        return positions - positions % layout.spec.attention_chunk_size
    return np.zeros_like(positions)


def context_keys(layout: GroupLayout, start: int, stop: int) -> int:
    """Keys the last query token of ``[start, stop)`` can see at most, globally (cost estimate)."""
    if layout.storage == RECORDS:
        return stop // layout.tokens_per_state
    if layout.retention == WINDOW:
        return min(stop, layout.spec.sliding_window + stop - start)
    if layout.retention == CHUNK:
        return min(stop, layout.spec.attention_chunk_size + stop - start)
    return stop


def select_queries(num_queries: int, keys: int, budget: int, minimum: int = 8) -> np.ndarray:
    """Query tokens of a write to check: every one when ``num_queries * keys <= budget``;
    else ``max(minimum, budget // keys)`` of them, deterministically: the first and the last
    quarter, evenly spaced ones between (the first tokens hold the empty shards, the last
    ones the longest contexts). Only huge prefill chunks (e.g. 16K tokens of a 256K
    context) are sampled."""
    q = num_queries
    if q * max(keys, 1) <= budget:
        return np.arange(q, dtype=np.int64)
    n = max(minimum, budget // max(keys, 1))
    if n >= q:
        return np.arange(q, dtype=np.int64)
    edge = n // 4
    middle = np.linspace(edge, q - 1 - edge, n - 2 * edge).round().astype(np.int64)
    return np.unique(np.concatenate([np.arange(edge), middle, np.arange(q - edge, q)]))


def engine_view(layout: GroupLayout, rank: int, start: int, stop: int, fault=None, rows=None):
    """What rank ``rank``'s attention reads for query positions ``[start, stop)``.

    ``rows`` (default: all) selects the query tokens computed, as offsets from ``start``.
    Returns ``(local_index, mask, merged)``: the local indices to read through the block
    table (``verify.read.read_slots``), the ``[len(rows), n]`` visibility mask, and whether
    the group is sharded (its per-rank results are merged across ranks).
    """
    if layout.storage == RING:
        raise ValueError("a ring is compressor state, not attention KV")
    q = stop - start
    rows = np.arange(q, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    positions = np.arange(start, stop, dtype=np.int64)
    W, I = layout.dcp_size, layout.interleave_size
    if layout.sharded:
        if layout.storage == RECORDS:
            lens = (positions + 1) // layout.tokens_per_state
            bounds = local_seq_lens(lens, dcp_size=W, interleave_size=I, dcp_rank=rank)
        else:
            lens = positions + 1
            bounds = query_local_seq_lens(start, q, dcp_size=W, dcp_rank=rank, interleave_size=I)
        if fault is not None:  # the hook sees the whole step, like the engine's metadata builder
            bounds = fault.query_local_bounds(bounds, lens, dcp_size=W, dcp_rank=rank, interleave_size=I)
        bounds = np.asarray(bounds, dtype=np.int64)[rows]
        local = np.arange(int(bounds.max(initial=0)), dtype=np.int64)
        return local, local[None, :] < bounds[:, None], True
    # replicated (or W == 1): the local index is the global one, attention as with W == 1
    positions = positions[rows]
    if layout.storage == RECORDS:
        counts = (positions + 1) // layout.tokens_per_state
        local = np.arange(int(counts.max(initial=0)), dtype=np.int64)
        return local, local[None, :] < counts[:, None], False
    lo = _window_lo(layout, positions)
    local = np.arange(int(lo.min(initial=start)), int(positions.max(initial=start - 1)) + 1, dtype=np.int64)
    mask = (local[None, :] <= positions[:, None]) & (local[None, :] >= lo[:, None])
    return local, mask, False


def reference_context(layout: GroupLayout, start: int, stop: int, rows=None):
    """The full context of query positions ``[start, stop)``: ``(emit_positions, mask)``.

    ``emit_positions[i]`` is the position whose content key ``i`` carries (the position
    itself, or the emitting position of a record); ``mask`` is ``[len(rows), n]``. Naive:
    built from the spec's own fields, never from ``dcpsim.layout``.
    """
    positions = np.arange(start, stop, dtype=np.int64)
    if rows is not None:
        positions = positions[np.asarray(rows, dtype=np.int64)]
    first, last = int(positions.min(initial=start)), int(positions.max(initial=start - 1))
    if layout.storage == RECORDS:
        R = layout.tokens_per_state
        emit = np.arange(R - 1, last + 1, R, dtype=np.int64)  # records emitted up to the last query
        return emit, emit[None, :] <= positions[:, None]
    if layout.retention == WINDOW:
        w = layout.spec.sliding_window
        keys = np.arange(max(0, first - w + 1), last + 1, dtype=np.int64)
        mask = (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - w)
    elif layout.retention == CHUNK:
        c = layout.spec.attention_chunk_size
        keys = np.arange(first - first % c, last + 1, dtype=np.int64)
        mask = (keys[None, :] <= positions[:, None]) & (keys[None, :] // c == positions[:, None] // c)
    else:
        keys = np.arange(last + 1, dtype=np.int64)
        mask = keys[None, :] <= positions[:, None]
    return keys, mask


# --- the math -------------------------------------------------------------------------


def _masked_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``[H, nq, n]`` logits ``scale * q . k`` with -inf where ``mask`` is False (one batched
    GEMM over heads with the mask as an additive bias: all heads share the single KV head)."""
    nq, H, dk = q.shape
    n = k.shape[0]
    bias = torch.zeros((nq, n), dtype=q.dtype).masked_fill_(~mask, _NEG_INF)
    heads_first = q.transpose(0, 1).contiguous()  # (strided operands take a slow GEMM path)
    return torch.baddbmm(bias.unsqueeze(0), heads_first, k.t().contiguous().unsqueeze(0).expand(H, dk, n), alpha=scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
           scale: float, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's attention: ``q [nq, H, dk]``, ``k [n, dk]``, ``v [n, dv]``, ``mask [nq, n]``.

    Returns ``(O [nq, H, dv], lse [nq, H])`` in the dtype of ``q``; a row that sees no key
    gets ``O = 0`` and ``lse = -inf``. ``base="2"`` works in base 2 like flash kernels:
    logits times log2(e), exp2, log2. (Max-subtracted exponentials, then a division.)
    """
    nq, H, _ = q.shape
    n, dv = v.shape
    if nq == 0 or n == 0:
        return q.new_zeros((nq, H, dv)), q.new_full((nq, H), _NEG_INF)
    v = v.contiguous()
    s = _masked_logits(q, k, mask, scale if base == "e" else scale * _LOG2E)  # [H, nq, n]
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
    s.sub_(m)
    if base == "e":
        s.exp_()
    else:
        s.exp2_()
    denom = s.sum(dim=-1)  # [H, nq]
    o = torch.bmm(s, v.unsqueeze(0).expand(H, n, dv)) / denom.unsqueeze(-1)
    o = torch.where((denom == 0).unsqueeze(-1), torch.zeros_like(o), o)  # NaN stays NaN
    lse = m.squeeze(-1) + (torch.log(denom) if base == "e" else torch.log2(denom))
    return o.transpose(0, 1), lse.transpose(0, 1)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                        scale: float, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64, natural logits (``torch.softmax``); the LSE is converted
    to ``base`` at the end. A row that sees nothing: ``O = 0``, ``lse = -inf``."""
    q, k, v = q.double(), k.double(), v.double()
    nq, H, _ = q.shape
    n, dv = v.shape
    if nq == 0 or n == 0:
        return q.new_zeros((nq, H, dv)), q.new_full((nq, H), _NEG_INF)
    s = _masked_logits(q, k, mask, scale)
    weights = torch.softmax(s, dim=-1)
    # the weight of the largest logit m is exp(m - lse) >= 1/n: lse = m - log(that weight)
    lse = s.amax(dim=-1) - torch.log(weights.amax(dim=-1))
    empty = ~mask.any(dim=1)
    if empty.any():
        weights[:, empty] = 0.0  # softmax of a row of -inf is NaN
        lse[:, empty] = _NEG_INF
    o = torch.bmm(weights, v.unsqueeze(0).expand(H, n, dv))
    if base == "2":
        lse = lse * _LOG2E
    return o.transpose(0, 1), lse.transpose(0, 1)


def state_error(o: torch.Tensor, lse: torch.Tensor, o_ref: torch.Tensor, lse_ref: torch.Tensor) -> torch.Tensor:
    """Per (query, head): max abs error over the output vector and the LSE, float64.

    Equal infinite LSEs (an empty row on both sides) count as 0; NaN anywhere counts as +inf.
    """
    o_err = (o.double() - o_ref.double()).abs().amax(dim=-1) if o.shape[-1] else torch.zeros_like(lse_ref)
    a, b = lse.double(), lse_ref.double()
    same_inf = torch.isinf(a) & (a == b)
    lse_err = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    err = torch.maximum(o_err, lse_err)
    return torch.nan_to_num(err, nan=float("inf"), posinf=float("inf"))
