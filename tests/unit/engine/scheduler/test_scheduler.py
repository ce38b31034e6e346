"""``Scheduler``: chunked prefill, (speculative) decode, preemption, admission, determinism,
the construction-time fit check. Expected numbers are worked out by hand in comments; runs
that go through the auditor (``tests/support/schedule_auditor.py``) are checked step by step as well."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.model.config import SimConfig
from dcpsim.model.plan import EventKind, PreemptReason, ScheduleEvent
from dcpsim.model.scenario import Scenario, ScenarioOverrides
from dcpsim.scenarios.load import load_scenario
from support.helpers import full_rep_spec as full_rep
from support.helpers import geometries, scheduler
from support.helpers import make_scenario as scenario
from support.helpers import mla_spec as mla
from support.helpers import request_spec as R
from support.helpers import swa_spec as swa

# ----------------------------------------------------------------------------- steps


def test_chunked_prefill_splits_under_budget():
    # budget 40, one request of 100 prompt tokens: chunks 40, 40, 20, then decode of 1 + 0.
    sc = scenario({"mla.0": mla(16)}, [R("a", 100, 3)], W=2, budget=40)
    sched = scheduler(sc)
    sizes = [[(w.start, len(w.contents)) for w in p.writes] for p in sched.plans()]
    assert sizes == [[(0, 40)], [(40, 40)], [(80, 20)], [(100, 1)], [(101, 1)]]


def test_long_prefill_token_threshold_caps_each_request_and_admits_beside_it():
    # budget 64, threshold 24: "a" (prompt 60) gets 24, 24, 12 tokens; "b" (prompt 30)
    # arrives at step 1 and is admitted beside a's chunk with 24 (the budget had 40 left),
    # then 6. Decode steps (1 + k drafts, k = 2) stay under the threshold.
    # (Acceptance is seeded: only the first decode step's size is fixed.)
    sc = scenario({"mla.0": mla(16)}, [R("a", 60, 4), R("b", 30, 4, arrival_step=1)], W=2, k=2, budget=64, prefix=False)
    sc = dataclasses.replace(sc, config=dataclasses.replace(sc.config, long_prefill_token_threshold=24))
    sizes = [[(w.request_id, w.start, len(w.contents)) for w in p.writes] for p in scheduler(sc).plans()]
    assert sizes[:3] == [[("a", 0, 24)], [("a", 24, 24), ("b", 0, 24)], [("a", 48, 12), ("b", 24, 6)]]
    assert sizes[3] == [("a", 60, 3), ("b", 30, 3)]  # decode: 1 true token + 2 drafts


def test_decode_writes_one_plus_drafts_and_rejection_rewrites():
    # k = 3, acceptance (1,): prompt 10, output 9.
    # step 0: prefill [0,10), output 1, committed 10, known 11.
    # step 1: write [10,14) = 1 true + 3 drafts; accept 1 -> committed 12, output 3;
    #         positions 12, 13 are rejected drafts (wrong contents).
    # step 2: write [12,16): 12 rewritten with the true content, now accepted 1 -> committed 14.
    sc = scenario({"mla.0": mla(16)}, [R("a", 10, 9, acceptance=(1,))], W=2, k=3)
    sched = scheduler(sc)
    fp = sched.requests[0].fingerprints
    plans = list(sched.plans())
    w1, w2 = plans[1].writes[0], plans[2].writes[0]
    assert (w1.start, len(w1.contents)) == (10, 4)
    assert plans[1].views[0].num_committed == 12
    assert np.array_equal(w1.contents[:2], fp[10:12])
    assert w1.contents[2] != fp[12] and w1.contents[3] != fp[13]
    assert (w2.start, len(w2.contents)) == (12, 4)
    assert w2.contents[0] == fp[12] and w2.contents[0] != w1.contents[2]
    assert w2.contents[1] == fp[13] and w2.contents[1] != w1.contents[3]
    # the last steps cap the drafts at remaining_output - 1 (never past the final length 18)
    assert max(w.stop for p in plans for w in p.writes) == 10 + 9 - 1


def test_scheduler_marks_the_draft_rows_of_each_write():
    sc = load_scenario("dsv41-hybrid")
    k = sc.config.num_speculative_tokens
    seen = 0
    for plan in scheduler(sc).plans():
        for w in plan.writes:
            assert 0 <= w.num_drafts <= k
            if w.num_drafts:
                assert len(w.contents) == 1 + w.num_drafts  # decode: the true token, then drafts
                seen += 1
    assert seen > 50


# ----------------------------------------------------------------------------- preemption and admission


def test_forced_preemption_frees_everything_and_recomputes(auditor):
    # without prefix caching the victim restarts from 0 and every block goes back to the pool
    layers = {"mla.0": mla(16), "swa.0": swa(8, 20)}
    reqs = [R("a", 64, 20, preempt_at_steps=(3,)), R("b", 30, 30)]
    sc = scenario(layers, reqs, W=2, budget=32, prefix=False)
    sched = scheduler(sc)
    aud = auditor(sched)
    starts = []
    for plan in sched.plans():
        aud.feed(plan)  # checks held + free == pool after every step
        starts += [(plan.step, w.start) for w in plan.writes if w.request_id == "a"]
        if plan.step == 3:
            assert ScheduleEvent(EventKind.PREEMPTED, "a", reason=PreemptReason.SCENARIO) in plan.events
            assert "preempted a (scenario)" in map(str, plan.events)  # its line in a timeline
    aud.finish()
    st = aud.req[0]
    assert st.preemptions == [(3, "scenario")]
    after = [s for step, s in starts if step >= 3]
    assert after and after[0] == 0, starts


@pytest.mark.parametrize("which", ["dsv3", "mixed"], ids=["dsv3", "mixed"])
def test_no_admission_in_a_step_that_preempted(which, mixed):
    # scheduler docstring: waiting requests are admitted "not in a step that preempted" -- for a
    # preempt_at_steps preemption too (dsv3: long-doc preempted at step 12 is not readmitted in
    # step 12 with a self prefix hit of 1408 tokens).
    sc = load_scenario("dsv3") if which == "dsv3" else mixed(W=2, I=2)
    sched = scheduler(sc)
    preempting_steps = 0
    for plan in sched.plans():
        if any(e.kind is EventKind.PREEMPTED for e in plan.events):
            preempting_steps += 1
            assert not any(e.kind is EventKind.ADMITTED for e in plan.events), plan.events
    assert preempting_steps


def test_pool_pressure_preemption_restarts_from_zero_without_prefix_cache(audit, pressure):
    sc = pressure(W=2, num_gpu_blocks=8, prefix=False)
    sched, aud = audit(sc)
    victims = [st for st in aud.req.values() if st.preemptions]
    assert victims and all(why == "out of blocks" for st in victims for _, why in st.preemptions)
    for st in victims:
        assert st.hits == [0] * st.admissions
        assert st.writes_from_zero_after_preemption == len(st.preemptions)


def test_max_num_seqs_and_late_arrival(auditor):
    # max_num_seqs = 1: never two requests holding blocks; "late" arrives at step 5 and nothing
    # runs before it (empty plans), "early" waits for "late" only if it arrives later.
    layers = {"mla.0": mla(16)}
    reqs = [R("late", 20, 4, arrival_step=5), R("later", 20, 4, arrival_step=6)]
    cfg = SimConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=1)
    sc = Scenario(name="t", layers=layers, config=cfg, requests=tuple(reqs))
    sched = scheduler(sc)
    aud = auditor(sched)
    plans = []
    for plan in sched.plans():
        aud.feed(plan)
        plans.append(plan)
        assert len(plan.rows_before[0]) <= 1
    aud.finish()
    assert all(p.writes == () and p.views == () for p in plans[:5])
    assert plans[5].writes[0].request_id == "late"
    first_later = next(p.step for p in plans if any(w.request_id == "later" for w in p.writes))
    last_late = max(p.step for p in plans if any(w.request_id == "late" for w in p.writes))
    assert first_later == last_late + 1


# ----------------------------------------------------------------------------- determinism


def test_determinism_two_schedulers_same_plans(mixed, pressure):
    for sc in (mixed(W=3, I=2), load_scenario("dsv3"), pressure(W=2, num_gpu_blocks=8)):
        a = list(scheduler(sc).plans())
        b = list(scheduler(sc).plans())
        assert len(a) == len(b)
        for p, q in zip(a, b):
            assert p.events == q.events and p.last == q.last
            assert [(w.req_index, w.start) for w in p.writes] == [(w.req_index, w.start) for w in q.writes]
            assert all(np.array_equal(w.contents, x.contents) for w, x in zip(p.writes, q.writes))
            for rows_p, rows_q in zip(p.rows_before + p.rows_after, q.rows_before + q.rows_after):
                assert rows_p.keys() == rows_q.keys()
                assert all(np.array_equal(rows_p[r], rows_q[r]) for r in rows_p)
            assert [(v.req_index, v.num_committed) for v in p.views] == [(v.req_index, v.num_committed) for v in q.views]


def test_seed_changes_contents_not_shape(mixed):
    sc = mixed(W=2, I=2)
    a = list(scheduler(sc).plans())
    sc2 = sc.with_overrides(ScenarioOverrides(seed=7))
    b = list(scheduler(sc2).plans())
    assert not np.array_equal(a[0].writes[0].contents, b[0].writes[0].contents)


# ----------------------------------------------------------------------------- construction


def test_request_that_can_never_fit_raises_at_construction():
    # B=16, W=2: 32 tokens per block; 200 + 20 + 3 tokens need 7 blocks, the pool has 3.
    sc = scenario({"mla.0": mla(16)}, [R("small", 10, 5), R("huge-req", 200, 20)], W=2, k=3, num_gpu_blocks=3)
    layouts = geometries(sc)
    with pytest.raises(ConfigError) as exc:
        Scheduler(sc, ReferenceEngine(), layouts)
    msg = str(exc.value)
    assert "'huge-req'" in msg and layouts[0].name in msg and "7" in msg and "3" in msg


def test_request_that_can_never_fit_names_the_right_group():
    # the MLA group fits (cdiv(223, 32) = 7 <= 8) but the replicated B=16 group needs 14 > 8
    layers = {"mla.0": mla(16), "rep.0": full_rep(16)}
    sc = scenario(layers, [R("r", 200, 20)], W=2, k=3, num_gpu_blocks=8)
    layouts = geometries(sc)
    with pytest.raises(ConfigError) as exc:
        Scheduler(sc, ReferenceEngine(), layouts)
    rep = next(lay for lay in layouts if lay.replicated)
    assert rep.name in str(exc.value) and "'r'" in str(exc.value)


# ----------------------------------------------------------------------------- windowed pools


def test_windowed_live_blocks_covers_every_window_position_exactly():
    # the live entries of a windowed request span the reach + n + k positions from the
    # block of c - reach to that of c + n + k - 1: counted here block by block for every
    # offset of that run inside its first block; the bound must cover the worst offset and
    # be at most one block above it (cdiv(L, span) + 1 is the closed form)
    from types import SimpleNamespace

    from dcpsim.engine.scheduler.scheduler import windowed_live_blocks
    from dcpsim.model.kinds import Retention

    for span in (1, 2, 16, 64):
        for reach in (0, 1, 5, 63, 127, 128):
            for n, k in ((1, 0), (16, 3), (256, 0), (100, 2)):
                positions = reach + n + k
                worst = max(len({p // span for p in range(o, o + positions)}) for o in range(span))
                geometry = SimpleNamespace(
                    retention=Retention.WINDOW,
                    manager_block_size=span,
                    spec=SimpleNamespace(sliding_window=reach + 1, extra_retained_tokens=0),
                )
                config = SimpleNamespace(max_in_flight_tokens=n, num_speculative_tokens=k)
                bound = windowed_live_blocks(geometry, config)
                assert worst <= bound <= worst + 1, (span, reach, n, k, worst, bound)


@pytest.mark.parametrize("name", ["dsv41-hybrid", "gpt-oss-hybrid", "heavy-rejection", "llama4-chunked", "llama4-scout"])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_no_windowed_request_holds_more_blocks_than_its_pool_counts_it_at(name, W):
    # the pools count a windowed request at windowed_live_blocks, not its whole row: every
    # request of every step of the built-ins must fit in that
    from dcpsim.engine.scheduler.scheduler import windowed_live_blocks

    sched = scheduler(load_scenario(name).with_overrides(ScenarioOverrides(decode_context_parallel_size=W)))
    bounds = [windowed_live_blocks(g, sched.config) for g in sched.geometries]
    assert any(b is not None for b in bounds)
    most = [0] * len(bounds)
    for plan in sched.plans():
        for g, bound in enumerate(bounds):
            if bound is None:
                continue
            for rows in (plan.rows_before[g], plan.rows_after[g]):
                for row in rows.values():
                    held = int(np.count_nonzero(np.asarray(row)))
                    most[g] = max(most[g], held)
                    assert held <= bound, (sched.geometries[g].spec, held, bound)
    assert all(m > 0 for m, b in zip(most, bounds) if b is not None)
