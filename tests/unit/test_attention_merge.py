"""The LSE merge and the attention math, alone (``dcpsim.attention.merge`` / ``compute``).

Attention over a context split into shards, merged with ``merge_attention_states``,
must equal attention over the whole context, computed here by a brute-force float64
softmax (numpy, one query and head at a time). Shards may be empty; base 2 must give
the same output and ``lse / ln 2``; NaN and +inf LSEs count as -inf; a zero factor never
turns a NaN output into NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.attention.compute import (
    attend,
    context_keys,
    reference_attention,
    select_queries,
    state_error,
)
from dcpsim.attention.merge import merge_attention_states, merge_lse, sanitize_lse, scale_output
from dcpsim.attention.vectors import kv_vectors, query_vectors, uniform_rows
from dcpsim.faults import EmptyShardLseZero, Fault, MultiTokenLocalLens
from dcpsim.layout import local_seq_lens

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


def split_attention(q, k, v, mask, owner, W, scale, base):
    """Each shard attends over the keys it owns (``owner[j]``); stacked [W, ...] results."""
    outs, lses = [], []
    for r in range(W):
        mine = np.nonzero(owner == r)[0]
        o, l = attend(q, k[mine], v[mine], mask[:, mine], scale=scale, base=base)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def random_problem(rng, nq, n, H, dk=8, dv=6, causal=True):
    q = torch.from_numpy(rng.standard_normal((nq, H, dk)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((n, dk)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((n, dv)).astype(np.float32))
    if causal:  # query i sees keys < n - nq + i + 1 (the last query sees everything)
        mask = np.arange(n)[None, :] < (n - nq + 1 + np.arange(nq))[:, None]
    else:
        mask = rng.random((nq, n)) < 0.7
    return q, k, v, torch.from_numpy(mask)


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


# ----------------------------------------------------------------------------- helpers


def test_state_error():
    o = torch.zeros((1, 2, 3))
    lse = torch.tensor([[NEG_INF, 1.0]])
    assert torch.equal(state_error(o, lse, o, lse), torch.zeros((1, 2), dtype=torch.float64))
    err = state_error(o, torch.tensor([[0.0, 1.0]]), o, lse)
    assert err[0, 0] == float("inf") and err[0, 1] == 0
    err = state_error(torch.full((1, 2, 3), float("nan")), lse, o, lse)
    assert (err == float("inf")).all()


def test_vectors_are_deterministic_and_content_sensitive():
    a = kv_vectors(1, np.array([5, 6, -7]), 32)
    assert a.dtype == np.float32 and a.shape == (3, 32)
    assert np.array_equal(a, kv_vectors(1, np.array([5, 6, -7]), 32))
    assert not np.array_equal(a[0], kv_vectors(1, np.array([8]), 32)[0])  # other content
    assert not np.array_equal(a[0], kv_vectors(2, np.array([5]), 32)[0])  # other group
    assert np.abs(a).max() <= math.sqrt(3.0)
    big = uniform_rows(np.arange(20000, dtype=np.uint64), 16)
    assert abs(float(big.mean())) < 0.02 and abs(float(big.var()) - 1.0) < 0.02
    long = kv_vectors(0, np.arange(40000), 8)  # hashed in blocks: same as one at a time
    assert np.array_equal(long[[0, 17000, 39999]], kv_vectors(0, np.array([0, 17000, 39999]), 8))
    q = query_vectors(0, 3, np.array([10, 11]), np.array([5, 5]), 4, 8)
    assert q.shape == (2, 4, 8)
    assert not np.array_equal(q[0], q[1])  # position matters
    assert not np.array_equal(q, query_vectors(0, 4, np.array([10, 11]), np.array([5, 5]), 4, 8))


def test_multi_token_local_lens_fault_bounds():
    """Semantics section 8, bug 3: local(L) - k differs from per-token bounds under interleaving."""
    H, q, W, I = 100, 4, 2, 16
    lens = H + 1 + np.arange(q)
    for r in range(W):
        right = local_seq_lens(lens, dcp_size=W, interleave_size=I, dcp_rank=r)
        assert np.array_equal(Fault().query_local_bounds(right, lens, dcp_size=W, dcp_rank=r, interleave_size=I), right)
        wrong = MultiTokenLocalLens().query_local_bounds(right, lens, dcp_size=W, dcp_rank=r, interleave_size=I)
        assert wrong[-1] == right[-1]
        if r == 1:  # positions 100..103 all live on rank 0: rank 1 must see 48 keys for every token
            assert list(right) == [48] * 4 and list(wrong) == [45, 46, 47, 48]


def test_query_selection():
    assert np.array_equal(select_queries(256, 1900, 2**20), np.arange(256))
    rows = select_queries(16384, 262144, 2**20)
    assert len(rows) == 8 and rows[0] == 0 and rows[-1] == 16383
    rows = select_queries(16384, 16384, 2**20)
    assert len(rows) == 64 and np.array_equal(rows[:16], np.arange(16))
    assert np.all(np.diff(rows) > 0)


def test_context_keys():
    from dcpsim.scenario_file import load_scenario
    from dcpsim.simulation import build_layouts

    swa, records, paged, ring = build_layouts(load_scenario("dsv41-hybrid"))
    assert context_keys(swa, 1000, 1004) == 128 + 4
    assert context_keys(records, 1000, 1004) == 502
    assert context_keys(paged, 1000, 1004) == 1004
