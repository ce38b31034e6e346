"""The checker's reference over a whole step (``attention_reference.reference_attention_many``):
every (group, request) problem of random mixed steps, solved in shared padded calls, equals
that request's own float64 attention computed here one request at a time (numpy, the group's
full mask over the request's key range), to float64 rounding. Requests of different lengths
share calls, so a key, a mask row or a padding key of one request that reached another's
queries would show."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dcpsim.verify.attention_reference as ref
from dcpsim.scenarios.load import load_scenario
from dcpsim.verify.attention_reference import block_mask, key_mask, key_range, keys_before, reference_attention_many
from dcpsim.verify.geometry import expected_groups

H, DK, DV, SCALE = 2, 8, 6, 0.7
LN2 = float(np.log(2.0))


def _groups():
    """Full attention, a sliding window, compressed records and chunked local groups."""
    swa, records, full, _ = expected_groups(load_scenario("dsv41-hybrid"))
    chunk = next(g for g in expected_groups(load_scenario("llama4-chunked")) if g.attention_chunk_size)
    return [full, swa, records, chunk]


def _own(q, k, v, mask):
    """One request's float64 softmax attention (numpy): ``(O [nq, H, dv], natural lse [nq, H])``."""
    logits = SCALE * np.einsum("qhd,nd->qhn", q, k)
    logits = np.where(mask[:, None, :], logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(logits - m)
    total = e.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(total[..., None] > 0, np.einsum("qhn,nd->qhd", e, v) / total[..., None], 0.0)
        lse = m[..., 0] + np.log(total)
    return out, lse


def _random_request(rng, group):
    """A request's checked write in ``group``: its query positions, its problem as the checker
    builds it (history keys, then the step's keys; each block's mask, None when every query
    sees it), and the oracle's inputs (K, V, full mask over its key range)."""
    start = int(rng.integers(0, 3000))
    nq = int(rng.choice([1, 1, 1, 2, 4, 4, 37]))
    rows = np.sort(rng.choice(nq + int(rng.integers(0, 3)), size=nq, replace=False))  # some tokens not checked (sampled)
    positions = start + rows
    lo, hi = key_range(group, positions)
    split = min(max(keys_before(group, start), lo), hi)
    k = rng.standard_normal((hi - lo, DK))
    v = rng.standard_normal((hi - lo, DV))
    q = torch.from_numpy(rng.standard_normal((nq, H, DK)).astype(np.float32))
    blocks = []
    for a, b in ((lo, split), (split, hi)):
        if a < b:
            mask = block_mask(group, a, b, positions)
            blocks.append(
                (
                    torch.from_numpy(k[a - lo : b - lo]),
                    torch.from_numpy(v[a - lo : b - lo]),
                    None if mask is None else torch.from_numpy(mask),
                )
            )
    if not blocks:
        blocks.append((torch.zeros((0, DK)), torch.zeros((0, DV)), None))
    full = key_mask(group, np.arange(lo, hi, dtype=np.int64), positions)
    return (q, blocks), (q.double().numpy(), k, v, full)


@pytest.mark.parametrize("base,chunk", [("e", ref.CHUNK_LOGITS), ("2", ref.CHUNK_LOGITS), ("e", 64)])
def test_a_steps_requests_in_shared_calls_equal_each_requests_own_attention(base, chunk, monkeypatch):
    """``chunk`` 64: every call runs its query tokens a slice at a time (``CHUNK_LOGITS``)."""
    groups = _groups()
    monkeypatch.setattr(ref, "CHUNK_LOGITS", chunk)
    calls = []
    batched = ref.batched_reference_attention
    monkeypatch.setattr(ref, "batched_reference_attention", lambda q, *a, **kw: calls.append(q.shape[0]) or batched(q, *a, **kw))
    rng = np.random.default_rng(29)
    problems = 0
    for _ in range(8):  # steps
        built = [_random_request(rng, groups[int(rng.integers(len(groups)))]) for _ in range(int(rng.integers(3, 13)))]
        problems += len(built)
        solved = reference_attention_many([problem for problem, _ in built], scale=SCALE, base=base)
        for (o, lse), (_, (q, k, v, full)) in zip(solved, built):
            want_o, want_lse = _own(q, k, v, full)
            if base == "2":
                want_lse = want_lse / LN2
            assert o.dtype == torch.float64 and o.shape == want_o.shape and lse.shape == want_lse.shape
            assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse))
            assert np.allclose(o.numpy(), want_o, rtol=0, atol=1e-12)
            assert np.allclose(lse.numpy(), want_lse, rtol=0, atol=1e-12)
    assert max(calls) >= 4 and len(calls) < 0.6 * problems  # requests did share calls (36 calls for 67)


def test_requests_of_equal_shape_differ_only_by_their_own_keys():
    """Two requests in one call with the same queries: one sees keys the other's mask hides
    (and a row of it sees nothing); each gets its own result, and the empty row O = 0, lse = -inf."""
    rng = np.random.default_rng(7)
    q = torch.from_numpy(rng.standard_normal((3, H, DK)))
    k, v = torch.from_numpy(rng.standard_normal((40, DK))), torch.from_numpy(rng.standard_normal((40, DV)))
    hidden = torch.ones((3, 40), dtype=torch.bool)
    hidden[0] = False
    hidden[1, 30:] = False
    (o1, l1), (o2, l2), (o3, l3) = reference_attention_many(
        [(q, [(k, v, None)]), (q, [(k, v, hidden)]), (q, [(k[:38], v[:38], None)])], scale=SCALE
    )
    for (o, lse), mask in (((o1, l1), np.ones((3, 40), bool)), ((o2, l2), hidden.numpy()), ((o3, l3), np.ones((3, 38), bool))):
        want_o, want_lse = _own(q.numpy(), k.numpy()[: mask.shape[1]], v.numpy()[: mask.shape[1]], mask)
        assert np.allclose(o.numpy(), want_o, rtol=0, atol=1e-12) and np.allclose(lse.numpy(), want_lse, rtol=0, atol=1e-12)
    assert torch.equal(o2[0], torch.zeros_like(o2[0])) and bool(torch.isneginf(l2[0]).all())
