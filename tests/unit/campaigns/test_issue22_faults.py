"""The faults of issue 22's newer public bug classes, in one process (ranks as threads): each is
detected where selftest runs it, and the same scenario and config pass without it."""

from __future__ import annotations

import pytest
import torch

from dcpsim.engine.faults import FAULTS
from dcpsim.harness.dry_run import dry_run
from support.helpers import fault_scenario as scenario
from support.helpers import geometries, run

GATHER = {"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 4, "chunked_prefill_workspace_size": 64}

SHARDS = {"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 16}

PADDED = {"decode_context_parallel_size": 2, "max_cudagraph_capture_size": 64}
"""With ``attention`` and ``attention_padded_rows`` (job options, given to ``run``)."""

VARIANT = {"decode_context_parallel_size": 2}
"""With ``attention_merge = alltoall`` (a job option, given to ``run``)."""

CASES = [
    ("context-gather-whole-local-len", "dsv3", GATHER, "attention-metadata", "context gather chunk"),
    ("context-gather-whole-local-len", "prefix-sharing", GATHER, "attention-metadata", "context gather chunk"),
    (
        "empty-shard-lse-finite",
        "dsv3",
        {"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 16},
        "attention-mismatch",
        "must report -inf",
    ),
]


def test_the_gather_fault_needs_a_split_context():
    fault = FAULTS["context-gather-whole-local-len"]
    assert fault.applies_to_scenario(scenario("dsv3", **GATHER), geometries(scenario("dsv3", **GATHER)))
    # vLLM's default workspace (64K rows) holds every context of dsv3: nothing to split
    plain = scenario("dsv3", decode_context_parallel_size=2)
    assert not fault.applies_to_scenario(plain, geometries(plain))


def test_the_unguarded_merge_changes_true_rows_not_at_all_and_empty_rows_to_nan():
    fault = FAULTS["all-empty-rows-merge-nan"]
    out = torch.randn(2, 3, 4)  # 2 ranks, 3 rows: row 1 is empty on both ranks
    lses = torch.tensor([[1.5, float("-inf"), -3.0], [0.5, float("-inf"), float("-inf")]])
    want = FAULTS["none"].merge_attention_states(out, lses, "e")
    got = fault.merge_attention_states(out, lses, "e")
    assert torch.equal(got[0][[0, 2]], want[0][[0, 2]]) and torch.equal(got[1][[0, 2]], want[1][[0, 2]])
    assert torch.isnan(got[1][1]) and torch.isnan(got[0][1]).all()  # the row empty on both ranks
    assert torch.isneginf(want[1][1]) and (want[0][1] == 0).all()


def test_a_finite_masked_lse_changes_no_merged_value_beside_a_real_shard():
    """Why flashinfer#4452 needs the section-6 rule: the merge alone cannot see it."""
    from dcpsim.engine.attention.merge import merge_attention_states
    from dcpsim.engine.faults.attention import FLASHINFER_MASKED_LSE

    out = torch.randn(2, 3, 4)
    good = merge_attention_states(out, torch.tensor([[1.5, 0.2, -3.0], [float("-inf")] * 3]))
    finite = merge_attention_states(out, torch.tensor([[1.5, 0.2, -3.0], [FLASHINFER_MASKED_LSE] * 3]))
    assert torch.equal(good[0], finite[0]) and torch.equal(good[1], finite[1])
    # rows empty on every rank: -inf stays -inf, the finite stand-in does not
    assert torch.isneginf(merge_attention_states(out, torch.full((2, 3), float("-inf")))[1]).all()
    assert torch.isfinite(merge_attention_states(out, torch.full((2, 3), FLASHINFER_MASKED_LSE))[1]).all()


@pytest.mark.slow
@pytest.mark.parametrize("fault,name,options,kind,text", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_fault_is_detected_and_the_same_config_passes_without_it(fault, name, options, kind, text):
    sc = scenario(name, **options)
    assert FAULTS[fault].applies_to_scenario(sc, geometries(sc))
    job = {"attention": True, "attention_padded_rows": True} if options is PADDED else {}
    job = {"attention": True, "attention_merge": "alltoall"} if options is VARIANT else job
    dry_run(sc)
    clean = run(sc, **job)
    assert clean.passed, clean.failure and clean.failure.lines()
    report = run(sc, inject=fault, **job)
    assert not report.passed
    assert report.failure.kind == kind, report.failure.lines()
    assert any(text in line for line in report.failure.lines()), report.failure.lines()
