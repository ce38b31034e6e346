"""The engine's attention over query slices (``compute.CHUNK_LOGITS``): a call whose logits
exceed the slice size computes its query tokens a slice at a time, each row as in one call
(against the float64 brute force, rows that see nothing included, both LSE bases)."""

from __future__ import annotations

import numpy as np
import pytest

import dcpsim.engine.attention.compute as compute
from support.attention_problems import LN2, brute_force, random_problem


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("chunk", [1, 40, 1 << 20])
def test_sliced_queries_equal_the_brute_force(base, chunk, monkeypatch):
    monkeypatch.setattr(compute, "CHUNK_LOGITS", chunk)
    rng = np.random.default_rng(11)
    q, k, v, mask = random_problem(rng, nq=13, n=9, H=3, causal=False)
    mask[4] = False  # a row that sees no key
    o, lse = compute.attend(q, k, v, mask, scale=0.8, base=base)
    want_o, want_lse = brute_force(q, k, v, mask.numpy(), 0.8)
    if base == "2":
        want_lse = want_lse / LN2
    assert o.shape == want_o.shape and lse.shape == want_lse.shape
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse))
    assert np.allclose(o.numpy(), want_o, atol=1e-5) and np.allclose(lse.numpy(), want_lse, atol=1e-5)


def test_a_rank_without_heads_gets_empty_results():
    """More ranks than heads: a rank's slice of a replicated group's heads can be empty."""
    rng = np.random.default_rng(3)
    q, k, v, mask = random_problem(rng, nq=5, n=7, H=2)
    o, lse = compute.attend(q[:, :0], k, v, mask, scale=1.0)
    assert o.shape == (5, 0, v.shape[1]) and lse.shape == (5, 0)
