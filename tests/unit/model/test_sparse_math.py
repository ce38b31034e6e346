"""Sparse attention's pure math (semantics section 14): the integer stand-ins, the tie rule
on both sides (the engine's ``topk_by_score_then_position`` and the checker's
``verify.sparse.select``, written apart), and the local mappings of vLLM and SGLang."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.engine.reference import ReferenceEngine, topk_by_score_then_position
from dcpsim.errors import ConfigError
from dcpsim.model.sparse import (
    check_sparse_layout,
    indexer_group,
    indexer_keys,
    quantize,
    sglang_topk_local_index,
    vllm_topk_local_index,
)
from dcpsim.model.specs import IndexerSpec, MLAAttentionSpec, SparseMLAAttentionSpec
from dcpsim.model.vectors import kv_vectors
from dcpsim.verify.sparse import digest, select
from support.helpers import builtin, geometries


def test_quantize_gives_the_five_levels_evenly():
    values = kv_vectors(0, np.arange(20000), 16)
    q = quantize(values)
    levels, counts = np.unique(q, return_counts=True)
    assert levels.tolist() == [-2, -1, 0, 1, 2]
    assert counts.min() > 0.18 * q.size  # about a fifth each
    assert indexer_keys(values, 16).shape == (20000, 16)


def test_the_tie_rule_prefers_the_lower_position_among_equal_scores():
    scores = np.array([[3, 5, 5, 1, 5, 0]], dtype=np.float32)
    assert topk_by_score_then_position(scores, 2).tolist() == [[1, 2]]
    assert topk_by_score_then_position(scores, 4).tolist() == [[0, 1, 2, 4]]
    assert select(scores.astype(np.float64), np.array([5]), 2)[0].tolist() == [1, 2]


def test_positions_past_the_context_are_never_selected():
    scores = np.array([[1, 2, -np.inf, -np.inf]], dtype=np.float32)
    assert topk_by_score_then_position(scores, 3).tolist() == [[0, 1, -1]]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 40), st.integers(0, 2**31))
def test_engine_and_checker_select_the_same_set(n, topk, seed):
    """Integer scores with many ties: the two implementations of the total order agree."""
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.integers(0, n, size=4))
    scores = rng.integers(0, 4, size=(4, n)).astype(np.float64)
    scores[np.arange(n)[None, :] > positions[:, None]] = -np.inf
    engine = topk_by_score_then_position(scores.astype(np.float32), topk)
    for row, sel in zip(engine, select(scores, positions, topk)):
        assert row[row >= 0].tolist() == sel.tolist()
        assert digest(row) == digest(sel)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4, 16]), st.integers(1, 300))
def test_vllm_mapping_partitions_the_positions_into_local_runs(W, I, n):
    """Every position is owned by exactly one rank, and each rank's local indices of the
    positions it owns are 0, 1, 2, ... in position order (the rows of its shard)."""
    t = np.arange(n)
    owners = np.zeros(n, dtype=int)
    for r in range(W):
        local = vllm_topk_local_index(t, W, I, r)
        mine = local >= 0
        owners += mine
        assert local[mine].tolist() == list(range(mine.sum()))
    assert (owners == 1).all()
    assert (vllm_topk_local_index(np.array([-1]), W, I, 0) == -1).all()


def test_vllm_mapping_known_values():
    # W = 2, I = 2: rank 0 holds 0, 1, 4, 5, 8, ...; position 5 is its local row 3
    assert vllm_topk_local_index(np.array([5, 2, 9]), 2, 2, 0).tolist() == [3, -1, 5]
    assert vllm_topk_local_index(np.array([5, 2, 9]), 2, 2, 1).tolist() == [-1, 0, -1]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(-1, 500), min_size=1, max_size=40))
def test_sglang_packing_keeps_the_same_set_as_vllm_at_interleave_1(W, ids):
    """SGLang's transform (keep loc % W == r, divide by W, pack to the front with a count)
    selects the same local keys as vLLM's formula with I = 1."""
    ids = np.array(ids)
    for r in range(W):
        packed, count = sglang_topk_local_index(ids, W, r)
        vllm = vllm_topk_local_index(ids, W, 1, r)
        assert int(count[0]) == int((vllm >= 0).sum())
        assert packed[0, : count[0]].tolist() == vllm[vllm >= 0].tolist()
        assert (packed[0, count[0] :] == -1).all()


def test_the_reference_engine_reads_a_replicated_indexer_whole():
    sc = builtin("dsv32-sparse", 4)
    geos = geometries(sc)
    indexer = next(g for g in geos if isinstance(g.spec, IndexerSpec))
    eng = ReferenceEngine()
    rows = [eng.indexer_local_rows(indexer, 37, r) for r in range(4)]
    assert sorted(np.concatenate(rows).tolist()) == list(range(37))
    replicated = builtin("dsv32-sparse", 4)
    layers = {
        n: (s if not isinstance(s, IndexerSpec) else IndexerSpec(**{**s.__dict__, "dcp_replicated": True}))
        for n, s in replicated.layers.items()
    }
    rep = next(g for g in ReferenceEngine().geometries(layers, replicated.config) if isinstance(g.spec, IndexerSpec))
    assert not rep.sharded
    assert eng.indexer_local_rows(rep, 37, 3).tolist() == list(range(37))


def test_sparse_layers_need_exactly_one_indexer_group():
    sparse = SparseMLAAttentionSpec(block_size=64, head_size=576)
    with pytest.raises(ConfigError, match="exactly one indexer"):
        indexer_group([sparse, MLAAttentionSpec(block_size=64, head_size=576)])
    assert indexer_group([sparse, IndexerSpec(block_size=64, head_size=128)]) == 1
    assert indexer_group([MLAAttentionSpec(block_size=64, head_size=576)]) is None


def test_an_indexer_with_nothing_to_index_is_an_error_naming_the_layer():
    """Issue 31: indexer layers without the sparse_mla layers they score for."""
    indexer = IndexerSpec(block_size=64, head_size=128)
    mla = MLAAttentionSpec(block_size=64, head_size=576)
    with pytest.raises(ConfigError, match=r"layer 'l.0.indexer' \(and 1 more\): an indexer .* with nothing to index"):
        check_sparse_layout({"l.0.indexer": indexer, "l.1.indexer": indexer})
    with pytest.raises(ConfigError, match="'l.0.indexer': an indexer"):
        check_sparse_layout({"l.0.mla": mla, "l.0.indexer": indexer})
    check_sparse_layout({"l.0.sparse": SparseMLAAttentionSpec(block_size=64, head_size=576), "l.0.indexer": indexer})
    check_sparse_layout({"l.0.mla": mla})
