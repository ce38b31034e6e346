"""KV heads in the attention check (semantics section 12, "Heads"; bug class 48).

* the checker's own derivation of a rank's gathered query heads and of the KV head each reads
  (``verify.attention_heads``) agrees with the head model the engine's default uses
  (``model.heads.rank_heads``), rank by rank, on admissible layouts;
* the reference with several KV heads (``verify.attention.kv_head_reference``) is each query
  head's float64 softmax over its own KV head, the engine's float32 attention paired the right
  way matches it, and paired the way of ``gathered-heads-gqa-remapped`` it differs;
* ``gqa-pcp2-heads`` passes under ``--attention`` with one K/V vector per KV head in its store,
  the fault fails it (``attention-mismatch``), and a scenario without heads keeps one KV head.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dcpsim.engine.attention.compute import attend
from dcpsim.engine.attention.heads import group_heads
from dcpsim.engine.faults import get_fault
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.heads import check_dcp_heads, rank_heads
from dcpsim.model.parallel import ParallelLayout
from dcpsim.model.vectors import kv_vectors, query_vectors
from dcpsim.scenarios.load import load_scenario
from dcpsim.verify.attention import kv_head_reference
from dcpsim.verify.attention_heads import dcp_members, expected_heads
from support.helpers import builtin, geometries, run

LAYOUTS = [  # (pcp, tp, dcp, heads, kv_heads): admissible layouts
    (1, 2, 2, 8, 1),
    (1, 4, 2, 8, 2),
    (1, 8, 2, 32, 4),
    (1, 4, 1, 16, 8),
    (2, 1, 2, 32, 8),
    (2, 2, 2, 16, 4),
    (4, 2, 4, 8, 8),
    (2, 2, 4, 8, 1),
]


def _config(pcp, tp, dcp, heads, kv):
    base = load_scenario("gqa-pcp2-heads").config
    return dataclasses.replace(
        base,
        prefill_context_parallel_size=pcp,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        num_attention_heads=heads,
        num_key_value_heads=kv,
    )


@pytest.mark.parametrize("pcp,tp,dcp,heads,kv", LAYOUTS)
def test_the_checkers_heads_agree_with_the_head_model_on_every_rank(pcp, tp, dcp, heads, kv):
    layout = ParallelLayout(pcp, tp, dcp)
    check_dcp_heads(layout, heads, kv)  # admissible
    config = _config(pcp, tp, dcp, heads, kv)
    for rank in range(layout.world_size):
        assert dcp_members(pcp, tp, dcp, rank) == next(m for m in layout.dcp_groups() if rank in m)
        engine, checker = rank_heads(layout, rank, heads, kv), expected_heads(config, rank)
        assert list(checker.query_heads) == list(engine.query_heads)
        assert list(checker.kv_heads) == [engine.kv_heads[i] for i in engine.kv_index]
        assert len(checker.query_heads) == dcp * heads // tp


def test_the_gathered_heads_of_a_group_over_the_pcp_axis():
    # TP 1, PCP 2, DCP 2: both members hold TP rank 0's 32 heads and all 8 KV heads; the gather
    # repeats the 32 heads, and head h reads KV head h // 4 in each copy
    heads = expected_heads(_config(2, 1, 2, 32, 8), 1)
    assert list(heads.query_heads) == list(range(32)) * 2
    assert list(heads.kv_heads) == [h // 4 for h in range(32)] * 2
    # the fault's pairing: gathered head i reads local KV head i // (64 / 8)
    wrong = get_fault("gathered-heads-gqa-remapped").attention_heads(ParallelLayout(2, 1, 2), 1, 32, 8)
    assert list(wrong.kv_index) == [i // 8 for i in range(64)]
    differ = [i for i, (a, b) in enumerate(zip(wrong.kv_index, heads.kv_heads)) if a != b]
    assert len(differ) == 56 and 4 in differ and 0 not in differ  # heads 0-3 read KV head 0 either way
    # where each rank holds one KV head (a DCP group of TP ranks), the fault pairs as the engine does
    one = ParallelLayout(1, 4, 2)
    assert get_fault("gathered-heads-gqa-remapped").attention_heads(one, 2, 8, 2) == rank_heads(one, 2, 8, 2)


def _naive(q, k, v, mask, scale):
    """One head, float64, by the textbook formula."""
    logits = (q.double() @ k.double().T) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    w = torch.softmax(logits, dim=-1)
    return w @ v.double(), torch.logsumexp(logits, dim=-1)


def test_the_reference_reads_each_heads_own_kv_head_and_a_wrong_pairing_differs():
    dk = dv = 16
    scale = 2.0 / dk**0.5
    H, kv, n, nq = 8, 4, 40, 5
    contents = np.arange(1000, 1000 + n, dtype=np.int64) * 7919
    gathered = np.array(list(range(H)) * 2)  # a group over the PCP axis: two copies of TP rank 0's heads
    kv_of = gathered * kv // H
    kvs = [kv_vectors(3, contents, dk + dv, h) for h in range(kv)]
    assert not np.allclose(kvs[0], kvs[1])  # each KV head carries its own vectors
    assert np.array_equal(kv_vectors(3, contents, dk + dv), kv_vectors(3, contents, dk + dv))
    k_all = torch.from_numpy(np.concatenate([x[:, :dk] for x in kvs], axis=1))
    v_all = torch.from_numpy(np.concatenate([x[:, dk:] for x in kvs], axis=1))
    positions = np.arange(n - nq, n)
    mask = torch.from_numpy(np.arange(n)[None, :] <= positions[:, None])
    query = torch.from_numpy(query_vectors(3, 0, positions, contents[positions], H, dk)[:, gathered])
    blocks = [(k_all[:20], v_all[:20], mask[:, :20]), (k_all[20:], v_all[20:], mask[:, 20:])]
    out, lse = kv_head_reference(query, kv_of, blocks, dk, dv, scale)
    for i in range(len(gathered)):  # every head: the textbook softmax over its own KV head
        j = kv_of[i]
        o, l = _naive(query[:, i], k_all[:, j * dk : (j + 1) * dk], v_all[:, j * dv : (j + 1) * dv], mask, scale)
        assert torch.allclose(out[:, i], o, atol=1e-12) and torch.allclose(lse[:, i], l, atol=1e-12)

    def engine(pairing):  # the engine's float32 attention, each head over the KV head ``pairing`` gives it
        o = torch.zeros(out.shape, dtype=torch.float32)
        for i, j in enumerate(pairing):
            o[:, i : i + 1], _ = attend(
                query[:, i : i + 1], k_all[:, j * dk : (j + 1) * dk], v_all[:, j * dv : (j + 1) * dv], mask, scale=scale
            )
        return (o.double() - out).abs().amax(dim=(0, 2))

    assert float(engine(kv_of).max()) < 1e-5
    wrong = np.arange(len(gathered)) // (len(gathered) // kv)  # the fault's ratio of the gathered count
    errors = engine(wrong)
    assert bool((errors[torch.from_numpy(wrong != kv_of)] > 1e-2).all()) and float(errors[torch.from_numpy(wrong == kv_of)].max()) < 1e-5


def test_gqa_pcp2_heads_holds_a_vector_per_kv_head_passes_and_the_fault_fails_it():
    sc = load_scenario("gqa-pcp2-heads")
    geos = geometries(sc)
    heads = group_heads(ReferenceEngine(), geos, sc.config, sc.config.parallel_layout, 0)
    assert list(heads) == [0] and list(heads[0].kv_heads) == list(range(8)) and len(heads[0].query_heads) == 64
    report = run(sc, attention=True)
    assert report.passed and report.attention_checks > 0, report.text()
    assert report.attention_max_error < 1e-4
    failed = run(sc, inject="gathered-heads-gqa-remapped")
    assert not failed.passed and failed.failure.kind == "attention-mismatch", failed.text()
    # the head named is one the fault pairs with another KV head than its own
    right, wrong = rank_heads(sc.config.parallel_layout, 0, 32, 8), get_fault("gathered-heads-gqa-remapped")
    pairing = wrong.attention_heads(sc.config.parallel_layout, 0, 32, 8)
    assert pairing.kv_index[failed.failure.head] != right.kv_index[failed.failure.head]


@pytest.mark.parametrize("name", ["dsv3", "llama-gqa"])
def test_a_scenario_without_heads_keeps_one_kv_head(name):
    sc = builtin(name, 2)
    assert sc.config.num_attention_heads is None
    assert group_heads(ReferenceEngine(), geometries(sc), sc.config, sc.config.parallel_layout, 0) == {}
    assert expected_heads(sc.config, 0) is None
