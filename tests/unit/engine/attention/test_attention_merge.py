"""The engine's attention math and LSE merge, alone (``dcpsim.engine.attention.compute`` /
``merge``).

Attention over a context split into shards, merged with ``merge_attention_states``,
must equal attention over the whole context, computed here by a brute-force float64
softmax (numpy, one query and head at a time). Shards may be empty; base 2 must give
the same output and ``lse / ln 2``; NaN and +inf LSEs count as -inf; a zero factor never
turns a NaN output into NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.engine.attention.compute import attend
from dcpsim.engine.attention.merge import merge_attention_states, merge_lse, sanitize_lse, scale_output
from dcpsim.engine.faults import Fault
from dcpsim.engine.faults.attention import EmptyShardLseZero
from dcpsim.verify.attention_reference import state_error
from support.attention_problems import LN2, NEG_INF, brute_force, random_problem


def split_attention(q, k, v, mask, owner, W, scale, base):
    """Each shard attends over the keys it owns (``owner[j]``); stacked [W, ...] results."""
    outs, lses = [], []
    for r in range(W):
        mine = np.nonzero(owner == r)[0]
        o, l = attend(q, k[mine], v[mine], mask[:, mine], scale=scale, base=base)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


# ----------------------------------------------------------------------------- attend


@pytest.mark.parametrize("base", ["e", "2"])
def test_attend_matches_brute_force(base):
    rng = np.random.default_rng(1)
    q, k, v, mask = random_problem(rng, nq=5, n=23, H=3, causal=False)
    mask[2] = False  # a row that sees nothing
    o, l = attend(q, k, v, mask, scale=0.7, base=base)
    bo, bl = brute_force(q, k, v, mask.numpy(), 0.7)
    if base == "2":
        bl = bl / LN2
    assert np.allclose(o.numpy(), bo, atol=1e-5)
    assert np.allclose(l.numpy(), bl, atol=1e-5)  # -inf == -inf counts as close
    assert (o[2] == 0).all() and (l[2] == NEG_INF).all()


def test_attend_without_keys():
    q = torch.zeros((3, 2, 4))
    o, l = attend(q, torch.zeros((0, 4)), torch.zeros((0, 5)), torch.zeros((3, 0), dtype=torch.bool), scale=1.0)
    assert o.shape == (3, 2, 5) and (o == 0).all() and (l == NEG_INF).all()


# ----------------------------------------------------------------------------- merge


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_merge_equals_full_context(base, W):
    rng = np.random.default_rng(W)
    q, k, v, mask = random_problem(rng, nq=6, n=40, H=4)
    owner = rng.integers(0, W, size=40)
    outs, lses = split_attention(q, k, v, mask, owner, W, 0.5, base)
    o, l = merge_attention_states(outs, lses, base=base)
    bo, bl = brute_force(q, k, v, mask.numpy(), 0.5)
    if base == "2":
        bl = bl / LN2
    assert np.abs(o.numpy() - bo).max() < 1e-5
    assert np.abs(l.numpy() - bl).max() < 1e-5


def test_base_2_gives_the_same_output_and_lse_over_ln2():
    rng = np.random.default_rng(7)
    q, k, v, mask = random_problem(rng, nq=4, n=30, H=2)
    owner = np.arange(30) % 3
    oe, le = merge_attention_states(*split_attention(q, k, v, mask, owner, 3, 0.8, "e"), base="e")
    o2, l2 = merge_attention_states(*split_attention(q, k, v, mask, owner, 3, 0.8, "2"), base="2")
    assert torch.allclose(oe, o2, atol=1e-5)
    assert torch.allclose(le / LN2, l2, atol=1e-5)
    # and mixing them up is wrong: base-2 LSEs merged as natural ones
    owner = np.where(np.arange(30) < 10, 0, 1)
    o_bad, _ = merge_attention_states(*split_attention(q, k, v, mask, owner, 2, 0.8, "2"), base="e")
    assert (o_bad - oe).abs().max() > 1e-3


def test_empty_shards_and_all_empty():
    rng = np.random.default_rng(3)
    q, k, v, mask = random_problem(rng, nq=3, n=12, H=2)
    owner = np.full(12, 2)  # shards 0, 1 and 3 are empty, shard 2 holds everything
    outs, lses = split_attention(q, k, v, mask, owner, 4, 1.0, "e")
    assert (lses[[0, 1, 3]] == NEG_INF).all()
    o, l = merge_attention_states(outs, lses)
    assert torch.allclose(o, outs[2]) and torch.allclose(l, lses[2])
    # every shard empty: O = 0, lse = -inf, never NaN
    outs = torch.full((3, 2, 4, 5), float("nan"))
    lses = torch.full((3, 2, 4), NEG_INF)
    for base in ("e", "2"):
        o, l = merge_attention_states(outs, lses, base=base)
        assert (o == 0).all() and (l == NEG_INF).all()


def test_an_empty_shard_reporting_lse_zero_corrupts_the_merge():
    """Semantics section 8, bug 4: why the merge needs -inf for an empty shard."""
    rng = np.random.default_rng(4)
    q, k, v, mask = random_problem(rng, nq=2, n=10, H=2)
    outs, lses = split_attention(q, k, v, mask, np.zeros(10, dtype=np.int64), 2, 1.0, "e")
    assert (lses[1] == NEG_INF).all()  # shard 1 holds no key
    good, _ = merge_attention_states(outs, lses)
    empty = torch.tensor([True, True])
    assert torch.equal(Fault().shard_lse(lses[1], empty), lses[1])
    faulty = lses.clone()
    faulty[1] = EmptyShardLseZero().shard_lse(lses[1], empty)
    assert (faulty[1] == 0).all()
    bad, _ = merge_attention_states(outs, faulty)
    assert (bad - good).abs().max() > 1e-2


def test_nan_and_plus_inf_lse_count_as_minus_inf():
    lses = torch.tensor([[0.5], [float("nan")], [float("inf")], [NEG_INF]])
    outs = torch.tensor([[[1.0, 2.0]], [[float("nan"), 7.0]], [[float("inf"), 3.0]], [[float("nan"), 1.0]]])
    assert torch.equal(sanitize_lse(lses), torch.tensor([[0.5], [NEG_INF], [NEG_INF], [NEG_INF]]))
    o, l = merge_attention_states(outs, lses)
    assert torch.equal(o, torch.tensor([[1.0, 2.0]]))  # the bad shards weigh exactly 0: no NaN
    assert torch.allclose(l, torch.tensor([0.5]))
    lse, factors = merge_lse(lses)
    assert torch.equal(factors[1:], torch.zeros((3, 1)))


def test_zero_factor_never_makes_nan():
    out = torch.tensor([[float("nan"), float("inf")]])
    assert torch.equal(scale_output(out, torch.tensor([0.0])), torch.zeros((1, 2)))
    assert torch.isnan(scale_output(out, torch.tensor([0.5]))).any()  # a real NaN still shows


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        merge_attention_states(torch.zeros((2, 3, 4)), torch.zeros((2, 4)))


@settings(max_examples=60, deadline=None)
@given(
    W=st.integers(1, 6),
    n=st.integers(0, 30),
    nq=st.integers(1, 4),
    H=st.integers(1, 3),
    base=st.sampled_from(["e", "2"]),
    seed=st.integers(0, 2**32 - 1),
    scale=st.floats(0.05, 3.0),
)
def test_merge_property(W, n, nq, H, base, seed, scale):
    """Any split of any (causal or random) mask, with empty shards, merges to the full result."""
    rng = np.random.default_rng(seed)
    q, k, v, mask = random_problem(rng, nq=nq, n=n, H=H, causal=bool(seed % 2))
    owner = rng.integers(0, W, size=n)
    outs, lses = split_attention(q, k, v, mask, owner, W, scale, base)
    o, l = merge_attention_states(outs, lses, base=base)
    bo, bl = brute_force(q, k, v, mask.numpy(), scale)
    if base == "2":
        bl = bl / LN2
    assert not torch.isnan(o).any()
    err = state_error(o, l, torch.from_numpy(bo), torch.from_numpy(bl))
    assert float(err.max()) < 1e-4
