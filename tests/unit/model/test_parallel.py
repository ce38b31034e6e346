"""``dcpsim.model.parallel``: vLLM 0.33.0's PCP x TP x DCP size rules (every message), the
rank grid against the transpose/reshape formula of ``parallel_state.py`` for every size up
to 8 processes, and the prefill split's properties."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dcpsim.errors import ConfigError
from dcpsim.model.config import SimConfig
from dcpsim.model.parallel import (
    ParallelLayout,
    check_parallel_sizes,
    chunk_computer,
    default_tensor_parallel_size,
    pcp_chunk_size,
    pcp_chunks,
    pcp_replicated,
)
from support.helpers import allowed_parallel_sizes

ALLOWED = allowed_parallel_sizes(8)


def test_the_allowed_sizes_are_vllms_rule():
    assert (1, 4, 2) in ALLOWED and (1, 4, 3) not in ALLOWED
    assert {(2, 2, d) for d in (1, 2, 4)} <= set(ALLOWED) and (2, 2, 3) not in ALLOWED
    assert len(ALLOWED) == 49


@pytest.mark.parametrize("pcp,tp,dcp", ALLOWED)
def test_allowed_sizes_pass(pcp, tp, dcp):
    check_parallel_sizes(pcp, tp, dcp)
    SimConfig(decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp, tensor_parallel_size=tp)


def test_without_pcp_tp_must_be_a_multiple_of_dcp():
    with pytest.raises(ConfigError) as exc:
        check_parallel_sizes(1, 6, 4)
    assert str(exc.value) == (
        "tensor_parallel_size 6 must be divisible by decode_context_parallel_size 4: without prefill context "
        "parallelism DCP reuses the TP ranks (vLLM 0.33.0, vllm/config/parallel.py)"
    )


@pytest.mark.parametrize("pcp,tp,dcp,valid", [(2, 1, 4, "[1, 2]"), (2, 2, 3, "[1, 2, 4]"), (4, 2, 2, "[1, 4, 8]"), (3, 2, 2, "[1, 3, 6]")])
def test_with_pcp_dcp_is_off_spans_pcp_or_spans_the_grid(pcp, tp, dcp, valid):
    with pytest.raises(ConfigError) as exc:
        check_parallel_sizes(pcp, tp, dcp)
    assert str(exc.value) == (
        f"decode_context_parallel_size {dcp} with prefill_context_parallel_size {pcp} and tensor_parallel_size "
        f"{tp}: with PCP, DCP must be off (1), span the PCP axis ({pcp}) or span the whole TP x PCP grid "
        f"({tp * pcp}); valid sizes are {valid} (vLLM 0.33.0, vllm/config/parallel.py)"
    )


@pytest.mark.parametrize(
    "field,value", [("prefill_context_parallel_size", 0), ("tensor_parallel_size", -1), ("decode_context_parallel_size", 1.5)]
)
def test_sizes_must_be_positive_integers(field, value):
    sizes = dict(prefill_context_parallel_size=1, tensor_parallel_size=1, decode_context_parallel_size=1)
    sizes[field] = value
    with pytest.raises(ConfigError, match=f"^{field} must be an integer >= 1, got {value!r}$"):
        check_parallel_sizes(sizes["prefill_context_parallel_size"], sizes["tensor_parallel_size"], sizes["decode_context_parallel_size"])


def test_the_config_refuses_a_bad_combination_and_defaults_tp():
    with pytest.raises(ConfigError, match="valid sizes are \\[1, 2, 4\\]"):
        SimConfig(decode_context_parallel_size=3, prefill_context_parallel_size=2, tensor_parallel_size=2)
    assert SimConfig(decode_context_parallel_size=4).world_size == 4  # the world is the DCP group
    c = SimConfig(decode_context_parallel_size=4, prefill_context_parallel_size=2)
    assert (c.tp_size, c.world_size) == (2, 4)  # DCP spans the grid
    assert SimConfig(decode_context_parallel_size=1, prefill_context_parallel_size=4).world_size == 4
    assert dataclasses.replace(c, tensor_parallel_size=4, decode_context_parallel_size=8).world_size == 8
    assert [default_tensor_parallel_size(p, d) for p, d in [(1, 3), (2, 1), (2, 2), (2, 8), (3, 2)]] == [3, 1, 1, 4, 1]


def _vllm_groups(pcp, tp, dcp):
    """parallel_state.py's formula on torch, over the (..., PCP, TP) grid."""
    all_ranks = torch.arange(pcp * tp).reshape(1, 1, 1, pcp, tp)
    dcp_ranks = all_ranks.transpose(-1, -2) if dcp > 1 else all_ranks
    pcp_ranks = all_ranks.transpose(3, 4).reshape(-1, pcp)
    return (
        [g.tolist() for g in dcp_ranks.reshape(-1, dcp).unbind(0)],
        [g.tolist() for g in pcp_ranks.unbind(0)],
        [g.tolist() for g in all_ranks.view(-1, tp).unbind(0)],
    )


@pytest.mark.parametrize("pcp,tp,dcp", ALLOWED)
def test_the_rank_grid_is_vllms_transpose_and_reshape(pcp, tp, dcp):
    layout = ParallelLayout(pcp, tp, dcp)
    dcp_groups, pcp_groups, tp_groups = _vllm_groups(pcp, tp, dcp)
    assert layout.dcp_groups() == dcp_groups
    assert layout.pcp_groups() == pcp_groups
    assert layout.tp_groups() == tp_groups
    for rank in range(pcp * tp):
        c = layout.coords(rank)
        assert rank == c.pcp_rank * tp + c.tp_rank
        assert dcp_groups[c.dcp_group][c.dcp_rank] == rank
        if pcp > 1 and dcp == pcp:  # DCP spans PCP: the DCP rank is the PCP rank
            assert c.dcp_rank == c.pcp_rank and c.dcp_group == c.tp_rank
        if pcp > 1 and dcp == tp * pcp:
            assert c.dcp_rank == c.tp_rank * pcp + c.pcp_rank and c.dcp_group == 0
        if dcp == 1:
            assert c.dcp_group == rank


@given(q=st.integers(1, 600), pcp=st.integers(1, 8))
def test_every_token_of_a_split_row_is_computed_once_in_mirrored_chunks(q, pcp):
    size = pcp_chunk_size(q, pcp)
    assert size == -(-q // (2 * pcp))
    owner = chunk_computer(q, pcp)
    assert (owner >= 0).all()  # every token by exactly one rank (the pieces never overlap)
    assert sum(n for r in range(pcp) for _, n in pcp_chunks(q, pcp, r)) == q
    for r in range(pcp):
        pieces = pcp_chunks(q, pcp, r)
        assert len(pieces) <= 2
        assert [o // size for o, _ in pieces] == [c for c in (r, 2 * pcp - 1 - r) if c * size < q]
        for o, n in pieces:
            assert (owner[o : o + n] == r).all() and 0 < n <= size
    # mirroring balances the ranks: none computes more than two chunks' worth
    counts = [int((owner == r).sum()) for r in range(pcp)]
    assert max(counts) <= 2 * size


@given(q=st.integers(1, 600), pcp=st.integers(2, 8), dcp=st.integers(1, 16))
def test_short_prefills_are_replicated_only_with_dcp(q, pcp, dcp):
    last_chunk_empty = (2 * pcp - 1) * pcp_chunk_size(q, pcp) >= q
    assert pcp_replicated(q, True, pcp, dcp) == (dcp > 1 and last_chunk_empty)
    assert pcp_replicated(q, False, pcp, dcp)  # decodes are never split
    assert pcp_replicated(q, True, 1, dcp)


def test_the_two_token_prefill_of_vllm_53573():
    # PCP = 2: four chunks of one token; rank 0 would hold token 0 alone (its mirror chunk 3 is
    # empty), rank 1 token 1; with DCP on vLLM 0.33.0 replicates the row instead
    assert pcp_chunks(2, 2, 0) == [(0, 1)] and pcp_chunks(2, 2, 1) == [(1, 1)]
    assert pcp_replicated(2, True, 2, 2) and not pcp_replicated(2, True, 2, 1)
    assert pcp_chunks(8, 2, 0) == [(0, 2), (6, 2)] and pcp_chunks(8, 2, 1) == [(2, 2), (4, 2)]
