"""Bug classes 41-43 and 45 (issue 30): the EAGLE drop of B tokens instead of B*W
(``eagle-drop-unscaled``), local lengths corrected by the rejected count after a verify
(``verify-local-lens-minus-rejected``), sparse top-k ids localized with the I = 1 rule
(``topk-local-interleave-one``) and a page table translated twice (``page-table-translated-twice``):
each fault's decision against the reference's, and each caught on its scenario by the check the
catalogue names while the same run passes without it."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import local_seq_lens
from dcpsim.model.plan import EventKind, ReqWrite
from dcpsim.model.sparse import sparse_topk
from support.helpers import builtin, geometries, run, scheduler


def hits(sc, fault=None) -> dict[str, int]:
    """request id -> its prefix-cache hit at admission (tokens)."""
    out = {}
    for plan in scheduler(sc, fault).plans():
        for e in plan.events:
            if e.kind is EventKind.ADMITTED and e.prefix_hit:
                out.setdefault(e.request_id, e.prefix_hit)
    return out


# --- 41: eagle-drop-unscaled ----------------------------------------------------------------


@pytest.mark.parametrize("W, right, faulty", [(4, 576, 624), (2, 608, 624)])
def test_the_eagle_drop_of_one_page_leaves_the_hit_inside_a_block(W, right, faulty):
    sc = builtin("eagle-hybrid-hit", W)
    span = 16 * W
    assert hits(sc)["reader"] == right and right % span == 0
    bad = hits(sc, FAULTS["eagle-drop-unscaled"])["reader"]
    assert bad == faulty and bad % span  # ends inside a block the groups cannot reuse
    assert bad // span * span == right  # the blocks reused are the right ones; the rest is never computed


def test_the_eagle_drop_is_right_at_one_rank_and_without_the_drafter():
    fault = FAULTS["eagle-drop-unscaled"]
    sc = builtin("eagle-hybrid-hit", 1)
    assert hits(sc, fault) == hits(sc) and not fault.applies_to(geometries(sc))
    groups = geometries(builtin("eagle-hybrid-hit", 4))
    assert fault.prefix_hit_tokens(groups, [10, 10], 699, False) == ReferenceEngine().prefix_hit_tokens(groups, [10, 10], 699, False) == 640
    assert fault.prefix_hit_tokens(groups, [10, 10], 699, True) == 624
    assert fault.prefix_hit_tokens(groups, [0, 0], 699, True) == 0


def test_a_hit_longer_than_the_cache_allows_is_wrong_content_at_its_admission():
    sc = builtin("eagle-hybrid-hit", 4)
    assert run(sc).passed
    report = run(sc, inject="eagle-drop-unscaled")
    assert not report.passed and report.failure.kind == "wrong-content", report.text()
    assert report.failure.step == 6 and report.failure.request_id == "reader"
    assert "first bad position: 576" in report.text(), report.text()


# --- 42: verify-local-lens-minus-rejected -----------------------------------------------------


def _write(start: int, tokens: int, drafts: int) -> ReqWrite:
    return ReqWrite(0, "r", start, np.arange(tokens, dtype=np.int64), num_drafts=drafts)


def _sharded(sc):
    return next(g for g in geometries(sc) if g.sharded and g.storage is Storage.PAGED)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_running_count_loses_every_rejected_draft_on_every_rank(rank):
    g = _sharded(builtin("heavy-rejection", 2))
    fault = type(FAULTS["verify-local-lens-minus-rejected"])()  # a fresh running count
    row = np.arange(1, 9, dtype=np.int64)
    local = lambda L: int(local_seq_lens(np.array([L]), dcp_size=2, interleave_size=1, dcp_rank=rank)[0])
    first = fault.build_attention_metadata(g, [_write(10, 4, 3)], [row], rank)  # 10..13, drafts 11..13
    assert first.dcp_local_seq_lens.tolist() == [local(14)]  # nothing to correct yet
    # two drafts rejected: the request goes on at 12, one rejected position on each rank
    meta = fault.build_attention_metadata(g, [_write(12, 4, 3)], [row], rank)
    right = ReferenceEngine().build_attention_metadata(g, [_write(12, 4, 3)], [row], rank)
    assert right.dcp_local_seq_lens.tolist() == [local(16)] == [8]
    assert meta.dcp_local_seq_lens.tolist() == [local(14) - 2 + local(16) - local(12)] == [7]
    assert (meta.query_local_bounds == right.query_local_bounds - 1).all()


def test_all_drafts_accepted_or_a_recompute_keeps_the_right_lengths():
    g = _sharded(builtin("heavy-rejection", 2))
    fault = type(FAULTS["verify-local-lens-minus-rejected"])()
    row = np.arange(1, 9, dtype=np.int64)
    ref = ReferenceEngine()
    steps = [_write(10, 4, 3), _write(14, 4, 3), _write(0, 18, 0)]  # every draft accepted, then a recompute from 0
    for w in steps:
        got = fault.build_attention_metadata(g, [w], [row], 1)
        want = ref.build_attention_metadata(g, [w], [row], 1)
        assert got.dcp_local_seq_lens.tolist() == want.dcp_local_seq_lens.tolist()
        assert (got.query_local_bounds == want.query_local_bounds).all()


def test_rejected_drafts_show_in_the_next_steps_attention_metadata():
    sc = builtin("heavy-rejection", 2)
    assert run(sc).passed
    report = run(sc, inject="verify-local-lens-minus-rejected")
    assert not report.passed and report.failure.kind == "attention-metadata", report.text()
    assert "dcp_local_seq_lens" in report.text(), report.text()


# --- 43: topk-local-interleave-one -----------------------------------------------------------


def _sparse(sc):
    return next(g for g in geometries(sc) if sparse_topk(g.group_spec) and g.sharded)


def test_the_interleave_one_rule_agrees_only_at_interleave_one():
    fault, ref = FAULTS["topk-local-interleave-one"], ReferenceEngine()
    selected = np.array([[0, 1, 5, 16, 17, 40, 47, -1]], dtype=np.int64)
    g1 = _sparse(builtin("dsv32-sparse", 2, 1))
    for r in (0, 1):
        assert (fault.sparse_local_keys(g1, selected, r) == ref.sparse_local_keys(g1, selected, r)).all()
    g16 = _sparse(builtin("dsv32-sparse", 2, 16))
    # I = 16: 0..15 on rank 0 at 0..15, 16..31 on rank 1 at 0..15, 32..47 on rank 0 at 16..31
    assert ref.sparse_local_keys(g16, selected, 0).tolist() == [[0, 1, 5, -1, -1, 24, 31, -1]]
    assert fault.sparse_local_keys(g16, selected, 0).tolist() == [[0, -1, -1, 8, -1, 20, -1, -1]]
    assert not fault.applies_to_scenario(builtin("dsv32-sparse", 2, 1), geometries(builtin("dsv32-sparse", 2, 1)))
    assert fault.applies_to_scenario(builtin("dsv32-sparse", 2, 16), geometries(builtin("dsv32-sparse", 2, 16)))


@pytest.mark.slow  # two in-process dsv32-sparse runs with attention: about 9 s
def test_sparse_keys_localized_with_interleave_one_are_an_attention_mismatch():
    sc = builtin("dsv32-sparse", 2, 16)
    assert run(sc, attention=True).passed
    report = run(sc, inject="topk-local-interleave-one")
    assert not report.passed and report.failure.kind == "attention-mismatch", report.text()


# --- 45: page-table-translated-twice ---------------------------------------------------------


def test_the_plan_looks_each_physical_block_up_again():
    g = _sharded(builtin("llama-gqa", 2))
    fault, ref = FAULTS["page-table-translated-twice"], ReferenceEngine()
    row = np.array([3, 1, 4, 2], dtype=np.int64)
    w = ReqWrite(0, "r", 0, np.arange(4 * 2 * g.states_per_page - 5, dtype=np.int64))  # four pages on each rank
    right = ref.build_attention_metadata(g, [w], [row], 0)
    bad = fault.build_attention_metadata(g, [w], [row], 0)
    assert right.kv_indices.tolist() == [3, 1, 4, 2]
    assert bad.kv_indices.tolist() == [2, 1, 0, 4]  # row[3], row[1], past the row: the null block, row[2]
    assert (bad.dcp_local_seq_lens == right.dcp_local_seq_lens).all() and (bad.kv_indptr == right.kv_indptr).all()


def test_a_page_table_translated_twice_is_caught_in_the_attention_metadata():
    sc = builtin("llama-gqa", 2)
    assert run(sc).passed
    report = run(sc, inject="page-table-translated-twice")
    assert not report.passed and report.failure.kind == "attention-metadata", report.text()
    assert "kv_indices" in report.text(), report.text()


# --- P/D 5: nixl-pulls-outside-intersection ----------------------------------------------------


def test_a_decode_rank_that_pulls_its_source_ranks_blocks_misses_its_own():
    from dcpsim.campaigns.pd_selftest import _scenario
    from dcpsim.engine.connector import CONNECTORS
    from dcpsim.engine.faults import get_pd_fault
    from dcpsim.model.connector import routes_cover
    from dcpsim.scenarios.pd import instance_layout

    s = _scenario("nixl")
    src, dst = instance_layout(s, "prefill"), instance_layout(s, "decode")
    assert (src.cp_size, dst.cp_size, dst.block_size) == (2, 4, 64)
    bad = get_pd_fault("nixl-pulls-outside-intersection").connector("nixl")
    # 9 blocks of 64: decode rank 2 owns global blocks 2 and 6, from prefill rank 0 (its local blocks 1, 3)
    good = {(r.src_rank, r.dst_rank, int(r.src_local[0]), int(r.dst_local[0])) for r in CONNECTORS["nixl"]().routes(576, src, dst)}
    wrong = {(r.src_rank, r.dst_rank, int(r.src_local[0]), int(r.dst_local[0])) for r in bad.routes(576, src, dst)}
    assert {(0, 2, 64, 0), (0, 2, 192, 64)} <= good
    assert {(0, 2, 0, 0), (0, 2, 64, 64)} <= wrong  # prefill rank 0's blocks 0 and 1: global 0 and 2
    assert routes_cover(CONNECTORS["nixl"]().routes(576, src, dst), 576, src, dst)
    assert not routes_cover(bad.routes(576, src, dst), 576, src, dst)
    # with as many prefill ranks as decode ranks the source's order is the decode rank's own
    assert routes_cover(bad.routes(576, dst, dst), 576, dst, dst)
