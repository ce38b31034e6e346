"""Run a batch of jobs of one W in one world (gloo processes, or threads), and merge the
ranks' reports. The one runner behind ``run``, ``replay``, ``matrix``, ``selftest`` and
``fuzz``; ``worker`` merges its ranks' reports with the same ``merge_rank_reports``.

Each rank times every job it runs and tells the parent (``rank_process.send_event``, or a call
across threads) as soon as the job ends, so a caller hears of each job when the last rank
finishes it (``on_job``), with the time the slowest rank took, long before the world ends.
With a ``Trace`` (``--trace``), every rank records its events and the parent merges them.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from dataclasses import dataclass

from dcpsim.collectives import Collectives
from dcpsim.engine.choice import REAL_ENGINES
from dcpsim.engine.loading import forkserver
from dcpsim.harness.caller_main import check_plugins
from dcpsim.harness.collectives import GlooCollectives, run_in_threads
from dcpsim.harness.job import Job
from dcpsim.harness.parent_schedule import ScheduleLoader, file_loaders, parent_schedules_of, shared_schedules
from dcpsim.harness.progress import NO_PROGRESS, Progress
from dcpsim.harness.rank_process import PIPE_PROGRESS, send_event
from dcpsim.harness.rank_run import STEP_PHASES, run_rank
from dcpsim.harness.streams import shared_streams_of
from dcpsim.harness.trace import NULL_RECORDER, NullRecorder, TracedCollectives, TraceRecorder
from dcpsim.harness.trace_file import Trace
from dcpsim.harness.world import RANK_PRELOAD, run_world
from dcpsim.model.shared_streams import attach
from dcpsim.plural import plural
from dcpsim.verify.report import Failure, FailureKind, RunReport


def run_batch(
    jobs: list[Job], coll: Collectives, on_job=None, recorder: NullRecorder = NULL_RECORDER, progress: Progress = NO_PROGRESS,
    schedules: list[ScheduleLoader | None] | None = None,
) -> list[RunReport]:  # fmt: skip
    """What every rank runs: the jobs in turn, over one ``Collectives``; ``on_job(k, report,
    seconds)`` after each, with this rank's report and the time it took. ``schedules``: each
    job's loader of the launcher's schedule (``harness.parent_schedule``), or None."""
    reports = []
    for k, job in enumerate(jobs):
        start = time.perf_counter()
        schedule = schedules[k] if schedules else None
        with recorder.span(f"job {k}: {job.scenario.name}", "job"):
            reports.append(run_rank(job, coll, recorder=recorder, progress=progress, schedule=schedule))
        if on_job is not None:
            on_job(k, reports[-1], time.perf_counter() - start)
    return reports


def rank_batch(
    payload: tuple[list[Job], int | None], coll: Collectives, on_job=None, progress: Progress = NO_PROGRESS,
    schedules: list[ScheduleLoader | None] | None = None,
) -> tuple[list[RunReport], list[dict]]:  # fmt: skip
    """A rank's batch: ``payload`` is the jobs and the trace's clock origin (None: no
    trace); ``schedules`` as ``run_batch``'s. Returns the reports and the rank's trace events."""
    jobs, origin_ns = payload
    if origin_ns is None:
        return run_batch(jobs, coll, on_job, progress=progress, schedules=schedules), []
    recorder = TraceRecorder(coll.rank, origin_ns)
    return run_batch(jobs, TracedCollectives(coll, recorder), on_job, recorder, progress, schedules), recorder.events


def _tell_parent(k: int, report: RunReport, seconds: float) -> None:
    send_event(("job", k, report, seconds))


def gloo_rank_batch(payload: tuple[list[Job], int | None, str | None, str | None], rank: int, world_size: int):
    """``world.run_world`` target: ``rank_batch`` over the rank's gloo process group, telling
    the parent as each job ends. ``payload``: the jobs, the trace's clock origin, the
    directory of the world's shared streams (``shared_streams_of``) and that of the
    launcher's schedules (``parent_schedules_of``)."""
    jobs, origin_ns, streams, schedules = payload
    attach(streams)
    coll = GlooCollectives(rank, world_size)
    loaders = file_loaders(schedules, len(jobs))
    return rank_batch((jobs, origin_ns), coll, on_job=_tell_parent, progress=PIPE_PROGRESS, schedules=loaders)


def _thread_rank_batch(payload, coll: Collectives, tally: JobTally, schedules: list[ScheduleLoader | None]):
    """``run_in_threads`` target: ``rank_batch``, telling the tally as each job ends."""
    return rank_batch(payload, coll, on_job=functools.partial(tally.add, coll.rank), schedules=schedules)


class JobTally:
    """Gathers each job's rank reports as they arrive (from any thread); once every rank has
    reported job ``k``, calls ``on_job(k, merged_report, seconds)`` (the slowest rank's time)."""

    def __init__(self, world_size: int, on_job):
        self.world_size = world_size
        self.on_job = on_job
        self._parts: dict[int, dict[int, tuple[RunReport, float]]] = {}
        self._lock = threading.Lock()

    def add(self, rank: int, k: int, report: RunReport, seconds: float) -> None:
        with self._lock:  # held through on_job too: one job's news at a time, in order
            parts = self._parts.setdefault(k, {})
            parts[rank] = (report, seconds)
            if len(parts) == self.world_size:
                del self._parts[k]
                merged = merge_rank_reports([parts[r][0] for r in range(self.world_size)])
                self.on_job(k, merged, max(s for _, s in parts.values()))

    def on_event(self, rank: int, payload) -> None:
        """``world.run_world``'s ``on_event``: a rank's ``("job", k, report, seconds)``."""
        if payload[0] == "job":
            self.add(rank, *payload[1:])


def run_jobs(jobs: list[Job], *, on_job=None, on_wait=None, trace: Trace | None = None) -> list[RunReport]:
    """Run jobs of one W in turn in one world (their ``WorldOptions``: gloo processes or
    threads, the timeout, the deadline); one merged report per job.

    ``on_job(k, report, seconds)`` is called as job ``k`` ends on every rank (the merged
    report, the slowest rank's time); ``on_wait(message)`` when a gloo world keeps the
    parent waiting (``world.run_world``). With ``trace``, the ranks record their events
    into it.
    """
    world, options = jobs[0].world_size, jobs[0].world
    if any(j.world_size != world for j in jobs):
        raise ValueError("run_jobs: every job of one world must have the same world size (PCP x TP)")
    if any(j.world != options for j in jobs):
        raise ValueError("run_jobs: every job of one world must have the same WorldOptions")
    in_process, timeout = options.in_process, options.timeout
    tally = JobTally(world, on_job or (lambda k, report, seconds: None))
    payload = (jobs, None if trace is None else trace.origin_ns)
    launcher = NULL_RECORDER if trace is None else trace.launcher(world)
    started = launcher.now()
    if in_process:
        rank_fn = functools.partial(_thread_rank_batch, tally=tally, schedules=shared_schedules(jobs))
        per_rank = run_in_threads(rank_fn, payload, world, timeout=timeout)
    else:
        check_plugins(j.engine.name for j in jobs)
        preload = (RANK_PRELOAD,)
        if any(j.engine.name in REAL_ENGINES for j in jobs):  # import Triton once, in the forkserver
            preload += ("dcpsim.engine.loading.preload",)
            forkserver.ask([choice.forkserver_build() for choice in dict.fromkeys(j.engine for j in jobs) if not choice.is_reference])
        with shared_streams_of(jobs) as streams, parent_schedules_of(jobs) as schedules:
            per_rank = run_world(
                gloo_rank_batch,
                (*payload, streams, schedules),
                world_size=world,
                pg_timeout_s=timeout,
                deadline_s=options.deadline_for(len(jobs)),
                preload=preload,
                on_event=tally.on_event,
                on_wait=on_wait,
                phase_order=STEP_PHASES,
            )
    launcher.complete(f"{'threads' if in_process else 'gloo world'} of {world} ranks", "launcher", started)
    started = launcher.now()
    merged = [merge_rank_reports([reports[k] for reports, _ in per_rank]) for k in range(len(jobs))]
    launcher.complete("merge reports", "launcher", started)
    for report in merged:
        if report.failure is not None and report.failure.kind == FailureKind.RANKS_DISAGREE:
            launcher.failure(report.failure)  # the parent's own finding
    if trace is not None:
        trace.add_ranks([events for _, events in per_rank])
    return merged


@dataclass
class JobOutcome:
    """One job of ``run_each``: its merged report, or the exception that broke its world."""

    report: RunReport | None
    error: Exception | None
    seconds: float
    """Time of the job: the slowest rank's, measured on the ranks; for a job that broke its
    world, the wall time of the world it ran alone in."""


def run_each(jobs: list[Job], *, on_outcome=None, on_wait=None) -> list[JobOutcome]:
    """Run jobs of one W in one world; if that world breaks, rerun each job it did not
    finish in a world of its own, so that the breakage is attributed to the job(s) that
    cause it. ``on_outcome(k, outcome)`` is called once per job, as it ends. The one batch
    runner of ``matrix`` and ``selftest``."""
    outcomes: dict[int, JobOutcome] = {}

    def settle(k: int, outcome: JobOutcome) -> None:
        outcomes[k] = outcome
        if on_outcome is not None:
            on_outcome(k, outcome)

    def done(k: int, report: RunReport, seconds: float) -> None:
        settle(k, JobOutcome(report, None, seconds))

    start = time.perf_counter()
    try:
        run_jobs(jobs, on_job=done, on_wait=on_wait)
    except Exception as exc:  # rerun the unfinished jobs one by one to attribute the breakage
        if len(jobs) == 1 and 0 not in outcomes:  # a world of its own already: no rerun needed
            settle(0, JobOutcome(None, exc, time.perf_counter() - start))
    for k, job in enumerate(jobs):
        if k in outcomes:
            continue
        start = time.perf_counter()
        try:
            run_jobs([job], on_wait=on_wait, on_job=lambda _, report, seconds, k=k: done(k, report, seconds))
        except Exception as exc:  # reported in the outcome
            if k not in outcomes:
                settle(k, JobOutcome(None, exc, time.perf_counter() - start))
    return [outcomes[k] for k in range(len(jobs))]


def merge_rank_reports(reports: list[RunReport]) -> RunReport:
    """Rank 0's verdict (all ranks judged the same gathered data) with every rank's
    figures; a ``ranks-disagree`` failure if any rank reached another verdict. The rank
    reports are left as they are."""
    merged = copy.copy(reports[0])
    merged.ranks = [r.ranks[0] for r in reports]
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps) for r in reports}
    if len(verdicts) != 1:
        merged.passed = False
        merged.failure = Failure(
            kind=FailureKind.RANKS_DISAGREE,
            step=min(r.steps for r in reports),
            message="ranks reached different verdicts: "
            + "; ".join(
                f"rank {i}: {'pass' if r.passed else r.failure.kind} after {plural(r.steps, 'step')}" for i, r in enumerate(reports)
            ),
        )
    return merged
