"""The engine's attention math on one rank: float32, in the configured LSE base.

``attend`` computes softmax attention of query tokens over the keys a rank reads from its
own KV store (``Engine.attention_metadata`` says which, with which mask). The checker's
float64 full-context reference is ``dcpsim.verify.attention_reference``, written apart.
"""

from __future__ import annotations

import math

import torch

_LOG2E = 1.0 / math.log(2.0)
_NEG_INF = float("-inf")


def _masked_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``[nq, H, n]`` logits ``scale * q . k`` plus -inf where ``mask`` is False: one GEMM of
    every (token, head) row against the single KV head, read in place (``k`` may be a strided
    view of the store's rows: BLAS takes its transpose as it lies, no copy)."""
    nq, H, dk = q.shape
    n = k.shape[0]
    bias = torch.zeros((nq, 1, n), dtype=q.dtype).masked_fill_(~mask.unsqueeze(1), _NEG_INF)
    s = torch.mm(q.reshape(nq * H, dk), k.t()).view(nq, H, n)
    return s.mul_(scale).add_(bias)  # added, not filled: a NaN logit stays NaN under the mask


CHUNK_LOGITS = 1 << 20
"""Logits (4 MiB of float32) computed at a time: ``attend`` over more runs its query tokens in
slices of about this many, which keeps them in cache instead of a fresh allocation per call
(a 512-token chunk over 2,048 keys: 22 ms instead of 38 ms). Each query token's row is
computed alike either way."""


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's attention: ``q [nq, H, dk]``, ``k [n, dk]``, ``v [n, dv]``, ``mask [nq, n]``.

    Returns ``(O [nq, H, dv], lse [nq, H])`` in the dtype of ``q``; a row that sees no key
    gets ``O = 0`` and ``lse = -inf``. ``base="2"`` works in base 2 like flash kernels:
    logits times log2(e), exp2, log2. (Max-subtracted exponentials, then a division.)
    """
    nq, H, _ = q.shape
    n, dv = v.shape
    if nq == 0 or n == 0:
        return q.new_zeros((nq, H, dv)), q.new_full((nq, H), _NEG_INF)
    step = max(1, CHUNK_LOGITS // max(1, H * n))  # a rank may hold no head (H = 0)
    if step >= nq:
        return _attend_rows(q, k, v, mask, scale, base)
    o, lse = q.new_empty((nq, H, dv)), q.new_empty((nq, H))
    for a in range(0, nq, step):
        o[a : a + step], lse[a : a + step] = _attend_rows(q[a : a + step], k, v, mask[a : a + step], scale, base)
    return o, lse


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, base: str):
    """``attend`` of some query tokens at once (``n > 0``): token-major ``[nq, H, n]`` logits,
    so that the output and the LSE come out in the caller's layout without a transpose."""
    nq, H = q.shape[:2]
    n, dv = v.shape
    s = _masked_logits(q, k, mask, scale if base == "e" else scale * _LOG2E)  # [nq, H, n]
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
    s.sub_(m)
    if base == "e":
        s.exp_()
    else:
        s.exp2_()
    denom = s.sum(dim=-1)  # [nq, H]
    o = torch.mm(s.view(nq * H, n), v).view(nq, H, dv) / denom.unsqueeze(-1)
    o = torch.where((denom == 0).unsqueeze(-1), torch.zeros_like(o), o)  # NaN stays NaN
    lse = m.squeeze(-1) + (torch.log(denom) if base == "e" else torch.log2(denom))
    return o, lse
