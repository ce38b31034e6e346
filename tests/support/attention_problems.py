"""Random attention problems and a brute-force float64 softmax, shared by the tests of the
engine's attention (``tests/unit/engine/attention``) and of the checker's reference
(``tests/unit/verify/test_attention_reference.py``). Imported as ``support.attention_problems``."""

from __future__ import annotations

import math

import numpy as np
import torch

NEG_INF = float("-inf")
LN2 = math.log(2.0)


def brute_force(q, k, v, mask, scale):
    """float64 softmax attention, one (query, head) at a time: (O [nq, H, dv], lse [nq, H])."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, H, _ = q.shape
    out = np.zeros((nq, H, v.shape[1]))
    lse = np.full((nq, H), NEG_INF)
    for i in range(nq):
        seen = np.nonzero(mask[i])[0]
        for h in range(H):
            if len(seen) == 0:
                continue
            s = np.array([scale * float(q[i, h] @ k[j]) for j in seen])
            m = s.max()
            w = np.exp(s - m)
            lse[i, h] = m + math.log(w.sum())
            out[i, h] = (w[:, None] * v[seen]).sum(axis=0) / w.sum()
    return out, lse


def random_problem(rng, nq, n, H, dk=8, dv=6, causal=True):
    q = torch.from_numpy(rng.standard_normal((nq, H, dk)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((n, dk)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((n, dv)).astype(np.float32))
    if causal:  # query i sees keys < n - nq + i + 1 (the last query sees everything)
        mask = np.arange(n)[None, :] < (n - nq + 1 + np.arange(nq))[:, None]
    else:
        mask = rng.random((nq, n)) < 0.7
    return q, k, v, torch.from_numpy(mask)
