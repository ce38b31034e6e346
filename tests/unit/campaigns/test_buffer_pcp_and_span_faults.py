"""The faults of issue 22's public bug classes, in one process (ranks as threads).

For each: its decision against the reference engine's beside it, and its detection on a
scenario where selftest runs it (the same scenario and config passing without it).
Persistent buffers (vllm-ascend#5647, vllm#36070), PCP rows after the gather
(vllm-ascend#16775, vllm-ascend#8547), a NIXL plan from one source rank (vllm#57389) and
hits aligned to the GCD of spans that do not divide each other.
"""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.connector import CONNECTORS
from dcpsim.engine.faults import FAULTS, get_pd_fault
from dcpsim.engine.faults.pcp import PcpSlotsCutToLocalTokens, PcpUniformDecodeSlots
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.connector import routes_cover
from dcpsim.model.layout import PAD
from dcpsim.model.plan import PAD_REQUEST, EventKind, ReqWrite
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.pd import instance_layout
from support.helpers import fault_scenario as scenario
from support.helpers import geometries, scheduler
from support.helpers import run_fault as run


def fresh(name):
    """A fault as a rank's run gets it: a fresh instance (its buffers empty)."""
    return type(FAULTS[name])()


def write(req, start, n, drafts=0, prefill=False):
    return ReqWrite(req, f"r{req}", start, np.arange(1, n + 1, dtype=np.int64), num_drafts=drafts, prefill=prefill)


def graph_group(W=2):
    """many-short's sharded group with CUDA-graph sizes 1, 2, 4, 8, ... (no drafts)."""
    sc = scenario("many-short", decode_context_parallel_size=W, max_cudagraph_capture_size=64, num_speculative_tokens=0)
    (g,) = geometries(sc)
    assert g.sharded and g.cudagraph_capture_sizes[:3] == (1, 2, 4) and g.num_speculative_tokens == 0
    return g


# ----------------------------------------------------------------------------- persistent buffers


def test_padded_slots_not_reset_hands_the_dummies_an_earlier_steps_slots():
    g, ref, bad = graph_group(), ReferenceEngine(), fresh("padded-slots-not-reset")
    rows = [np.array([3, 5], np.int64)] * 3
    prefill = [write(0, 0, 40, prefill=True)]
    decode = [write(0, 40, 1), write(1, 10, 1), write(2, 20, 1)]  # 3 tokens pad to 4: one dummy
    for rank in (0, 1):
        bad.build_attention_metadata(g, prefill, rows[:1], rank)
        good, got = ref.build_attention_metadata(g, decode, rows, rank), bad.build_attention_metadata(g, decode, rows, rank)
        assert good.num_dummy_requests == got.num_dummy_requests == 1
        assert (good.padded_slot_mapping == PAD).all()
        # the dummy is token 3 of the padded batch: the buffer still holds the prefill's token 3
        stale = ref.write_slots(g, prefill[0], rows[0], rank)[0][3]
        assert got.padded_slot_mapping.tolist() == [stale]
        assert (stale != PAD) == (rank == 1)  # I = 1: position 3 is rank 1's


def test_cudagraph_stale_local_lens_replays_the_capture_steps_lengths():
    g, ref, bad = graph_group(), ReferenceEngine(), fresh("cudagraph-stale-local-lens")
    rows = [np.array([3, 5], np.int64)] * 3
    first = [write(0, 40, 1), write(1, 10, 1), write(2, 20, 1)]
    later = [write(0, 45, 1), write(1, 15, 1), write(2, 25, 1)]  # the same captured size, 4
    for rank in (0, 1):
        captured = bad.build_attention_metadata(g, first, rows, rank)
        np.testing.assert_array_equal(captured.dcp_local_seq_lens, ref.build_attention_metadata(g, first, rows, rank).dcp_local_seq_lens)
        replayed = bad.build_attention_metadata(g, later, rows, rank)
        truth = ref.build_attention_metadata(g, later, rows, rank)
        np.testing.assert_array_equal(replayed.dcp_local_seq_lens, captured.dcp_local_seq_lens)
        assert (replayed.dcp_local_seq_lens != truth.dcp_local_seq_lens).any()
        np.testing.assert_array_equal(replayed.seq_lens, truth.seq_lens)
    eager = [write(0, 50, 1)] * 1 + [write(1, 0, 7, prefill=True)]  # a mixed step runs eagerly
    np.testing.assert_array_equal(
        bad.build_attention_metadata(g, eager, rows[:2], 0).dcp_local_seq_lens,
        ref.build_attention_metadata(g, eager, rows[:2], 0).dcp_local_seq_lens,
    )


# ----------------------------------------------------------------------------- PCP rows


def test_pcp_slots_cut_to_local_tokens_leaves_the_tail_of_a_split_row_without_kv():
    ref, bad = ReferenceEngine(), PcpSlotsCutToLocalTokens()
    for q, pcp in ((40, 2), (37, 2), (100, 4)):
        good = ref.pcp_restore_offsets(q, pcp)
        assert sorted(good.tolist()) == list(range(q))
        cut = bad.pcp_restore_offsets(q, pcp)
        local = 2 * -(-q // (2 * pcp))
        np.testing.assert_array_equal(cut, np.where(good < local, good, -1))
        assert (cut == -1).sum() == q - local > 0


def test_pcp_uniform_decode_slots_shifts_the_rows_after_a_short_one():
    sc = scenario("glm-pcp2-dcp2", tensor_parallel_size=1, num_speculative_tokens=2)
    (g,) = geometries(sc)
    ref, bad = ReferenceEngine(), PcpUniformDecodeSlots()
    rows = [np.array([2, 4], np.int64), np.array([6, 8], np.int64)]
    short_first = [write(0, 30, 2, drafts=1), write(1, 50, 3, drafts=2)]  # request 0 runs one draft of two
    for rank in (0, 1):
        good = ref.step_write_slots(g, short_first, rows, rank)
        got = bad.step_write_slots(g, short_first, rows, rank)
        np.testing.assert_array_equal(got[0][0], good[0][0])
        np.testing.assert_array_equal(got[1][1], good[1][1])  # same positions ...
        np.testing.assert_array_equal(got[1][0], np.concatenate([good[1][0][1:], [PAD]]))  # ... shifted slots
        uniform = [write(0, 30, 3, drafts=2), write(1, 50, 3, drafts=2)]
        for (a, _), (b, _) in zip(bad.step_write_slots(g, uniform, rows, rank), ref.step_write_slots(g, uniform, rows, rank)):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- P/D


def test_nixl_one_source_rank_reads_every_block_from_rank_zero():
    s = load_scenario("pd-dsv3")
    src, dst = instance_layout(s, "prefill"), instance_layout(s, "decode")
    bad = get_pd_fault("nixl-one-source-rank").connector("nixl")
    for r in s.requests:
        good = CONNECTORS["nixl"]().routes(r.prompt_len, src, dst)
        assert routes_cover(good, r.prompt_len, src, dst)
        routes = bad.routes(r.prompt_len, src, dst)
        assert {route.src_rank for route in routes} == {0}
        # a prompt of one 64-token block is rank 0's block 0 either way
        assert routes_cover(routes, r.prompt_len, src, dst) == (r.prompt_len <= 64)


# ----------------------------------------------------------------------------- spans that do not divide


def admissions(sc, fault=None) -> dict[str, int]:
    hits: dict[str, int] = {}
    for plan in scheduler(sc, fault).plans():
        for e in plan.events:
            if e.kind is EventKind.ADMITTED and e.prefix_hit:
                hits.setdefault(e.request_id, e.prefix_hit)
    return hits


@pytest.mark.parametrize("W", [1, 2, 4])
def test_prefix_hit_gcd_aligned_ends_inside_a_block_of_one_group(W):
    sc = scenario("prefix-ragged-spans", decode_context_parallel_size=W)
    spans = sorted(g.manager_block_size for g in geometries(sc))
    assert spans == [48 * W, 64 * W]
    good, bad = admissions(sc), admissions(sc, FAULTS["prefix-hit-gcd-aligned"])
    assert good["manual-late"] == 768 and all(h % (192 * W) == 0 for h in good.values())
    assert all(h % (16 * W) == 0 for h in bad.values())
    # some hit ends inside a block of one group (not a whole number of both spans)
    assert any(h % (48 * W) or h % (64 * W) for h in bad.values()), bad
    assert FAULTS["prefix-hit-gcd-aligned"].applies_to(geometries(sc))


def test_prefix_hit_gcd_aligned_cannot_show_where_the_spans_divide():
    sc = scenario("compressed-prefix")  # spans 32 and 128: the GCD rounding changes no hit
    assert not FAULTS["prefix-hit-gcd-aligned"].applies_to(geometries(sc))
    assert admissions(sc) == admissions(sc, FAULTS["prefix-hit-gcd-aligned"])


# ----------------------------------------------------------------------------- detection, end to end

CASES = [
    ("padded-slots-not-reset", "many-short", {"max_cudagraph_capture_size": 64}, "write-violation"),
    ("cudagraph-stale-local-lens", "dsv3", {"max_cudagraph_capture_size": 64}, "attention-metadata"),
    ("pcp-slots-cut-to-local-tokens", "glm-pcp2-dcp2", {}, "wrong-content"),
    ("pcp-uniform-decode-slots", "glm-pcp2-dcp2", {"tensor_parallel_size": 1, "num_speculative_tokens": 2}, "write-violation"),
    ("prefix-hit-gcd-aligned", "prefix-ragged-spans", {}, "wrong-content"),
    ("prefix-hit-gcd-aligned", "prefix-ragged-spans", {"decode_context_parallel_size": 4}, "wrong-content"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fault,name,options,kind", CASES, ids=[f"{c[0]}-{c[1]}-{len(c[2])}" for c in CASES])
def test_fault_is_detected_and_the_same_config_passes_without_it(fault, name, options, kind):
    sc = scenario(name, **options)
    assert FAULTS[fault].applies_to_scenario(sc, geometries(sc))
    clean = run(sc)
    assert clean.passed, clean.failure and clean.failure.lines()
    report = run(sc, fault)
    assert not report.passed
    assert report.failure.kind == kind, report.failure.lines()
    if fault == "padded-slots-not-reset":  # the dummies' writes, not a request's
        assert report.failure.request_id == PAD_REQUEST, report.failure.lines()
    if fault == "prefix-hit-gcd-aligned":  # the MLA group (48-token pages) misses positions below a hit
        assert "MLA" in report.failure.group, report.failure.lines()
