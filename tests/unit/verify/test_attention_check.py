"""``--attention`` end to end in one process: ranks as threads over ``ThreadCollectives``.

The built-in scenarios must pass the attention check for W in {1, 2, 3, 4, 8} with both
merge variants and both LSE bases, and every (group, request, step) must be checked. The
two attention faults (semantics section 8, bugs 3 and 4), a corrupted stored vector, an
engine whose attention reads a wrong key and an engine whose merge collective drops a
contribution must each end in an ``attention-mismatch``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.harness.collectives import run_in_threads
from dcpsim.harness.job import Job
from dcpsim.harness.rank_run import run_rank
from dcpsim.harness.runner import merge_rank_reports
from dcpsim.model.attention_config import DEFAULT_TOLERANCE, AttentionConfig
from dcpsim.model.kinds import Storage
from support.helpers import builtin, geometries, run, scheduler


def expected_checks(sc):
    """Every (attention group, write) of every step: rings are not attention KV."""
    groups = sum(g.storage is not Storage.RING for g in geometries(sc))
    plans = list(scheduler(sc).plans())
    writes = sum(len(p.writes) for p in plans)
    tokens = sum(w.stop - w.start for p in plans for w in p.writes)
    return groups * writes, groups * tokens


def run_job(job):
    """``helpers.run`` for a ready-made ``Job``: every rank must reach the same verdict."""
    reports = run_in_threads(run_rank, job, job.world_size)
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps, r.attention_checks) for r in reports}
    assert len(verdicts) == 1, f"ranks disagree: {verdicts}"
    return merge_rank_reports(reports)


# ----------------------------------------------------------------------------- correct runs

CONFIGS = [(1, 1), (2, 16), (3, 1), (4, 16), (8, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("W,I", CONFIGS, ids=[f"W{w}-I{i}" for w, i in CONFIGS])
@pytest.mark.parametrize("name", ["dsv3", "dsv41-hybrid"])
def test_attention_passes_on_builtins(name, W, I):
    sc = builtin(name, W, I)
    rep = run(sc, attention=True)
    assert rep.passed and rep.failure is None, "\n".join(rep.failure.lines())
    checks, tokens = expected_checks(sc)
    assert rep.attention_checks == checks  # nothing skipped
    assert rep.attention_query_tokens == tokens and rep.attention_sampled_checks == 0
    assert 0 < rep.attention_max_error <= DEFAULT_TOLERANCE / 10  # float32 vs float64: ~1e-6
    if W == 1:
        assert rep.attention_merges == {"allgather": 0, "alltoall": 0} and rep.attention_bytes > 0
    else:  # alternate: both variants ran
        assert rep.attention_merges["allgather"] > 0 and rep.attention_merges["alltoall"] > 0
        assert rep.attention_bytes > rep.bytes_gathered  # merge traffic is counted apart
    text = rep.text()
    assert "attention: " in text and f"{checks} checks" in text and "max error" in text
    data = json.loads(rep.to_json())
    assert data["attention"]["heads"] == 8 and data["attention_checks"] == checks


@pytest.mark.slow
@pytest.mark.parametrize("merge", ["allgather", "alltoall"])
@pytest.mark.parametrize("base", ["e", "2"])
def test_merge_variants_and_bases(merge, base):
    sc = builtin("dsv3", 3, 16)  # 8 heads over 3 ranks: padded to 9, 3 per rank
    rep = run(sc, attention=True, attention_merge=merge, lse_base=base)
    assert rep.passed, "\n".join(rep.failure.lines())
    assert rep.attention_merges[merge] == rep.steps
    assert rep.attention_merges["alltoall" if merge == "allgather" else "allgather"] == 0
    assert rep.attention["lse_base"] == base
    assert rep.attention_max_error < 1e-5


def test_other_geometry_and_sizes():
    sc = builtin("dsv41-hybrid", 4, 16, kernel_block_size=32)
    rep = run(sc, attention=True, attention_heads=5, attention_head_dim=8, lse_base="2")
    assert rep.passed, "\n".join(rep.failure.lines())
    assert rep.attention["heads"] == 5 and rep.attention["head_dim"] == 8
    assert rep.attention_checks == expected_checks(sc)[0]


def test_huge_chunks_are_sampled():
    sc = builtin("dsv3", 2, 1)
    rep = run(sc, attention=True)
    base_tokens = rep.attention_query_tokens
    # a tiny budget (at most 4096 token-keys per group, request and step) forces sampling of
    # every prefill chunk of the built-ins; the check still passes
    rep = run_job(Job(sc, attention=AttentionConfig(enabled=True, max_query_keys=4096)))
    assert rep.passed and rep.attention_sampled_checks > 0
    assert rep.attention["max_query_keys"] == 4096
    assert rep.attention_query_tokens < base_tokens


# ----------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    "name,fault,W,I,merge",
    [
        ("dsv3", "multi-token-local-lens", 2, 16, "alternate"),
        ("dsv41-hybrid", "multi-token-local-lens", 2, 16, "alltoall"),
        ("dsv3", "multi-token-local-lens", 3, 1, "allgather"),
        ("dsv3", "empty-shard-lse-zero", 2, 1, "alltoall"),
        ("dsv41-hybrid", "empty-shard-lse-zero", 2, 16, "alternate"),
        ("dsv41-hybrid", "empty-shard-lse-zero", 4, 16, "allgather"),
    ],
)
def test_attention_faults_are_detected(name, fault, W, I, merge):
    sc = builtin(name, W, I)
    assert FAULTS[fault].applies_to(geometries(sc))
    # the fault needs the attention check and switches it on by itself
    rep = run(sc, inject=fault, attention_merge=merge)
    assert not rep.passed
    f = rep.failure
    assert f.kind == "attention-mismatch", "\n".join(f.lines())
    assert f.step == 0  # the first prefill chunk already shows it
    sharded = {g["name"] for g in rep.groups if g["sharded"]}
    assert f.group in sharded and f.request_id == "chat-0"
    assert f.error > DEFAULT_TOLERANCE and f.query_position is not None and f.head is not None
    assert [c["rank"] for c in f.contributions] == list(range(W))
    if fault == "empty-shard-lse-zero":  # an empty shard reported lse 0
        assert any(c["keys"] == 0 and c["lse"] == 0.0 for c in f.contributions)
    text = "\n".join(f.lines())
    assert f"query position: {f.query_position}" in text and "keys visible" in text
    data = json.loads(rep.to_json())
    assert data["failure"]["kind"] == "attention-mismatch"


def test_attention_faults_do_not_apply_without_sharding():
    unsharded = geometries(builtin("dsv41-hybrid", 1, 1))
    for name in ("multi-token-local-lens", "empty-shard-lse-zero"):
        fault = FAULTS[name]
        assert fault.bug_class.startswith(("3.", "4.")) and fault.description
        assert not fault.applies_to(unsharded)


def _assert_caught_on_rank_1_by_attention_only(rep):
    assert not rep.passed and rep.failure.kind == "attention-mismatch"
    f = rep.failure
    assert f.step == 0 and f.group.startswith("SlidingWindowMLA")
    assert rep.verifications == 1  # the write check of that step passed
    own = [c for c in f.contributions if c["lse"] is not None]
    assert [c["rank"] for c in own] == [1]  # only rank 1 computes (and checks) that head


_orig_apply = ModelRunner.apply


def test_a_corrupted_vector_is_caught_by_attention_only(monkeypatch):
    """The fingerprints stay right (the write check passes), but rank 1's worker stores the
    first K/V vector of every write of the replicated sliding-window group (group 0) wrong.
    A worker break (the engine decides slots, not what is stored), so ``ModelRunner.apply``
    is patched on the class: the vectors are corrupted before the step's attention."""

    def apply(self, plan, request_ids, during_step=None):
        def corrupt_then_attend(plan, runner):
            if runner.rank == 1:
                store = runner.stores[0]
                for w in runner.write_log:
                    if w.group == 0 and len(w.slots):
                        store.vectors.view(-1, store.vector_dim)[int(w.slots[0])] += 0.5
            if during_step is not None:
                during_step(plan, runner)

        return _orig_apply(self, plan, request_ids, during_step=corrupt_then_attend)

    monkeypatch.setattr(ModelRunner, "apply", apply)
    sc = builtin("dsv41-hybrid", 2, 1)
    assert geometries(sc)[0].name.startswith("SlidingWindowMLA") and geometries(sc)[0].replicated
    _assert_caught_on_rank_1_by_attention_only(run(sc, attention=True))


class ReadsAWrongKey(ReferenceEngine):
    """Rank 1's attention of replicated groups reads the second key's slot for the first key."""

    name = "reads-a-wrong-key"

    def attention_metadata(self, geometry, start, stop, block_row, dcp_rank, rows):
        slots, mask, merged = super().attention_metadata(geometry, start, stop, block_row, dcp_rank, rows)
        if dcp_rank == 1 and not merged and len(slots) > 1:
            slots = slots.copy()
            slots[0] = slots[1]
        return slots, mask, merged


def test_an_engine_reading_a_wrong_key_is_caught_by_attention_only():
    """What the engine stores is right (the write check passes), but rank 1's attention reads
    a wrong K/V for one key of the replicated sliding-window group."""
    _assert_caught_on_rank_1_by_attention_only(run(builtin("dsv41-hybrid", 2, 1), engine=ReadsAWrongKey(), attention=True))


class _LossyReduceScatter:
    """A process group whose reduce-scatter drops rank 0's share for rank 1's heads."""

    def __init__(self, group):
        self._group = group

    def __getattr__(self, name):
        return getattr(self._group, name)

    def reduce_scatter_tensor(self, tensor):
        if self._group.rank == 0:
            tensor = tensor.clone()
            tensor[1] = 0  # rank 0's share for rank 1's heads never arrives
        return self._group.reduce_scatter_tensor(tensor)


class LossyMerge(ReferenceEngine):
    """The merge across ranks runs over a reduce-scatter that loses a contribution."""

    name = "lossy-merge"

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        return super().merge_across_ranks(out, lse, _LossyReduceScatter(group), variant=variant, base=base)


def test_a_broken_merge_collective_is_caught():
    """A reduce-scatter that drops one rank's contribution: the merged output is wrong."""
    rep = run(builtin("dsv3", 2, 1), engine=LossyMerge(), attention=True, attention_merge="allgather")
    assert rep.failure and rep.failure.kind == "attention-mismatch"
    assert rep.failure.head >= 4  # rank 1's heads (4..7)


def test_report_json_is_strict_with_infinite_values():
    rep = run(builtin("dsv3", 2, 1), inject="empty-shard-lse-zero")
    text = rep.to_json()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert np.isfinite(rep.failure.error) or rep.failure.error == float("inf")
