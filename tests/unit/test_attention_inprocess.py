"""``--attention`` end to end in one process: ranks as threads over ``ThreadCollectives``.

The built-in scenarios must pass the attention check for W in {1, 2, 3, 4, 8} with both
merge variants and both LSE bases, and every (group, request, step) must be checked. The
two attention faults (semantics section 8, bugs 3 and 4), a corrupted stored vector and
a broken merge collective must each end in an ``attention-mismatch``.
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import pytest
import torch

import dcpsim.attention.check as attention_check
from dcpsim.attention.config import DEFAULT_TOLERANCE
from dcpsim.attention.vectors import KVVectors
from dcpsim.faults import FAULTS
from dcpsim.runtime.collectives import run_in_threads
from dcpsim.scenario_file import load_scenario
from dcpsim.scheduler.scheduler import Scheduler
from dcpsim.simulation import Job, build_layouts, run_rank


def builtin(name, W, I=1, **ov):
    return load_scenario(name).with_overrides(
        decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, **ov)


def run(sc, **job):
    W = sc.config.decode_context_parallel_size
    reports = run_in_threads(run_rank, Job(sc, **job), W)
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps, r.attention_checks) for r in reports}
    assert len(verdicts) == 1, f"ranks disagree: {verdicts}"
    return reports[0]


def expected_checks(sc):
    """Every (attention group, write) of every step: rings are not attention KV."""
    layouts = build_layouts(sc)
    groups = sum(lay.storage != "ring" for lay in layouts)
    plans = list(Scheduler(sc, layouts).plans())
    writes = sum(len(p.writes) for p in plans)
    tokens = sum(w.stop - w.start for p in plans for w in p.writes)
    return groups * writes, groups * tokens


# ----------------------------------------------------------------------------- correct runs

CONFIGS = [(1, 1), (2, 16), (3, 1), (4, 16), (8, 1)]


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
    # a tiny budget forces sampling of every prefill chunk; the check still passes
    small = functools.partial(attention_check.AttentionConfig, max_query_keys=4096)
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr(attention_check, "AttentionConfig", small)
        rep = run(sc, attention=True)
    assert rep.passed and rep.attention_sampled_checks > 0
    assert rep.attention["max_query_keys"] == 4096
    assert rep.attention_query_tokens < base_tokens


# ----------------------------------------------------------------------------- faults


@pytest.mark.parametrize("name,fault,W,I,merge", [
    ("dsv3", "multi-token-local-lens", 2, 16, "alternate"),
    ("dsv41-hybrid", "multi-token-local-lens", 2, 16, "alltoall"),
    ("dsv3", "multi-token-local-lens", 3, 1, "allgather"),
    ("dsv3", "empty-shard-lse-zero", 2, 1, "alltoall"),
    ("dsv41-hybrid", "empty-shard-lse-zero", 2, 16, "alternate"),
    ("dsv41-hybrid", "empty-shard-lse-zero", 4, 16, "allgather"),
])
def test_attention_faults_are_detected(name, fault, W, I, merge):
    sc = builtin(name, W, I)
    assert FAULTS[fault].applies_to(build_layouts(sc))
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
    layouts = build_layouts(builtin("dsv41-hybrid", 1, 1))
    for name in ("multi-token-local-lens", "empty-shard-lse-zero"):
        fault = FAULTS[name]
        assert fault.bug_class.startswith(("3.", "4.")) and fault.description
        assert not fault.applies_to(layouts)


def test_a_corrupted_vector_is_caught_by_attention_only(monkeypatch):
    """The fingerprints stay right (the write check passes), but rank 1 writes the first K/V
    vector of every write of the replicated sliding-window group (group 0) wrong."""
    real = KVVectors.__call__

    def corrupt(self, group_id, contents):
        out = real(self, group_id, contents)
        if group_id == 0 and threading.current_thread().name == "rank1" and len(out):
            out = out.copy()
            out[0] += 0.5
        return out

    def run_rank_named(job, coll):
        threading.current_thread().name = f"rank{coll.rank}"
        return run_rank(job, coll)

    monkeypatch.setattr(KVVectors, "__call__", corrupt)
    sc = builtin("dsv41-hybrid", 2, 1)
    reports = run_in_threads(run_rank_named, Job(sc, attention=True), 2)
    assert {(r.passed, r.failure.kind if r.failure else None) for r in reports} == {(False, "attention-mismatch")}
    f = reports[0].failure
    assert f.step == 0 and f.group.startswith("SlidingWindowMLA")
    assert reports[0].verifications == 1  # the write check of that step passed
    own = [c for c in f.contributions if c["lse"] is not None]
    assert [c["rank"] for c in own] == [1]  # only rank 1 computes (and checks) that head


def test_a_broken_merge_collective_is_caught(monkeypatch):
    """A reduce-scatter that drops one rank's contribution: the merged output is wrong."""
    from dcpsim.runtime.collectives import ThreadCollectives

    real = ThreadCollectives.reduce_scatter_tensor

    def lossy(self, tensor):
        if self.rank == 0:
            tensor = tensor.clone()
            tensor[1] = 0  # rank 0's share for rank 1's heads never arrives
        return real(self, tensor)

    monkeypatch.setattr(ThreadCollectives, "reduce_scatter_tensor", lossy)
    rep = run(builtin("dsv3", 2, 1), attention=True, attention_merge="allgather")
    assert rep.failure and rep.failure.kind == "attention-mismatch"
    assert rep.failure.head >= 4  # rank 1's heads (4..7)


# ----------------------------------------------------------------------------- collectives


def test_thread_collectives_all_to_all_and_reduce_scatter():
    W = 3

    def body(_, coll):
        r = coll.rank
        t = torch.arange(W * 2, dtype=torch.float32).reshape(W, 2) + 100 * r
        a2a = coll.all_to_all_tensor(t)
        rs = coll.reduce_scatter_tensor(t)
        return a2a, rs, coll.bytes_sent

    for r, (a2a, rs, sent) in enumerate(run_in_threads(body, None, W)):
        assert torch.equal(a2a, torch.tensor([[2 * r, 2 * r + 1]], dtype=torch.float32) + 100 * torch.arange(W)[:, None])
        assert torch.equal(rs, torch.tensor([2 * r, 2 * r + 1], dtype=torch.float32) * W + 300)
        assert sent == 2 * W * 2 * 4


def test_report_json_is_strict_with_infinite_values():
    rep = run(builtin("dsv3", 2, 1), inject="empty-shard-lse-zero")
    text = rep.to_json()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert np.isfinite(rep.failure.error) or rep.failure.error == float("inf")
