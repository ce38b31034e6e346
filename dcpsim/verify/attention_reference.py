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


def key_range(group: ExpectedGroup, positions: np.ndarray) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that query ``positions`` (non-empty) can see, in the group's key
    order: a key is a position (paged groups) or a record index (record ``c`` is emitted
    at ``(c + 1) * R - 1``). Always one contiguous range."""
    first, last = int(positions.min()), int(positions.max())
    if group.storage is Storage.RECORDS:
        return 0, (last + 1) // group.tokens_per_state  # records emitted up to the last query
    if group.retention is Retention.WINDOW:
        return max(0, first - group.sliding_window + 1), last + 1
    if group.retention is Retention.CHUNK:
        return first - first % group.attention_chunk_size, last + 1
    return 0, last + 1


def keys_before(group: ExpectedGroup, position: int) -> int:
    """Keys emitted at positions ``< position``: those holding the request's committed contents."""
    return position // group.tokens_per_state if group.storage is Storage.RECORDS else position


def emit_positions(group: ExpectedGroup, keys: np.ndarray) -> np.ndarray:
    """The position whose content each key carries."""
    return (keys + 1) * group.tokens_per_state - 1 if group.storage is Storage.RECORDS else keys


def key_mask(group: ExpectedGroup, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``[len(positions), len(keys)]``: which keys each query position sees."""
    emit, p = emit_positions(group, keys)[None, :], positions[:, None]
    mask = emit <= p
    if group.storage is Storage.RECORDS:
        return mask
    if group.retention is Retention.WINDOW:
        mask &= emit > p - group.sliding_window
    elif group.retention is Retention.CHUNK:
        c = group.attention_chunk_size
        mask &= emit // c == p // c
    return mask


def block_mask(group: ExpectedGroup, lo: int, hi: int, positions: np.ndarray) -> np.ndarray | None:
    """``key_mask`` of keys ``[lo, hi)``, or None when every query position sees all of them
    (a block of the history of a full-attention or records group): no mask to build or apply."""
    first, last = int(positions.min()), int(positions.max())
    e0, e1 = (int(e) for e in emit_positions(group, np.array([lo, hi - 1])))
    visible = e1 <= first
    if group.storage is not Storage.RECORDS:
        if group.retention is Retention.WINDOW:
            visible &= e0 > last - group.sliding_window
        elif group.retention is Retention.CHUNK:
            c = group.attention_chunk_size
            visible &= e0 // c == last // c
    return None if visible else key_mask(group, np.arange(lo, hi, dtype=np.int64), positions)


def check_step(step: int, keys: int, budget: int, *, first: bool, last: bool) -> bool:
    """Whether a step's write of a request is checked in a group (``max_step_keys``): always
    while its reference reads at most ``budget`` keys (``context_keys``), and on the
    request's first and last step; beyond the budget, on every ``ceil(keys / budget)``-th
    step (``step % stride == 0``). Plan data only, so every rank decides alike; the keys
    read per checked (group, request), averaged over its steps, stay near the budget."""
    if keys <= budget or first or last:
        return True
    return step % -(-keys // budget) == 0


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, scale: float, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64, natural logits; the LSE is converted to ``base`` at the
    end. ``q [nq, H, dk]``, ``k [n, dk]``, ``v [n, dv]``, ``mask [nq, n]`` (None: every
    query sees every key). With ``m`` the row's largest logit, ``e = exp(logits - m)``:
    ``O = (e @ v) / sum(e)``, ``lse = m + log(sum(e))``. A row that sees nothing: ``O = 0``,
    ``lse = -inf``. (``batched_reference_attention`` of one problem.)"""
    o, lse = batched_reference_attention(q[None], k[None], v[None], None if mask is None else mask[None], scale=scale, base=base)
    return o[0], lse[0]


CHUNK_LOGITS = 1 << 19
"""Logits (4 MiB of float64) computed at a time: a call over more runs its query tokens in
slices of about this many logits (``batched_reference_attention``), which keeps them in
cache instead of a fresh allocation of up to 64 MiB per call (measured: a 512-token chunk
over 2,048 keys in 54 ms instead of 97 ms)."""


def batched_reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, scale: float, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_attention`` of ``B`` independent problems in one call: ``q [B, nq, H, dk]``,
    ``k [B, n, dk]``, ``v [B, n, dv]``, ``mask [B, nq, n]`` (None: every query of a problem
    sees all its keys) give ``(O [B, nq, H, dv], lse [B, nq, H])``. The logits of a problem's
    queries and heads are one GEMM ``[nq * H, dk] @ [dk, n]`` (over slices of the query
    tokens when there are more than ``CHUNK_LOGITS``); a problem's queries see only its own
    keys."""
    q, v = q.double(), v.double()
    B, nq, H, dk = q.shape
    n, dv = v.shape[1], v.shape[2]
    if B == 0 or nq == 0 or n == 0:
        return q.new_zeros((B, nq, H, dv)), q.new_full((B, nq, H), _NEG_INF)
    kt = k.transpose(1, 2).double()
    if kt.stride(-1) != 1:  # a view of a cache of K^T (the checker's history) is used as it is
        kt = kt.contiguous()
    step = max(1, CHUNK_LOGITS // max(1, B * H * n))
    if step >= nq:
        o, lse = _softmax_rows(q, kt, v, mask, scale)
    else:
        o, lse = q.new_empty((B, nq, H, dv)), q.new_empty((B, nq, H))
        for a in range(0, nq, step):
            b = min(a + step, nq)
            o[:, a:b], lse[:, a:b] = _softmax_rows(q[:, a:b], kt, v, None if mask is None else mask[:, a:b], scale)
    if base == "2":
        lse = lse * _LOG2E
    return o, lse


def _softmax_rows(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """The float64 softmax of ``batched_reference_attention`` with ``kt [B, dk, n]``: natural LSE.
    With ``m`` the row's largest logit, ``e = exp(logits - m)``: ``O = (e @ v) / sum(e)``,
    ``lse = m + log(sum(e))``; a row that sees nothing: ``O = 0``, ``lse = -inf``."""
    B, nq, H, dk = q.shape
    n, dv = v.shape[1], v.shape[2]
    logits = torch.matmul(q.reshape(B, nq * H, dk), kt).mul_(scale)  # [B, nq * H, n], query-major
    if mask is not None:
        logits.view(B, nq, H, n).masked_fill_(~mask.unsqueeze(2), _NEG_INF)
    m = logits.amax(dim=-1, keepdim=True)
    m.masked_fill_(torch.isneginf(m), 0.0)  # a row that sees nothing: its weights are exp(-inf) = 0
    weights = logits.sub_(m).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(total)).view(B, nq, H)  # log(0) = -inf for a row that sees nothing
    o = torch.matmul(weights, v).div_(total.masked_fill(total == 0, 1.0)).view(B, nq, H, dv)
    return o, lse


KEY_BLOCK = 1 << 13
"""Keys per block of the reference (``blocked_reference_attention``), the unit dealt to the
ranks: small enough that a 64K context spreads over 8 ranks, and that the float64 logits
and copies of a block stay at a few MiB whatever the context (1M keys: 128 blocks)."""


def blocked_reference_attention(q: torch.Tensor, blocks, *, scale: float, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_attention`` over disjoint key blocks ``(k [n_b, dk], v [n_b, dv], mask
    [nq, n_b] or None)``: each block's float64 softmax, then the blocks combined by their
    LSEs, ``O = sum_b exp(lse_b - lse) O_b`` with ``lse = logsumexp_b lse_b``. One block is
    exactly ``reference_attention``."""
    if len(blocks) == 1:
        k, v, mask = blocks[0]
        return reference_attention(q, k, v, mask, scale=scale, base=base)
    parts = [reference_attention(q, k, v, mask, scale=scale) for k, v, mask in blocks]
    return merge_by_lse(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]), base=base)


PACK_OVERHEAD = 1 << 12
"""Logits (query rows x heads x keys) that one call's fixed cost is worth, about: a problem
joins a padded call when the keys it pads cost no more than a call of its own
(``reference_attention_many``)."""

PACK_LOGITS = 1 << 22
"""At most this many logits (32 MiB of float64) in one padded call of several problems."""


def reference_attention_many(problems, *, scale: float, base: str = "e") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``blocked_reference_attention`` of each problem ``(q [nq, H, dk], blocks)`` (blocks as
    there: disjoint ``(k, v, mask or None)``, at least one), in few calls: a problem of at most
    ``KEY_BLOCK`` keys has its blocks concatenated, and problems of one shape (``nq``, ``H``,
    widths) share a ``batched_reference_attention`` call, their keys padded to the call's
    longest with masked keys; a problem joins a call while the keys it pads are worth less
    than a call (``PACK_OVERHEAD``) and the call's logits stay within ``PACK_LOGITS``. Longer
    problems run block by block (views of the history, no copy). Results equal each
    problem's own call to float64 rounding: padding keys are masked, and a problem's queries
    see only its own keys."""
    out: list = [None] * len(problems)
    shapes: dict[tuple, list[tuple[int, int]]] = {}
    for i, (q, blocks) in enumerate(problems):
        n = sum(int(k.shape[0]) for k, _, _ in blocks)
        if n > KEY_BLOCK:
            out[i] = blocked_reference_attention(q, blocks, scale=scale, base=base)
        else:
            shapes.setdefault((*q.shape, blocks[0][1].shape[1]), []).append((i, n))
    for (nq, H, dk, dv), members in shapes.items():
        members.sort(key=lambda m: -m[1])  # longest first: the first of a call sets its length
        row, at = nq * H, 0
        while at < len(members):
            longest, end = members[at][1], at + 1
            while (
                end < len(members) and (longest - members[end][1]) * row <= PACK_OVERHEAD and (end - at + 1) * row * longest <= PACK_LOGITS
            ):
                end += 1
            batch = [problems[i] for i, _ in members[at:end]]
            o, lse = _padded_call(batch, longest, dk, dv, scale=scale, base=base)
            for b, (i, _) in enumerate(members[at:end]):
                out[i] = (o[b], lse[b])
            at = end
    return out


def _padded_call(batch, n: int, dk: int, dv: int, *, scale: float, base: str):
    """One ``batched_reference_attention`` call of problems of one shape, each one's blocks
    concatenated and its keys padded to ``n`` (masked)."""
    B, nq = len(batch), batch[0][0].shape[0]
    k, v = np.zeros((B, n, dk)), np.zeros((B, n, dv))
    mask = np.zeros((B, nq, n), dtype=bool)
    whole = True  # every query sees every key of the call: no mask to apply
    for b, (_, blocks) in enumerate(batch):
        at = 0
        for kb, vb, mb in blocks:
            m = kb.shape[0]
            k[b, at : at + m], v[b, at : at + m] = kb.numpy(), vb.numpy()
            mask[b, :, at : at + m] = True if mb is None else np.asarray(mb)
            whole &= mb is None
            at += m
        whole &= at == n
    q = torch.stack([q for q, _ in batch])
    return batched_reference_attention(
        q, torch.from_numpy(k), torch.from_numpy(v), None if whole else torch.from_numpy(mask), scale=scale, base=base
    )


def merge_by_lse(outs: torch.Tensor, lses: torch.Tensor, *, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over disjoint key sets, combined: ``outs [P, nq, H, dv]`` and natural
    ``lses [P, nq, H]`` of the ``P`` parts give ``O = sum_p exp(lse_p - lse) O_p`` with
    ``lse = logsumexp_p lse_p`` (converted to ``base``). A row no part sees: ``O = 0``,
    ``lse = -inf``."""
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).masked_fill_(torch.isneginf(lse), 0.0)
    o = (weights.unsqueeze(-1) * outs).sum(dim=0)
    if base == "2":
        lse = lse * _LOG2E
    return o, lse


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
