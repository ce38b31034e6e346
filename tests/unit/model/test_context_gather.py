"""The context gather of a chunked prefill (semantics section 10): the engine's math
(``model.context_gather``), the reference engine's decision, and the checker's own
derivation (``verify.context_gather``) agreeing with it and catching the whole-local-length
fault (vllm#28526)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.context_gather import local_gather, padded_rows, plan_chunks, workspace_size
from dcpsim.model.layout import local_seq_lens
from dcpsim.model.plan import ReqWrite, StepPlan
from dcpsim.verify.context_gather import expected_entries, expected_gather, expected_workspace, judge_gathers
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.metadata import MetadataJudge
from support.helpers import fault_scenario, geometries


def test_the_worked_example_of_section_10():
    entries = plan_chunks([100, 0, 300, 50], workspace=128, block_size=16, dcp_size=2, interleave_size=4)
    assert entries == [(0, 0, 0, 100), (1, 2, 0, 128), (2, 2, 128, 128), (3, 2, 256, 44), (3, 3, 0, 50)]
    assert [local_gather(300, 256, 44, dcp_size=2, interleave_size=4, dcp_rank=r) for r in (0, 1)] == [(128, 24), (128, 20)]
    # every earlier chunk of the split context: the chunk's rows, never the whole local context
    assert local_gather(300, 128, 128, dcp_size=2, interleave_size=4, dcp_rank=1) == (64, 64)


def test_workspace_follows_vllms_rule_and_alignment():
    kw = dict(max_num_seqs=256, block_size=16, dcp_size=1, interleave_size=1)
    assert workspace_size(None, max_model_len=8192, **kw) == 65536  # min(max(65536, 16384), 65536)
    assert workspace_size(None, max_model_len=1000, **kw) == 16384  # max(8000, 4 * 256 * 16)
    assert workspace_size(None, max_model_len=100, max_num_seqs=2, block_size=16, dcp_size=1, interleave_size=1) == 800
    # rounded up to lcm(B, W * I): 48 and 3 * 32 = 96
    assert workspace_size(100, max_model_len=0, max_num_seqs=1, block_size=48, dcp_size=3, interleave_size=32) == 192
    assert workspace_size(5, max_model_len=0, max_num_seqs=1, block_size=16, dcp_size=2, interleave_size=4) == 16


CASES = st.tuples(
    st.lists(st.integers(0, 700), min_size=1, max_size=6),
    st.sampled_from([(1, 1), (2, 1), (2, 4), (4, 2), (3, 16)]),
    st.sampled_from([16, 32]),
    st.integers(1, 400),
)


class _Group:
    """The few fields of ``ExpectedGroup`` the checker's packing reads."""

    def __init__(self, B, W, I):
        self.block_size, self.dcp_size, self.interleave_size, self.sharded = B, W, I, W > 1


@settings(max_examples=300, deadline=None)
@given(CASES)
def test_the_engine_and_the_checker_pack_alike_and_the_pieces_cover_each_context_once(case):
    contexts, (W, I), B, want = case
    S = workspace_size(want, max_model_len=0, max_num_seqs=1, block_size=B, dcp_size=W, interleave_size=I)
    entries = plan_chunks(contexts, workspace=S, block_size=B, dcp_size=W, interleave_size=I)
    assert entries == expected_entries(_Group(B, W, I), contexts, S)
    for k, c in enumerate(contexts):  # the pieces of a context, in order, cover it exactly
        pieces = [(s, n) for _, i, s, n in entries if i == k]
        assert sum(n for _, n in pieces) == c and all(s == sum(n for _, n in pieces[:j]) for j, (s, _) in enumerate(pieces))
        for s, n in pieces:
            got = [local_gather(c, s, n, dcp_size=W, interleave_size=I, dcp_rank=r)[1] for r in range(W)]
            assert sum(got) == n  # each rank gathers its keys of the piece, no more
            assert max(got) <= padded_rows(s + n, W, I) - padded_rows(s, W, I)
    for chunk in {e[0] for e in entries}:  # a chunk fits the workspace
        rows = sum(padded_rows(s + n, W, I) - padded_rows(s, W, I) for ch, _, s, n in entries if ch == chunk)
        assert rows <= S // W


def test_a_context_within_the_workspace_is_one_piece_gathered_whole():
    # vLLM's default workspace: a 16K-token context is one entry, each rank gathers local(c, r)
    S = workspace_size(None, max_model_len=8192, max_num_seqs=256, block_size=64, dcp_size=4, interleave_size=1)
    assert plan_chunks([16384], workspace=S, block_size=64, dcp_size=4, interleave_size=1) == [(0, 0, 0, 16384)]
    lens = local_seq_lens(np.array([16384]), dcp_size=4, interleave_size=1)[0]
    assert [local_gather(16384, 0, 16384, dcp_size=4, interleave_size=1, dcp_rank=r)[1] for r in range(4)] == list(lens)


# --- the decision and the checker over a real step -------------------------------------------


def _step(sc, writes):
    """A plan of ``writes`` over fresh rows of the scenario's first group (blocks 1, 2, ...)."""
    g = geometries(sc)[0]
    rows, nxt = {}, 1
    for w in writes:
        n = -(-w.stop // g.manager_block_size)
        rows[w.req_index] = np.arange(nxt, nxt + n, dtype=np.int64)
        nxt += n
    return g, StepPlan(0, tuple(writes), (rows,), (), (rows,))


def _write(req, start, n):
    return ReqWrite(req, f"r{req}", start, np.arange(n, dtype=np.int64), prefill=True)


@pytest.mark.parametrize("W,I", [(2, 4), (4, 1), (1, 1)])
def test_the_reference_gather_is_what_the_checker_derives(W, I):
    sc = fault_scenario("dsv3", decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, chunked_prefill_workspace_size=256)
    g, plan = _step(sc, [_write(0, 700, 64), _write(1, 0, 64), _write(2, 90, 1), _write(3, 300, 32)])
    group = expected_groups(sc)[0]
    S = expected_workspace(group, sc.config)
    assert S == g.chunked_prefill_workspace_size == 256  # already a multiple of lcm(64, W * I)
    for r in range(W):
        got = ReferenceEngine().context_gather(g, list(plan.writes), [plan.rows_before[0][w.req_index] for w in plan.writes], r)
        want = expected_gather(group, plan, plan.rows_before[0], r, S)
        assert got.request_ids == want["request_ids"]  # r2's one-token row runs as a decode: no gather
        assert set(got.request_ids) == {"r0", "r3"}
        for name in ("chunks", "starts", "seq_lens", "local_starts", "local_seq_lens"):
            assert np.array_equal(getattr(got, name), want[name]), name
        assert all(np.array_equal(got.slots_of(k), s) for k, s in enumerate(want["slots"]))


def test_the_checker_names_rank_request_and_chunk_of_a_whole_local_length():
    sc = fault_scenario("dsv3", decode_context_parallel_size=2, cp_kv_cache_interleave_size=4, chunked_prefill_workspace_size=64)
    g, plan = _step(sc, [_write(0, 200, 64)])
    rows = [plan.rows_before[0][0]]
    judge = MetadataJudge(1, expected_groups(sc), [0], sc.config.max_model_len, (), config=sc.config)
    judge_gathers(judge, plan, [ReferenceEngine().context_gather(g, list(plan.writes), rows, 1)])
    assert judge.count == 0 and judge.gather_checks == 1
    judge_gathers(judge, plan, [type(FAULTS["context-gather-whole-local-len"])().context_gather(g, list(plan.writes), rows, 1)])
    assert judge.count == 1
    text = str(judge.kept[0])
    assert "rank 1" in text and "request r0" in text and "context gather chunk 0 local_seq_lens is 100, expected 32" in text


def test_the_walk_refuses_a_workspace_too_small_for_one_span_instead_of_looping():
    """A workspace below one aligned span (lcm(B, W * I) = 8 here) cannot make progress: the
    walk raises, naming it, where it looped for ever."""
    import pytest

    from dcpsim.model.context_gather import plan_chunks_walk

    with pytest.raises(ValueError, match="workspace of 4 rows cannot hold one span of 8 tokens"):
        plan_chunks_walk([4], workspace=4, block_size=4, dcp_size=2, interleave_size=4)
    assert plan_chunks_walk([4], workspace=8, block_size=4, dcp_size=2, interleave_size=4) == [(0, 0, 0, 4)]
