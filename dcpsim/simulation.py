"""One simulated run on one rank: schedule, write, verify, report.

``prepare`` validates a scenario completely in the parent (layouts, pools and
a dry run of the scheduler) so that every user error ends before any process
starts. ``run_rank`` is what each rank executes, over any ``Collectives``.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.faults import get_fault
from dcpsim.group_layout import GroupLayout, build_group_layouts
from dcpsim.grouping import group_layer_specs
from dcpsim.runtime.block_table import BlockTableOverflow
from dcpsim.runtime.collectives import Collectives, GlooCollectives
from dcpsim.runtime.model_runner import ModelRunner
from dcpsim.scenario import Scenario
from dcpsim.scheduler.scheduler import Scheduler, pool_sizes
from dcpsim.verify.check import Checker
from dcpsim.verify.report import Failure, RunReport


@dataclass(frozen=True)
class Job:
    """Everything a rank needs (picklable): the resolved scenario and run options."""

    scenario: Scenario
    paranoid: bool = False
    inject: str | None = None
    """Name of a known DCP bug to switch on in the write path (``dcpsim.faults``)."""
    rank_failure: tuple[str, int, int] | None = None
    """(kind, rank, step): make one rank raise, hang or exit at a step, to
    exercise the harness's failure handling (``--simulate-rank-failure``)."""
    attention: bool = False
    """Check the decode math every step (``--attention``, ``dcpsim.attention``); also on
    when the injected fault needs it."""
    lse_base: str = "e"
    attention_merge: str = "alternate"
    """allgather, alltoall, or alternate (allgather on even steps, alltoall on odd ones)."""
    attention_heads: int = 8
    attention_head_dim: int = 16
    """Width of K and of V (each)."""

    def __post_init__(self) -> None:
        # A Job can come from a hand-edited replay file: refuse bad options before any rank starts.
        get_fault(self.inject)
        if self.lse_base not in ("e", "2"):
            raise ConfigError(f"lse_base must be 'e' or '2', got {self.lse_base!r}")
        if self.attention_merge not in ("allgather", "alltoall", "alternate"):
            raise ConfigError(f"attention_merge must be allgather, alltoall or alternate, got {self.attention_merge!r}")
        for name in ("attention_heads", "attention_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.rank_failure is not None:
            kind, rank, step = self.rank_failure
            if kind not in RANK_FAILURE_KINDS or not isinstance(rank, int) or not isinstance(step, int):
                raise ConfigError(f"rank_failure must be (raise|hang|exit, rank, step), got {self.rank_failure!r}")


RANK_FAILURE_KINDS = ("raise", "hang", "exit")


def parse_rank_failure(text: str, world_size: int) -> tuple[str, int, int]:
    """``KIND:RANK:STEP`` with KIND one of raise, hang, exit."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in RANK_FAILURE_KINDS or not all(p.isdigit() for p in parts[1:]):
        raise ConfigError(
            f"--simulate-rank-failure expects KIND:RANK:STEP with KIND in {'/'.join(RANK_FAILURE_KINDS)}, got {text!r}"
        )
    kind, rank, step = parts[0], int(parts[1]), int(parts[2])
    if rank >= world_size:
        raise ConfigError(f"--simulate-rank-failure: rank {rank} is not in a world of {world_size}")
    return kind, rank, step


def _simulate_rank_failure(job: Job, rank: int, step: int) -> None:
    if job.rank_failure is None:
        return
    kind, which, at = job.rank_failure
    if (which, at) != (rank, step):
        return
    if kind == "raise":
        raise RuntimeError(f"simulated failure of rank {rank} at step {step}")
    if kind == "hang":
        import time

        while True:
            time.sleep(3600)
    os._exit(17)


def build_layouts(scenario: Scenario) -> list[GroupLayout]:
    return build_group_layouts(group_layer_specs(scenario.layers), scenario.config)


def prepare(scenario: Scenario) -> dict:
    """Validate everything and dry-run the schedule; returns its summary.

    Always unfaulted: it judges the user's scenario. An injected fault acts in
    the ranks only, where every rank runs the same faulted (deterministic)
    scheduler, so the ranks stay in lockstep.
    """
    layouts = build_layouts(scenario)
    scheduler = Scheduler(scenario, layouts)
    for _ in scheduler.plans():
        pass
    return scheduler.summary


def _group_info(layouts: list[GroupLayout]) -> list[dict]:
    return [
        dict(
            name=lay.name,
            layers=len(lay.layer_names),
            storage=lay.storage,
            retention=lay.retention,
            block_size=lay.block_size,
            states_per_page=lay.states_per_page,
            sharded=lay.sharded,
            manager_block_size=lay.manager_block_size,
        )
        for lay in layouts
    ]


def run_rank(job: Job, coll: Collectives) -> RunReport:
    scenario = job.scenario
    config = scenario.config
    # Imported here: set_progress lives with the launcher; in-process runs use a no-op.
    from dcpsim.launch import set_progress

    bytes_before = coll.bytes_sent  # a Collectives may serve several jobs in turn
    fault = get_fault(job.inject)
    layouts = build_layouts(scenario)  # the truth: what the checker judges against
    engine_layouts = fault.engine_layouts(scenario, layouts)  # what the simulated engine uses
    scheduler = Scheduler(scenario, engine_layouts, fault)
    request_ids = {r.index: r.request_id for r in scheduler.requests}
    from dcpsim.attention.check import fill_report, make_attention_checker

    attention = make_attention_checker(job, fault, layouts, coll)
    runner = ModelRunner(
        engine_layouts,
        pool_sizes(scenario, engine_layouts),
        config,
        coll.rank,
        max_num_reqs=len(scheduler.requests),
        fault=fault,
        kv_vectors=attention.kv_vectors if attention else None,
    )
    checker = Checker(layouts, coll, request_ids, paranoid=job.paranoid)
    report = RunReport(
        scenario=scenario.name,
        source=scenario.source,
        dcp_size=config.decode_context_parallel_size,
        interleave_size=config.cp_kv_cache_interleave_size,
        kernel_block_size=config.kernel_block_size,
        groups=_group_info(layouts),
    )
    failure: Failure | None = None
    for plan in scheduler.plans():
        set_progress(plan.step, "write")
        _simulate_rank_failure(job, coll.rank, plan.step)
        try:
            runner.apply(plan, request_ids, during_step=attention.compute_local if attention else None)
        except BlockTableOverflow as exc:
            failure = Failure(kind="block-table-overflow", step=plan.step, message=str(exc),
                              group=exc.group, request_id=exc.request_id)
            break
        if plan.step % scenario.verify_every == 0 or plan.last:
            set_progress(plan.step, "verify")
            failure = checker.verify(plan, runner)
            if failure:
                break
        if attention:
            set_progress(plan.step, "attention")
            failure = attention.finish(plan)
            if failure:
                break
            attention.forget_finished(plan)
    report.steps = scheduler.step_index
    report.schedule = scheduler.summary
    report.verifications = checker.verifications
    report.verified_indices = checker.verified_indices
    bytes_sent = coll.bytes_sent - bytes_before
    report.bytes_gathered = bytes_sent - (attention.bytes if attention else 0)
    fill_report(report, attention)
    report.failure = failure
    report.passed = failure is None
    report.ranks = [
        dict(
            rank=coll.rank,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            kv_store_mb=sum(s.nbytes for s in runner.stores) / 2**20,
            bytes_sent=bytes_sent,
        )
    ]
    return report


def rank_batch(jobs: list[Job], rank: int, world_size: int) -> list[RunReport]:
    """What each gloo rank runs (``launch.run_world`` target): the jobs in turn."""
    coll = GlooCollectives(rank, world_size)
    return [run_rank(job, coll) for job in jobs]


def _thread_batch(jobs: list[Job], coll: Collectives) -> list[RunReport]:
    return [run_rank(job, coll) for job in jobs]


def run_jobs(jobs: list[Job], *, in_process: bool = False, timeout: float = 30.0,
             deadline: float | None = None) -> list[RunReport]:
    """Run jobs of one W in turn in one world (gloo processes, or threads); one merged report per job.

    The default deadline is a backstop (a hang ends at the process-group
    timeout): ``2 * timeout + 30`` s for one job, 10 s more per further job,
    so a long batch of healthy runs is never cut short.
    """
    world = jobs[0].scenario.config.decode_context_parallel_size
    if any(j.scenario.config.decode_context_parallel_size != world for j in jobs):
        raise ValueError("run_jobs: every job of one world must have the same decode_context_parallel_size")
    if in_process:
        from dcpsim.runtime.collectives import run_in_threads

        per_rank = run_in_threads(_thread_batch, jobs, world)
    else:
        from dcpsim.launch import run_world

        if deadline is None:
            deadline = 2 * timeout + 30 + 10 * (len(jobs) - 1)
        per_rank = run_world(rank_batch, jobs, world_size=world, pg_timeout_s=timeout,
                             deadline_s=deadline, preload=("dcpsim.simulation",))
    return [merge_rank_reports([reports[k] for reports in per_rank]) for k in range(len(jobs))]


def merge_rank_reports(reports: list[RunReport]) -> RunReport:
    """Rank 0's verdict (all ranks judged the same gathered data) with every rank's figures."""
    merged = reports[0]
    merged.ranks = [r.ranks[0] for r in reports]
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps) for r in reports}
    if len(verdicts) != 1:
        merged.passed = False
        merged.failure = Failure(
            kind="ranks-disagree",
            step=min(r.steps for r in reports),
            message="ranks reached different verdicts: "
            + "; ".join(f"rank {i}: {'pass' if r.passed else r.failure.kind} after {r.steps} steps" for i, r in enumerate(reports)),
        )
    return merged
