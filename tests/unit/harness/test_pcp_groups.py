"""PCP x TP x DCP worlds over threads: each rank's groups, the PCP prefill gather, the
faults that break it, the agreement of several DCP groups, and the report of a hang."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.worker.pcp_prefill import MISSING_KV, pcp_prefill
from dcpsim.harness.collectives import CollectiveTimeout, run_in_threads
from dcpsim.harness.groups import build_groups
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.world_failure import RankFailure, failure_error
from dcpsim.model.config import SimConfig
from dcpsim.model.plan import ReqWrite, StepPlan
from support.helpers import allowed_parallel_sizes, pcp_scenario, run

SIZES = allowed_parallel_sizes(8)


@pytest.mark.parametrize("pcp,tp,dcp", SIZES)
def test_every_rank_knows_its_coordinates_and_its_groups_gather_their_members(pcp, tp, dcp):
    config = SimConfig(decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp, tensor_parallel_size=tp)
    layout = config.parallel_layout

    def body(_, coll):
        g = build_groups(config, coll)
        dcp_members = g.dcp.all_gather_object(coll.rank)
        pcp_members = g.pcp.all_gather_object(coll.rank) if g.pcp is not None else [coll.rank]
        tp_members = g.tp.all_gather_object(coll.rank) if g.tp is not None else None
        return g.coords, g.dcp.rank, dcp_members, pcp_members, tp_members

    for rank, (coords, dcp_rank, dcp_members, pcp_members, tp_members) in enumerate(run_in_threads(body, None, pcp * tp)):
        assert coords == layout.coords(rank) and dcp_rank == coords.dcp_rank
        assert dcp_members == layout.dcp_groups()[coords.dcp_group]
        assert pcp_members == layout.pcp_groups()[coords.tp_rank]
        if tp > 1 and not (pcp == 1 and dcp == tp):
            assert tp_members == layout.tp_groups()[coords.pcp_rank]


def _plan(*writes):
    return StepPlan(step=0, writes=tuple(writes), rows_before=(), views=(), rows_after=())


def _gathered(engine, plan, pcp, dcp):
    def body(_, coll):
        return pcp_prefill(engine, plan, coll, coll.rank, pcp, dcp)

    return run_in_threads(body, None, pcp)


def test_the_gather_gives_every_rank_the_whole_row_and_a_broken_restore_does_not():
    contents = np.arange(100, 120, dtype=np.int64)
    plan = _plan(ReqWrite(0, "a", 0, contents, prefill=True), ReqWrite(1, "b", 40, np.array([7, 8]), prefill=False))
    for got in _gathered(ReferenceEngine(), plan, 2, 2):
        assert np.array_equal(got.writes[0].contents, contents)
        assert got.writes[1] is plan.writes[1]  # a decode is not split
    # rank r computes chunks r and r + 2 but the restore puts them at r and 3 - r: chunks 2 and 3 swap
    for got in _gathered(FAULTS["pcp-chunks-not-mirrored"], plan, 2, 2):
        c = got.writes[0].contents
        assert np.array_equal(c[:10], contents[:10])
        assert np.array_equal(c[10:15], contents[15:]) and np.array_equal(c[15:], contents[10:15])


def test_a_rank_that_skips_the_gather_holds_only_its_own_chunks():
    plan = _plan(ReqWrite(0, "a", 0, np.array([11, 12], np.int64), prefill=True))
    engine = FAULTS["pcp-gather-rank-local"]
    assert not engine.pcp_enters_gather([(0, 2)], 2, 0) and engine.pcp_enters_gather([(0, 2)], 2, 1)
    got = pcp_prefill(engine, plan, None, 0, 2, 2)  # rank 0 never touches its collectives
    assert got.writes[0].contents.tolist() == [11, MISSING_KV]
    # the reference replicates it: no gather at all
    assert pcp_prefill(ReferenceEngine(), plan, None, 0, 2, 2) is plan


@pytest.mark.parametrize("pcp,tp,dcp", [(2, 1, 2), (2, 2, 1), (2, 2, 4), (1, 4, 2), (4, 1, 1)])
def test_pcp_worlds_pass_with_the_reference_engine(pcp, tp, dcp):
    report = run(pcp_scenario(pcp, tp, dcp))
    assert report.passed, report.failure and report.failure.lines()
    assert len(report.ranks) == pcp * tp
    assert report.prefill_context_parallel_size == pcp


@pytest.mark.parametrize(
    "fault,sizes",
    [
        ("pcp-chunks-not-mirrored", (2, 1, 2)),
        ("pcp-chunks-not-mirrored", (2, 2, 1)),
        ("dcp-rank-not-transposed", (2, 2, 4)),
        ("dcp-rank-not-transposed", (2, 2, 2)),
    ],
)
def test_pcp_faults_are_caught_as_wrong_content(fault, sizes):
    report = run(pcp_scenario(*sizes), inject=fault)
    assert not report.passed and report.failure.kind == "wrong-content"
    assert report.failure.step == 0
    if sizes[0] * sizes[1] > sizes[2]:  # several DCP groups: the report names the failing one
        assert report.failure.message.startswith("DCP group ")


def test_the_regular_mask_of_a_speculative_step_is_caught_in_the_metadata():
    report = run(pcp_scenario(2, 1, 2, k=2), inject="pcp-spec-regular-mask")
    assert not report.passed and report.failure.kind == "attention-metadata"


def test_the_rank_local_gather_plan_hangs_and_the_timeout_names_the_ranks():
    job = Job.from_options(pcp_scenario(2, 1, 2), inject="pcp-gather-rank-local")
    with pytest.raises(CollectiveTimeout) as exc:
        run_jobs([job.with_options(in_process=True, timeout=1.0)])
    text = str(exc.value)
    assert "rank 0 in its dcp group" in text and "rank 1 in its pcp group" in text


def test_a_gloo_hang_names_the_rank_that_ran_ahead():
    phases = ("write", "pcp kv gather", "verify")
    timed_out = [
        RankFailure(1, 5, "pcp kv gather", "RuntimeError", "Timed out waiting 1000ms", ""),
        RankFailure(0, 5, "verify", "RuntimeError", "Timed out waiting 1000ms", ""),
    ]
    err = failure_error(timed_out, [], 2, phases)
    assert str(err).splitlines()[0] == (
        "collective hang in a world of 2 ranks: rank 0 skipped a collective: ran ahead to step 5 (verify) "
        "while rank 1 waited at step 5 (pcp kv gather); every rank then timed out"
    )
    assert [f.rank for f in err.failures if f.primary] == [0]
    # ranks stuck at the same place: no one ran ahead, the old report
    same = [dataclasses.replace(f, what="verify") for f in timed_out]
    assert str(failure_error(same, [], 2, phases)).startswith("rank failure in a world of 2 ranks")
