"""The drafter's lookahead in the reference scheduler (semantics section 5): with an EAGLE / MTP
drafter every step's blocks cover its tokens plus ``num_speculative_tokens`` slots (vLLM's
``num_lookahead_tokens`` in ``allocate_slots``), never past ``max_model_len``; an ngram drafter
reserves none. The rows, the admissions and the preemptions follow."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.model.plan import EventKind
from dcpsim.model.specs import MambaSpec
from support.helpers import full_rep_spec as full_rep
from support.helpers import make_scenario, scheduler
from support.helpers import mamba_spec as mamba
from support.helpers import mla_spec as mla
from support.helpers import request_spec as R
from support.helpers import swa_spec as swa


def drafting(sc, method: str):
    """``sc`` with its drafter's ``speculative_method``."""
    return dataclasses.replace(sc, config=dataclasses.replace(sc.config, speculative_method=method))


def admitted_at(plans) -> dict[str, int]:
    return {e.request_id: p.step for p in plans for e in p.events if e.kind is EventKind.ADMITTED}


def row_lengths(plan, group: int = 0) -> dict[int, int]:
    return {ri: len(row) for ri, row in plan.rows_before[group].items()}


def two_prompts(method: str, num_gpu_blocks: int = 5, W: int = 1):
    """Two 31-token prompts at B = 16, k = 2: each prefill fits two blocks of its own (31 tokens),
    three with a lookahead of 2 (33 slots). Five blocks hold both without the lookahead."""
    reqs = [R("x", 31, 2), R("y", 31, 2)]
    sc = make_scenario({"mla.0": mla(16)}, reqs, W=W, k=2, budget=64, num_gpu_blocks=num_gpu_blocks, prefix=False)
    return drafting(sc, method)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_an_eagle_step_holds_one_block_more_when_its_lookahead_crosses_a_boundary(method):
    sched = scheduler(two_prompts(method, num_gpu_blocks=6))
    first = sched.step()
    assert row_lengths(first) == {0: 3, 1: 3}  # cdiv(31 + 2, 16), not cdiv(31, 16)
    assert sched.managers[0].pool.num_free == 0


def test_ngram_reserves_no_lookahead():
    sched = scheduler(two_prompts("ngram", num_gpu_blocks=6))
    first = sched.step()
    assert row_lengths(first) == {0: 2, 1: 2}
    assert sched.managers[0].pool.num_free == 2


def test_the_second_admission_waits_for_the_blocks_the_lookahead_takes():
    """Five blocks hold both prefills without the lookahead (2 + 2), not with it (3 + 3): the second
    request is admitted only once the first has finished and freed its blocks."""
    ngram = list(scheduler(two_prompts("ngram")).plans())
    eagle = list(scheduler(two_prompts("eagle")).plans())
    assert admitted_at(ngram) == {"x": 0, "y": 0}
    finished_x = next(p.step for p in eagle for e in p.events if e.kind is EventKind.FINISHED and e.request_id == "x")
    assert admitted_at(eagle) == {"x": 0, "y": finished_x + 1}
    assert len(eagle) > len(ngram)


def test_a_decode_step_that_needs_the_lookahead_block_preempts():
    """Two 61-token prompts at W = 2 (64-token entries), a pool of two blocks: every step of
    either ends by position 63, one entry each, but the first decode step's lookahead reaches
    slot 65, a second entry the pool has not: the last running request is preempted for it (an
    ngram drafter's run has none)."""
    reqs = [R("x", 61, 3, acceptance=(0,)), R("y", 61, 3, acceptance=(0,))]
    base = make_scenario({"mla.0": mla(32)}, reqs, W=2, k=2, budget=256, num_gpu_blocks=2, prefix=False)
    ngram, eagle = (scheduler(drafting(base, m)) for m in ("ngram", "eagle"))
    list(ngram.plans())
    plans = list(eagle.plans())
    assert ngram.stats["preemptions"] == 0
    assert eagle.stats["preemptions"] == 1
    step = next(p for p in plans if any(e.kind is EventKind.PREEMPTED for e in p.events))
    assert [e.request_id for e in step.events if e.kind is EventKind.PREEMPTED] == ["y"]
    (write,) = step.writes
    assert write.request_id == "x" and write.stop == 63 and len(step.rows_before[0][write.req_index]) == 2


def test_the_lookahead_stops_at_max_model_len():
    """A 31-token prompt of a 32-token request: 31 + 2 slots would be three blocks of 16, but no
    slot lies past max_model_len (vLLM's min(num_tokens + lookahead, max_model_len)): two."""
    sc = make_scenario({"mla.0": mla(16)}, [R("x", 31, 1)], k=2, budget=64, max_len=32, prefix=False)
    first = scheduler(drafting(sc, "eagle")).step()
    assert row_lengths(first) == {0: 2}


def test_every_attention_group_takes_the_lookahead_and_a_mamba_state_none():
    """A sharded MLA group, a replicated full-attention group and a sliding window all cover the
    lookahead (each in its own block size); a Mamba state group in align mode counts the target's
    tokens only (vLLM's MambaManager)."""
    layers = {"mla.0": mla(16), "rep.0": full_rep(16), "swa.0": swa(8, window=20), "m.0": mamba(16, k=2, mode="align")}
    sc = make_scenario(layers, [R("x", 63, 4)], W=2, k=2, budget=128, max_len=512, prefix=False)
    eagle, ngram = (scheduler(drafting(sc, m)) for m in ("eagle", "ngram"))
    first_eagle, first_ngram = eagle.step(), ngram.step()
    lengths = {}
    for g, geometry in enumerate(eagle.geometries):
        lengths[type(geometry.spec).__name__, geometry.spec.dcp_replicated] = (
            len(first_ngram.rows_before[g][0]),
            len(first_eagle.rows_before[g][0]),
        )
    assert lengths[("MLAAttentionSpec", False)] == (2, 3)  # cdiv(63, 32) vs cdiv(65, 32)
    assert lengths[("FullAttentionSpec", True)] == (4, 5)  # cdiv(63, 16) vs cdiv(65, 16)
    assert lengths[("SlidingWindowSpec", True)] == (8, 9)  # cdiv(63, 8) vs cdiv(65, 8)
    mamba_rows = {k: v for k, v in lengths.items() if k[0] == MambaSpec.__name__}
    assert list(mamba_rows.values()) == [(6, 6)], mamba_rows  # cdiv(63, 16) + 2, no lookahead


def test_an_eagle_schedule_passes_the_audit(audit, mixed, pressure):
    """The auditor's rows (every kind of group, pool pressure) cover the lookahead."""
    for sc in (mixed(), pressure(), mixed(W=4, I=1)):
        sched, aud = audit(drafting(sc, "eagle"))
        assert aud.lookahead == sc.config.num_speculative_tokens > 0
