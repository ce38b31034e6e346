"""The checker's attention reference on its own (``dcpsim.verify.attention_reference``):
the float64 softmax against a brute force, the error measure, the choice of query tokens
of huge chunks, and the context size per kind of group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcpsim.scenarios.load import load_scenario
from dcpsim.verify.attention_reference import context_keys, reference_attention, select_queries, state_error
from dcpsim.verify.geometry import expected_groups
from support.attention_problems import LN2, NEG_INF, brute_force, random_problem


@pytest.mark.parametrize("base", ["e", "2"])
def test_reference_matches_brute_force(base):
    rng = np.random.default_rng(2)
    q, k, v, mask = random_problem(rng, nq=4, n=17, H=2, causal=False)
    mask[0] = False
    o, l = reference_attention(q, k, v, mask, scale=0.9, base=base)
    bo, bl = brute_force(q, k, v, mask.numpy(), 0.9)
    if base == "2":
        bl = bl / LN2
    assert o.dtype == torch.float64
    assert np.allclose(o.numpy(), bo, atol=1e-12)
    assert np.allclose(l.numpy(), bl, atol=1e-12)


def test_state_error():
    o = torch.zeros((1, 2, 3))
    lse = torch.tensor([[NEG_INF, 1.0]])
    assert torch.equal(state_error(o, lse, o, lse), torch.zeros((1, 2), dtype=torch.float64))
    err = state_error(o, torch.tensor([[0.0, 1.0]]), o, lse)
    assert err[0, 0] == float("inf") and err[0, 1] == 0
    err = state_error(torch.full((1, 2, 3), float("nan")), lse, o, lse)
    assert (err == float("inf")).all()


def test_query_selection():
    assert np.array_equal(select_queries(256, 1900, 2**20), np.arange(256))
    rows = select_queries(16384, 262144, 2**20)
    assert len(rows) == 8 and rows[0] == 0 and rows[-1] == 16383
    rows = select_queries(16384, 16384, 2**20)
    assert len(rows) == 64 and np.array_equal(rows[:16], np.arange(16))
    assert np.all(np.diff(rows) > 0)


def test_context_keys():
    swa, records, paged, ring = expected_groups(load_scenario("dsv41-hybrid"))
    assert context_keys(swa, 1000, 1004) == 128 + 4
    assert context_keys(records, 1000, 1004) == 502
    assert context_keys(paged, 1000, 1004) == 1004
