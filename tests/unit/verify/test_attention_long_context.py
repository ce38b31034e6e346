"""The attention check at long contexts (``dcpsim.verify.attention``): the reference read in
key blocks from the per-request history equals the straightforward computation (gather the
whole context, one float64 softmax), and the step rule (``max_step_keys``) picks steps
deterministically, always the first and last of a request, within its budget."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import dcpsim.verify.attention as attention
from dcpsim.harness.collectives import run_in_threads
from dcpsim.harness.job import Job
from dcpsim.harness.rank_run import run_rank
from dcpsim.harness.runner import merge_rank_reports
from dcpsim.model.attention_config import DEFAULT_MAX_STEP_KEYS, AttentionConfig
from dcpsim.model.plan import RequestView, ReqWrite, StepPlan
from dcpsim.model.vectors import kv_vectors, query_vectors
from dcpsim.scenarios.load import load_scenario
from dcpsim.verify.attention import AttentionVerifier
from dcpsim.verify.attention_reference import check_step, context_keys, emit_positions, key_mask, key_range
from dcpsim.verify.geometry import expected_groups
from support.helpers import builtin, run


class _View:
    def __init__(self, groups):
        self.names = [g.layer_names[0] for g in groups]

    def group_of_layer(self, name):
        return self.names.index(name)


def verifier(groups, **config):
    coll = SimpleNamespace(rank=0, world_size=1, all_gather_tensor=lambda t: [t.clone()])
    return AttentionVerifier(AttentionConfig(**config), groups, coll, _View(groups))


def groups_by_kind():
    """One group of each kind: window, records, full (dsv41-hybrid) and chunk (Scout's, with
    a chunk of 300 tokens so that short contexts cross chunks)."""
    swa, records, full, _ring = expected_groups(load_scenario("dsv41-hybrid"))
    _full, chunk = expected_groups(load_scenario("llama4-scout"))
    return [swa, records, full, dataclasses.replace(chunk, attention_chunk_size=300)]


def reference_context(group, start: int, stop: int, rows):
    """The whole context of query positions ``start + rows``: (emit positions, mask)."""
    positions = np.arange(start, stop, dtype=np.int64)[np.asarray(rows, dtype=np.int64)]
    lo, hi = key_range(group, positions)
    keys = np.arange(lo, hi, dtype=np.int64)
    return emit_positions(group, keys), key_mask(group, keys, positions)


def straightforward(cfg, store, group, w, fingerprints, rows, h0, h1):
    """The reference as it was: the whole context gathered in float32, one float64 softmax."""
    emit, mask = reference_context(group, w.start, w.stop, rows)
    kv = np.empty((len(emit), cfg.kv_width), dtype=np.float32)
    hist = emit < w.start
    kv[hist] = kv_vectors(store, fingerprints[: w.start], cfg.kv_width)[emit[hist]]
    kv[~hist] = kv_vectors(store, w.contents[emit[~hist] - w.start], cfg.kv_width)
    kv = torch.from_numpy(kv).double()
    q = torch.from_numpy(query_vectors(store, w.req_index, w.start + rows, w.contents[rows], cfg.heads, cfg.head_dim))[:, h0:h1].double()
    logits = torch.einsum("qhd,nd->hqn", q, kv[:, : cfg.head_dim]) * cfg.softmax_scale
    logits.masked_fill_(~torch.from_numpy(mask)[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.softmax(logits, dim=-1)
    weights[:, ~mask.any(axis=1)] = 0.0  # a row that sees nothing: O = 0, lse = -inf
    return torch.einsum("hqn,nd->qhd", weights, kv[:, cfg.head_dim :]), lse.t()


@pytest.mark.slow
@pytest.mark.parametrize("float64_history", [True, False])
def test_blocked_reference_equals_straightforward(monkeypatch, float64_history):
    """Prefill chunks then decode steps with a draft, on one verifier (the history grows),
    with 97-key blocks (so that every context spans several, and split at odd places)."""
    monkeypatch.setattr(attention, "KEY_BLOCK", 97)
    if not float64_history:
        monkeypatch.setattr(attention, "HISTORY_FLOAT64_BYTES", 0)
    groups = groups_by_kind()
    ver = verifier(groups, heads=4, lse_base="2")
    cfg = ver.cfg
    rng = np.random.default_rng(7)
    fingerprints = rng.integers(-(2**62), 2**62, size=2600)
    view = SimpleNamespace(req_index=0, fingerprints=fingerprints)
    writes = [(0, 700), (700, 1400), (1400, 2100), (2100, 2103), (2103, 2106), (2106, 2107)]
    compared = 0
    for start, stop in writes:
        contents = fingerprints[start:stop].copy()
        contents[-1] ^= 0x5A5A  # a draft: the step's own contents, not the request's true ones
        w = ReqWrite(0, "r", start, contents)
        rows = np.arange(stop - start) if stop - start < 10 else np.array([0, 1, 99, 350, stop - start - 1])
        for store, group in enumerate(groups):
            for h0, h1 in ((0, 4), (1, 2)):
                res = SimpleNamespace(group=store, write=w, rows=rows, head0=h0, head1=h1)
                ((o, lse),) = ver._references([res], {0: view})
                o_ref, lse_ref = straightforward(cfg, store, group, w, fingerprints, rows, h0, h1)
                lse_ref = lse_ref / np.log(2.0)
                assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
                assert torch.allclose(o, o_ref, rtol=0, atol=1e-12), group.name
                assert torch.allclose(lse, lse_ref, rtol=0, atol=1e-12), group.name
                compared += 1
    assert compared == len(writes) * len(groups) * 2
    history = ver._true_kv[(1, 0)]  # records (R = 2): one key per two positions, filled to the last write
    assert history.n == 2106 // 2 and history.dtype == (np.float64 if float64_history else np.float32)
    assert (2, 0) in ver._true_kv and (0, 0) not in ver._true_kv  # a window reads no history


def test_step_rule():
    budget = 1000
    # within the budget: every step
    assert all(check_step(s, budget, budget, first=False, last=False) for s in range(50))
    # beyond it: every ceil(keys / budget)-th step, deterministically
    picked = [s for s in range(100) if check_step(s, 4500, budget, first=False, last=False)]
    assert picked == list(range(0, 100, 5))
    assert picked == [s for s in range(100) if check_step(s, 4500, budget, first=False, last=False)]
    assert check_step(3, 10**7, budget, first=True, last=False)
    assert check_step(3, 10**7, budget, first=False, last=True)
    assert not check_step(3, 10**7, budget, first=False, last=False)
    # the keys read per step, averaged over the steps, stay within the budget
    for keys in (1001, 1999, 2000, 2001, 77777):
        n = 10_000
        checked = sum(check_step(s, keys, budget, first=False, last=False) for s in range(n))
        assert checked * keys <= n * budget + keys
    assert DEFAULT_MAX_STEP_KEYS == AttentionConfig().max_step_keys == 2**18


def decode_plans(length, prompt, k):
    """One request: its prompt in one write, then writes of ``1 + k`` tokens to ``length``."""
    fingerprints = np.arange(length, dtype=np.int64) * 7 + 1
    step, start = 0, 0
    for stop in [prompt, *range(prompt + 1 + k, length + 1, 1 + k)]:
        finished = stop == length
        view = RequestView(0, "r", stop, fingerprints, finished=finished)
        yield StepPlan(step, (ReqWrite(0, "r", start, fingerprints[start:stop]),), (), (view,), ())
        step, start = step + 1, stop


def test_queries_follow_the_step_rule():
    groups = groups_by_kind()
    ver = verifier(groups, max_step_keys=1000)
    plans = list(decode_plans(5000 + 3 * 40, 5000, 2))
    taken = {store: [] for store in range(len(groups))}
    for plan in plans:
        for store, _req in ver.queries(plan):
            taken[store].append(plan.step)
    steps = [p.step for p in plans]
    assert taken[0] == steps  # the window (128 keys) and the chunk (<= 300): every step
    assert taken[3] == steps
    for store in (1, 2):  # records (2.5K keys), full (5K): first, last and every stride-th step
        group = groups[store]
        expect = [
            p.step
            for p in plans
            if p.step in (steps[0], steps[-1]) or p.step % -(-context_keys(group, p.writes[0].start, p.writes[0].stop) // 1000) == 0
        ]
        assert taken[store] == expect and steps[0] in expect and steps[-1] in expect
        assert len(expect) < len(steps)
    assert ver.skipped == sum(len(steps) - len(t) for t in taken.values())
    assert ver.checked_steps == len(steps)  # the window is checked at every step
    # another rank (another verifier, the same plans) takes the same decisions
    again = verifier(groups, max_step_keys=1000)
    assert [sorted(again.queries(p)) for p in plans] == [sorted((s, 0) for s in taken if p.step in taken[s]) for p in plans]


def step_budget_job(scenario, **options) -> Job:
    """A job whose attention check reads at most 64 keys a step before the step rule skips."""
    return Job.from_options(scenario, attention_max_step_keys=64, **options)


def test_run_with_a_tiny_step_budget_passes_and_reports_skips():
    sc = builtin("dsv3", 2, 1)
    full = run(sc, attention=True)
    reports = run_in_threads(run_rank, step_budget_job(sc, attention=True), 2, timeout=120)
    assert len({(r.passed, r.attention_checks, r.attention_skipped_checks) for r in reports}) == 1
    rep = merge_rank_reports(reports)
    assert rep.passed, "\n".join(rep.failure.lines())
    assert rep.attention["max_step_keys"] == 64
    assert rep.attention_skipped_checks > 0
    assert rep.attention_checks + rep.attention_skipped_checks == full.attention_checks
    assert 0 < rep.attention_checked_steps < rep.steps == full.steps
    assert "skipped by the step rule" in rep.text()


def test_attention_faults_still_caught_with_a_tiny_step_budget():
    """The first step of a request is always checked: the attention faults show there."""
    sc = builtin("dsv3", 2, 16)
    for fault in ("multi-token-local-lens", "empty-shard-lse-zero"):
        reports = run_in_threads(run_rank, step_budget_job(sc, inject=fault), 2, timeout=120)
        rep = merge_rank_reports(reports)
        assert not rep.passed and rep.failure.kind == "attention-mismatch", fault


@pytest.mark.slow
def test_key_blocks_dealt_to_ranks(monkeypatch):
    """With 32-key blocks every context is dealt over the 4 ranks: the merged reference
    gives the same errors as one block per context, and a fault is still caught."""
    sc = builtin("dsv41-hybrid", 4, 16)
    whole = run(sc, attention=True)
    monkeypatch.setattr(attention, "KEY_BLOCK", 32)
    dealt = run(sc, attention=True)
    assert dealt.passed and dealt.attention_checks == whole.attention_checks
    assert abs(dealt.attention_max_error - whole.attention_max_error) < 1e-12
    rep = run(sc, inject="empty-shard-lse-zero")
    assert not rep.passed and rep.failure.kind == "attention-mismatch"
