"""The checker's context-gather rule accepts any valid chunking (semantics section 10): vLLM
0.33.0's packing of a step's requests into the workspace and vllm-ascend's per-request pieces
(every request cut alike, each piece padded to ``I`` per rank) both pass; a key read twice, a key
missing, a chunk past the workspace, chunks out of order, an empty piece or a request that has no
cached context fail, each naming the chunk."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.context_gather import local_gather
from dcpsim.model.plan import ContextGather, ReqWrite, StepPlan
from dcpsim.verify.context_gather import _rows_per_rank, judge_gathers
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.metadata import MetadataJudge, owned_below
from support.helpers import fault_scenario, geometries

W, I, S = 2, 4, 256
CONTEXTS = {"r0": 700, "r3": 300}
"""Two prefills over a cached context (``r1`` has none, ``r2`` runs as a decode); the
workspace is 128 rows a rank."""


def _step():
    sc = fault_scenario("dsv3", decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, chunked_prefill_workspace_size=S)
    g = geometries(sc)[0]
    writes = [
        ReqWrite(0, "r0", 700, np.arange(64, dtype=np.int64), prefill=True),
        ReqWrite(1, "r1", 0, np.arange(64, dtype=np.int64), prefill=True),
        ReqWrite(2, "r2", 90, np.arange(1, dtype=np.int64), prefill=True),
        ReqWrite(3, "r3", 300, np.arange(32, dtype=np.int64), prefill=True),
    ]
    rows, nxt = {}, 1
    for w in writes:
        n = -(-w.stop // g.manager_block_size)
        rows[w.req_index] = np.arange(nxt, nxt + n, dtype=np.int64)
        nxt += n
    return sc, g, StepPlan(0, tuple(writes), (rows,), (), (rows,))


def _gather(g, plan, entries, rank, workspace=S) -> ContextGather:
    """A gather of ``entries`` (``(chunk, request id, start, length)``) on ``rank``: the rank's
    own keys of each piece, read through the request's row."""
    by_id = {w.request_id: w for w in plan.writes}
    local = [local_gather(CONTEXTS.get(rid, 0), s, n, dcp_size=W, interleave_size=I, dcp_rank=rank) for _, rid, s, n in entries]
    engine = ReferenceEngine()
    slots = [
        engine._read_slots(g, plan.rows_before[0][by_id[rid].req_index], np.arange(a, a + m, dtype=np.int64))
        for (_, rid, _, _), (a, m) in zip(entries, local)
    ]
    column = lambda k: np.array([e[k] for e in entries], dtype=np.int64)
    return ContextGather(
        group=g.group_id,
        workspace_size=workspace,
        request_ids=tuple(e[1] for e in entries),
        chunks=column(0),
        starts=column(2),
        seq_lens=column(3),
        local_starts=np.array([a for a, _ in local], dtype=np.int64),
        local_seq_lens=np.array([m for _, m in local], dtype=np.int64),
        slots=np.concatenate(slots).astype(np.int64) if slots else np.zeros(0, np.int64),
    )


def _per_request(piece: int) -> list[tuple[int, str, int, int]]:
    """vllm-ascend's chunking: piece ``i`` of every request, ``[i * piece, min(c, (i + 1) * piece))``, in chunk ``i``."""
    out = []
    for i in range(-(-max(CONTEXTS.values()) // piece)):
        for rid in ("r0", "r3"):
            n = min(CONTEXTS[rid], (i + 1) * piece) - i * piece
            if n > 0:
                out.append((i, rid, i * piece, n))
    return out


def _judge(entries, workspace=S):
    sc, g, plan = _step()
    found = []
    for rank in range(W):
        judge = MetadataJudge(rank, expected_groups(sc), [0], sc.config.max_model_len, (), config=sc.config)
        judge_gathers(judge, plan, [_gather(g, plan, entries, rank, workspace)])
        assert judge.gather_checks == 1
        found.append([str(m) for m in judge.kept])
    return found


def test_the_plugins_per_request_pieces_padded_to_the_interleave_pass():
    # the workspace over the two requests with a context, rounded down to lcm(B, W * I) = 64:
    # 128-token pieces, 64 rows a rank each, two a chunk: 128 rows a rank
    entries = _per_request(128)
    assert entries[:3] == [(0, "r0", 0, 128), (0, "r3", 0, 128), (1, "r0", 128, 128)]
    assert _judge(entries) == [[], []]


def test_vllms_packing_passes_too():
    sc, g, plan = _step()
    for rank in range(W):
        judge = MetadataJudge(rank, expected_groups(sc), [0], sc.config.max_model_len, (), config=sc.config)
        rows = [plan.rows_before[0][w.req_index] for w in plan.writes]
        judge_gathers(judge, plan, [ReferenceEngine().context_gather(g, list(plan.writes), rows, rank)])
        assert (judge.count, judge.gather_checks) == (0, 1)


def _replace(entries, at, entry):
    return [entry if k == at else e for k, e in enumerate(entries)]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda e: _replace(e, 2, (1, "r0", 120, 136)), "chunk 1 starts is 120, expected 128"),  # keys 120..127 read twice
        (lambda e: _replace(e, 2, (1, "r0", 136, 120)), "chunk 1 starts is 136, expected 128"),  # keys 128..135 missing
        (lambda e: [x for x in e if x != (5, "r0", 640, 60)], "chunk 4 seq_lens is 128, expected 188"),  # the tail missing
        (lambda e: _replace(e, 1, (0, "r3", 0, 100)), "chunk 1 starts is 128, expected 100"),  # r3's keys 100..127 missing
        (lambda e: _replace(e, 0, (1, "r0", 0, 128)), "context gather requests is"),  # chunk 0 after chunk 1's entry
        (lambda e: [(0, "r1", 0, 0), *e], "context gather requests is"),  # a request without a context
        (lambda e: [*e[:2], (0, "r0", 128, 0), *e[2:]], "context gather requests is"),  # r0 twice in chunk 0
    ],
    ids=["key-read-twice", "keys-skipped", "tail-missing", "short-piece", "chunks-out-of-order", "no-context", "twice-a-chunk"],
)
def test_a_broken_chunking_fails_naming_the_chunk(change, message):
    found = _judge(change(_per_request(128)))
    assert all(len(f) == 1 and message in f[0] for f in found), found


def test_a_chunk_past_the_workspace_fails():
    # 256-token pieces: two of them take 256 rows a rank in one chunk, where the workspace has 128
    found = _judge(_per_request(256))
    assert all(len(f) == 1 and "context gather chunk 0 rows is 256, expected at most 128" in f[0] for f in found), found
    # one request a chunk fits: 256 tokens, 128 rows a rank
    alone = [(2 * i + (rid == "r3"), rid, s, n) for i, rid, s, n in _per_request(256)]
    assert _judge(alone) == [[], []]


def test_another_workspace_than_the_scenarios_fails():
    found = _judge(_per_request(128), workspace=2 * S)
    assert all(len(f) == 1 and "context gather workspace_size is 512, expected 256" in f[0] for f in found), found


@pytest.mark.parametrize("W_, I_", [(2, 4), (4, 1), (3, 16), (8, 64)])
def test_the_rows_of_pieces_at_a_round_are_the_most_any_rank_holds(W_, I_):
    group = type("G", (), dict(sharded=True, dcp_size=W_, interleave_size=I_))()
    rng = np.random.default_rng(W_ * I_)
    starts = rng.integers(0, 50, 400) * W_ * I_
    ends = starts + rng.integers(1, 5 * W_ * I_, 400)
    most = np.max([owned_below(ends, r, group) - owned_below(starts, r, group) for r in range(W_)], axis=0)
    assert np.array_equal(_rows_per_rank(group, starts, ends), most)  # the closed form of aligned starts
