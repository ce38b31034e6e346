"""Run a batch of jobs of one W in one world (gloo processes, or threads), and merge the
ranks' reports. The one runner behind ``run``, ``replay``, ``matrix``, ``selftest`` and
``fuzz``; ``worker`` merges its ranks' reports with the same ``merge_rank_reports``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dcpsim.harness.collectives import Collectives, GlooCollectives, run_in_threads
from dcpsim.harness.job import Job
from dcpsim.harness.rank import run_rank
from dcpsim.plural import plural
from dcpsim.verify.report import Failure, FailureKind, RunReport


def run_batch(jobs: list[Job], coll: Collectives) -> list[RunReport]:
    """What every rank runs: the jobs in turn, over one ``Collectives``."""
    return [run_rank(job, coll) for job in jobs]


def gloo_rank_batch(jobs: list[Job], rank: int, world_size: int) -> list[RunReport]:
    """``world.run_world`` target: ``run_batch`` over the rank's gloo process group."""
    return run_batch(jobs, GlooCollectives(rank, world_size))


def run_jobs(jobs: list[Job], *, in_process: bool = False, timeout: float = 30.0,
             deadline: float | None = None) -> list[RunReport]:
    """Run jobs of one W in turn in one world; one merged report per job.

    The default deadline is a backstop (a hang ends at the process-group timeout):
    ``2 * timeout + 30`` s for one job, 10 s more per further job, so a long batch of
    healthy runs is never cut short.
    """
    world = jobs[0].world_size
    if any(j.world_size != world for j in jobs):
        raise ValueError("run_jobs: every job of one world must have the same decode_context_parallel_size")
    if in_process:
        per_rank = run_in_threads(run_batch, jobs, world)
    else:
        from dcpsim.harness.world import run_world

        if deadline is None:
            deadline = 2 * timeout + 30 + 10 * (len(jobs) - 1)
        preload = ("dcpsim.harness.batch",)
        if any(j.engine == "vllm" for j in jobs):  # import Triton once, in the forkserver
            preload += ("dcpsim.engine.vllm.preload",)
        per_rank = run_world(gloo_rank_batch, jobs, world_size=world, pg_timeout_s=timeout,
                             deadline_s=deadline, preload=preload)
    return [merge_rank_reports([reports[k] for reports in per_rank]) for k in range(len(jobs))]


@dataclass
class JobOutcome:
    """One job of ``run_each``: its merged report, or the exception that broke its world."""

    report: RunReport | None
    error: Exception | None
    seconds: float
    """Wall time of the job (a batch's time shared equally among its jobs)."""


def run_each(jobs: list[Job], *, in_process: bool = False, timeout: float = 30.0) -> list[JobOutcome]:
    """Run jobs of one W in one world; if that world breaks, rerun each job in a world of
    its own, so that the breakage is attributed to the job(s) that cause it. The one batch
    runner of ``matrix`` and ``selftest``."""
    start = time.perf_counter()
    try:
        reports = run_jobs(jobs, in_process=in_process, timeout=timeout)
    except Exception:  # noqa: BLE001 - rerun one by one to attribute the breakage
        reports = None
    if reports is not None:
        each = (time.perf_counter() - start) / len(jobs)
        return [JobOutcome(report, None, each) for report in reports]
    out = []
    for job in jobs:
        one = time.perf_counter()
        try:
            (report,) = run_jobs([job], in_process=in_process, timeout=timeout)
            out.append(JobOutcome(report, None, time.perf_counter() - one))
        except Exception as exc:  # noqa: BLE001 - reported in the outcome
            out.append(JobOutcome(None, exc, time.perf_counter() - one))
    return out


def merge_rank_reports(reports: list[RunReport]) -> RunReport:
    """Rank 0's verdict (all ranks judged the same gathered data) with every rank's
    figures; a ``ranks-disagree`` failure if any rank reached another verdict."""
    merged = reports[0]
    merged.ranks = [r.ranks[0] for r in reports]
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps) for r in reports}
    if len(verdicts) != 1:
        merged.passed = False
        merged.failure = Failure(
            kind=FailureKind.RANKS_DISAGREE,
            step=min(r.steps for r in reports),
            message="ranks reached different verdicts: "
            + "; ".join(f"rank {i}: {'pass' if r.passed else r.failure.kind} after {plural(r.steps, 'step')}"
                        for i, r in enumerate(reports)),
        )
    return merged
