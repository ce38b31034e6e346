"""The checker's attention reference: the full context of a request from plan data alone.

Masks: a query token at position ``p`` sees positions ``<= p`` (full attention), within
``(p - sliding_window, p]`` (sliding window), or within its chunk ``[p - p % C, p]``
(chunked local); for compressed records, the records emitted at positions ``<= p``
(record ``c`` is emitted at ``(c + 1) * R - 1``). Softmax in float64 with
``torch.softmax``; no layout math, no engine, no store.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dcpsim.model.kinds import Retention, Storage
from dcpsim.verify.geometry import ExpectedGroup

_LOG2E = 1.0 / math.log(2.0)
_NEG_INF = float("-inf")


def context_keys(group: ExpectedGroup, start: int, stop: int) -> int:
    """Keys the last query token of ``[start, stop)`` can see at most (cost estimate)."""
    if group.storage is Storage.RECORDS:
        return stop // group.tokens_per_state
    if group.retention is Retention.WINDOW:
        return min(stop, group.sliding_window + stop - start)
    if group.retention is Retention.CHUNK:
        return min(stop, group.attention_chunk_size + stop - start)
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


def reference_context(group: ExpectedGroup, start: int, stop: int, rows=None):
    """The full context of query positions ``start + rows``: ``(emit_positions, mask)``.

    ``emit_positions[i]`` is the position whose content key ``i`` carries (the position
    itself, or the emitting position of a record); ``mask`` is ``[len(rows), n]``.
    """
    positions = np.arange(start, stop, dtype=np.int64)
    if rows is not None:
        positions = positions[np.asarray(rows, dtype=np.int64)]
    first, last = int(positions.min(initial=start)), int(positions.max(initial=start - 1))
    if group.storage is Storage.RECORDS:
        R = group.tokens_per_state
        emit = np.arange(R - 1, last + 1, R, dtype=np.int64)  # records emitted up to the last query
        return emit, emit[None, :] <= positions[:, None]
    if group.retention is Retention.WINDOW:
        w = group.sliding_window
        keys = np.arange(max(0, first - w + 1), last + 1, dtype=np.int64)
        mask = (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - w)
    elif group.retention is Retention.CHUNK:
        c = group.attention_chunk_size
        keys = np.arange(first - first % c, last + 1, dtype=np.int64)
        mask = (keys[None, :] <= positions[:, None]) & (keys[None, :] // c == positions[:, None] // c)
    else:
        keys = np.arange(last + 1, dtype=np.int64)
        mask = keys[None, :] <= positions[:, None]
    return keys, mask


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                        scale: float, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64, natural logits (``torch.softmax``); the LSE is converted
    to ``base`` at the end. ``q [nq, H, dk]``, ``k [n, dk]``, ``v [n, dv]``, ``mask [nq, n]``.
    A row that sees nothing: ``O = 0``, ``lse = -inf``."""
    q, k, v = q.double(), k.double(), v.double()
    nq, H, _ = q.shape
    n, dv = v.shape
    if nq == 0 or n == 0:
        return q.new_zeros((nq, H, dv)), q.new_full((nq, H), _NEG_INF)
    logits = torch.matmul(q.transpose(0, 1).contiguous(), k.t().contiguous()).mul_(scale)  # [H, nq, n]
    logits.masked_fill_(~mask.unsqueeze(0), _NEG_INF)
    weights = torch.softmax(logits, dim=-1)
    # the weight of the largest logit m is exp(m - lse) >= 1/n: lse = m - log(that weight)
    lse = logits.amax(dim=-1) - torch.log(weights.amax(dim=-1))
    empty = ~mask.any(dim=1)
    if empty.any():
        weights[:, empty] = 0.0  # softmax of a row of -inf is NaN
        lse[:, empty] = _NEG_INF
    o = torch.matmul(weights, v).permute(1, 0, 2)  # [nq, H, dv]
    if base == "2":
        lse = lse * _LOG2E
    return o, lse.transpose(0, 1)


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
