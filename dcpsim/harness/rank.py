"""One simulated run on one rank: the engine under test and the checker, side by side.

``prepare`` validates a scenario completely in the parent (groups, geometry, pools and a
dry run of the reference scheduler) so that every user error ends before any process
starts. ``run_rank`` is what each rank executes, over any ``Collectives``:

1. the engine (``job_engine``: the reference engine or an injected fault) derives its
   geometry, schedules, and writes every step through its worker;
2. the checker, built from the scenario alone (``verify.geometry``), judges every step's
   write log, verifies the stores through the worker's read-only ``RankView``, and, with
   ``--attention``, judges the engine's attention against a full-context reference.

A ``recorder`` (``harness.trace``, ``--trace``) marks the phases of every step; the
default one records nothing.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from dataclasses import dataclass

from dcpsim.collectives import Collectives
from dcpsim.engine.attention.shard import ShardAttention
from dcpsim.engine.faults import get_fault
from dcpsim.engine.interface import ENGINE_DECISIONS, Engine
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.registry import build_engine
from dcpsim.engine.scheduler.scheduler import Scheduler, pool_sizes
from dcpsim.engine.worker.block_table import BlockTableOverflow
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.engine.worker.pcp_prefill import GATHER_PHASE, pcp_prefill
from dcpsim.engine.worker.view import WorkerView
from dcpsim.harness.groups import ParallelGroups, build_groups
from dcpsim.harness.job import Job, simulate_rank_failure
from dcpsim.harness.trace import NULL_RECORDER, NullRecorder
from dcpsim.model.scenario import Scenario
from dcpsim.verify.attention import AttentionVerifier
from dcpsim.verify.check import Checker, StaleFailure
from dcpsim.verify.geometry import ExpectedGroup, expected_groups
from dcpsim.verify.report import Failure, FailureKind, RunReport


def job_engine(job: Job) -> Engine:
    """The engine under test of a job: ``--engine`` (vLLM's code, a plugin), else an
    injected fault, else the reference engine (``FAULTS["none"]``, the catalogue's
    correct engine)."""
    if job.engine != "reference":
        return build_engine(job.engine, vllm_source=job.vllm_source, vllm_runner=job.vllm_runner, vllm_merge=job.vllm_merge)
    return get_fault(job.inject)


def engine_info(engine: Engine) -> dict:
    """What the report says of the engine: its name, version and who makes each decision."""
    own = getattr(engine, "decisions", {})
    decisions = {}
    for name in ENGINE_DECISIONS:
        decisions[name] = own.get(name) or (
            "reference"
            if isinstance(engine, ReferenceEngine) and getattr(type(engine), name) is getattr(ReferenceEngine, name)
            else type(engine).__name__
        )
    return dict(name=engine.name, version=getattr(engine, "version", None), decisions=decisions)


def attention_on(job: Job, engine: Engine) -> bool:
    """``--attention``, or an engine (a fault) that can only show in the attention check."""
    return job.attention or bool(getattr(engine, "needs", {}).get("attention"))


@dataclass(frozen=True)
class DryRun:
    """What the parent's dry run of a schedule found."""

    summary: dict
    steps: int
    unfired_preemptions: tuple[tuple[str, int], ...]
    """(request id, step) of every ``preempt_at_steps`` entry that never fired: the
    request was not running at that step."""


def dry_run(scenario: Scenario) -> DryRun:
    """Validate everything and dry-run the schedule with the reference engine. Always
    unfaulted: it judges the user's scenario. An injected fault acts in the ranks only,
    where every rank runs the same faulted (deterministic) scheduler, so the ranks stay
    in lockstep."""
    engine = ReferenceEngine()
    scheduler = Scheduler(scenario, engine, engine.geometries(scenario.layers, scenario.config))
    fired = set()
    for plan in scheduler.plans():
        fired.update(
            (event.removeprefix("preempted ").removesuffix(" (scenario)"), plan.step)
            for event in plan.events
            if event.startswith("preempted ") and event.endswith(" (scenario)")
        )
    unfired = tuple((r.request_id, s) for r in scenario.requests for s in r.preempt_at_steps if (r.request_id, s) not in fired)
    return DryRun(scheduler.summary, scheduler.step_index, unfired)


def prepare(scenario: Scenario) -> dict:
    """``dry_run``'s summary of the schedule."""
    return dry_run(scenario).summary


def group_info(groups: list[ExpectedGroup]) -> list[dict]:
    """The report's description of each group (the checker's view: the truth)."""
    return [
        dict(
            name=g.name,
            layers=len(g.layer_names),
            storage=g.storage,
            retention=g.retention,
            block_size=g.block_size,
            states_per_page=g.page_states,
            sharded=g.sharded,
            manager_block_size=g.block_size * (g.dcp_size if g.sharded else 1),
        )
        for g in groups
    ]


STEP_PHASES = ("write", GATHER_PHASE, "verify", "attention", "metadata", "agree")
"""The progress phases of one step, in order (``world.run_world``'s ``phase_order``)."""


def agree(groups: ParallelGroups, failure: Failure | None, step: int) -> Failure | None:
    """With several DCP groups (independent KV replicas), every rank takes the first
    failing group's verdict, so the world stays in lockstep and rank 0 reports it."""
    if groups.num_dcp_groups == 1:
        return failure
    from dcpsim.harness.world import set_progress

    set_progress(step, "agree")
    verdicts = groups.world.all_gather_object(failure)
    for rank, found in enumerate(verdicts):
        if found is not None:
            members = groups.layout.dcp_groups()
            g = next(k for k, m in enumerate(members) if rank in m)
            return dataclasses.replace(found, message=f"DCP group {g} (world ranks {', '.join(map(str, members[g]))}): {found.message}")
    return None


def run_rank(job: Job, coll: Collectives, engine: Engine | None = None, recorder: NullRecorder = NULL_RECORDER, instance=None) -> RunReport:
    """One rank's run of ``job``. ``engine`` replaces the job's engine under test (tests
    of the checker run hand-made engine variants this way). ``instance`` (an instance of a
    disaggregated run, ``harness.disagg``) gives the scheduler class and hears each step
    before its writes (``before_write(plan, runner)``) and after its checks
    (``after_step(plan, runner, scheduler)``).

    With ``job.exchange_every > 1`` the ranks exchange their verification rows every that
    many verified steps; if an exchange finds a failure at an older step than its newest,
    every rank of the DCP group (they judged the same data) runs the job again in
    lockstep, which reports that failure with the stores as they were at its step."""
    try:
        return _run_rank(job, coll, engine, recorder, instance)
    except StaleFailure:
        lockstep = dataclasses.replace(job, exchange_every=1)
        return _run_rank(lockstep, coll, engine, recorder, instance)


def _run_rank(job: Job, coll: Collectives, engine: Engine | None, recorder: NullRecorder, instance) -> RunReport:
    # Imported here: set_progress lives with the launcher; in-process runs use a no-op.
    from dcpsim.harness.world import set_progress

    rec = recorder
    scenario, config = job.scenario, job.scenario.config
    setup = rec.now()
    engine = job_engine(job) if engine is None else engine
    attention = attention_on(job, engine)
    cfg = job.attention_config
    par = build_groups(config, coll)  # the world's DCP, PCP and TP groups
    world, coll = coll, par.dcp  # the checker and the attention merge work in the DCP group
    bytes_before = par.bytes_sent  # a Collectives may serve several jobs in turn
    pcp_before = par.pcp.bytes_sent if par.pcp is not None else 0
    layout, coords = par.layout, par.coords

    # the engine under test
    geometries = engine.geometries(scenario.layers, config)
    scheduler = (instance.scheduler_class if instance else Scheduler)(scenario, engine, geometries)
    request_ids = {r.index: r.request_id for r in scheduler.requests}
    runner = ModelRunner(
        engine,
        geometries,
        pool_sizes(scenario, engine, geometries),
        engine.dcp_rank_of(layout, world.rank),
        max_num_reqs=len(scheduler.requests),
        vector_width=cfg.kv_width if attention else 0,
        observer=rec.write_observer(geometries),
    )
    shard_attention = ShardAttention(engine, cfg, coll) if attention else None

    # the checker: its expectation from the scenario alone, the rank through a read-only view
    view = WorkerView(runner)
    groups = expected_groups(scenario)
    checker = Checker(groups, coll, view, request_ids, paranoid=job.paranoid, config=config, mode=job.verify)
    verifier = AttentionVerifier(cfg, groups, coll, view) if attention else None
    # Exchange the checker's rows every ``exchange_every`` verified steps, not every step;
    # lockstep where collectives meet every step anyway (attention, paranoid, several DCP
    # groups, PCP, a P/D instance) and under --trace, whose timeline shows each step's check.
    batched = (
        job.exchange_every > 1
        and not attention
        and not job.paranoid
        and instance is None
        and par.num_dcp_groups == 1
        and layout.pcp == 1
        and not rec.enabled
    )
    rec.complete("setup", "setup", setup)

    report = RunReport(
        scenario=scenario.name,
        source=scenario.source,
        dcp_size=config.decode_context_parallel_size,
        interleave_size=config.cp_kv_cache_interleave_size,
        kernel_block_size=config.kernel_block_size,
        groups=group_info(groups),
        prefill_context_parallel_size=layout.pcp,
        tensor_parallel_size=None if layout.world_size == layout.dcp and layout.pcp == 1 else layout.tp,
        engine=dict(
            engine_info(engine),
            groups=[
                dict(
                    name=g.name,
                    sharded=g.sharded,
                    manager_block_size=g.manager_block_size,
                    block_table_width=g.block_table_width,
                    page_size_bytes=g.page_size_bytes,
                    max_memory_usage_bytes=g.max_memory_usage_bytes,
                )
                for g in geometries
            ],
        ),
    )
    failure: Failure | None = None
    attention_bytes = 0
    scheduled = rec.now()  # the next step's scheduling starts
    for plan in scheduler.plans():
        rec.complete("schedule", "schedule", scheduled, args={"step": plan.step})
        with rec.step(plan):
            set_progress(plan.step, "write")
            simulate_rank_failure(job, world.rank, plan.step)
            during_step = None
            if attention:
                queries = verifier.queries(plan)

                def during_step(plan, runner, queries=queries):
                    with rec.span("attention compute", "attention"):
                        shard_attention.compute(plan, runner, queries)

            try:
                with rec.span("write (all groups)", "write"):
                    if instance is not None:
                        instance.before_write(plan, runner)
                    computed = pcp_prefill(
                        engine,
                        plan,
                        par.pcp,
                        coords.pcp_rank,
                        layout.pcp,
                        layout.dcp,
                        on_phase=lambda what, step=plan.step: set_progress(step, what),
                    )
                    set_progress(plan.step, "write")
                    runner.apply(computed, request_ids, during_step=during_step)
            except BlockTableOverflow as exc:
                # the steps still queued come first (every rank's table overflows alike)
                failure = checker.exchange(metadata=True) if batched else None
                failure = failure or Failure(
                    kind=FailureKind.BLOCK_TABLE_OVERFLOW, step=plan.step, message=str(exc), group=exc.group, request_id=exc.request_id
                )
                break
            with rec.span("check writes", "verify"):
                checker.record_writes(plan)
            if plan.step % scenario.verify_every == 0 or plan.last or (checker.incremental and any(v.finished for v in plan.views)):
                set_progress(plan.step, "verify")
                with rec.span("verify", "verify") as span:
                    indices = checker.verified_indices
                    if not batched:
                        failure = agree(par, checker.verify(plan), plan.step)
                    else:
                        checker.read(plan)
                        if checker.pending >= job.exchange_every or plan.last:
                            failure = checker.exchange(metadata=True)
                    span.set(step=plan.step, indices=checker.verified_indices - indices, result=failure.kind if failure else "pass")
                if failure:
                    break
            if attention:
                set_progress(plan.step, "attention")
                before = coll.bytes_sent
                with rec.span("attention merge", "attention"):
                    results = shard_attention.finish(plan.step)
                with rec.span("attention check", "attention") as span:
                    checks = verifier.checks
                    failure = agree(par, verifier.judge(plan, results), plan.step)
                    span.set(step=plan.step, checks=verifier.checks - checks, result=failure.kind if failure else "pass")
                attention_bytes += coll.bytes_sent - before
                if failure:
                    break
                verifier.forget_finished(plan)
            set_progress(plan.step, "metadata")
            with rec.span("check metadata", "verify"):
                failure = agree(par, checker.metadata_verdict(plan), plan.step)
            if failure:
                break
            if instance is not None:
                instance.after_step(plan, runner, scheduler)
        scheduled = rec.now()
    if failure is None and batched and checker.pending:  # the last step always exchanges; a safeguard
        failure = checker.exchange(metadata=True)
    if failure is not None and world.rank == 0:  # rank 0's verdict is the report's
        rec.failure(failure)
    report.steps = scheduler.step_index
    report.schedule = scheduler.summary
    report.verifications = checker.verifications
    report.verified_indices = checker.verified_indices
    report.verify_mode = "incremental" if checker.incremental else "full"
    report.full_sweeps = checker.full_sweeps
    report.metadata_checks = checker.metadata.checks if checker.metadata is not None else 0
    bytes_sent = par.bytes_sent - bytes_before
    report.pcp_gather_bytes = par.pcp.bytes_sent - pcp_before if par.pcp is not None else 0
    report.bytes_gathered = bytes_sent - attention_bytes - report.pcp_gather_bytes
    if attention:
        report.attention = cfg.summary()
        report.attention_checks = verifier.checks
        report.attention_query_tokens = verifier.query_tokens
        report.attention_sampled_checks = verifier.sampled
        report.attention_skipped_checks = verifier.skipped
        report.attention_checked_steps = verifier.checked_steps
        report.attention_max_error = verifier.max_error if verifier.checks else None
        report.attention_bytes = attention_bytes
        report.attention_merges = dict(shard_attention.merges)
    report.failure = failure
    report.passed = failure is None
    report.ranks = [
        dict(
            rank=world.rank,
            **(
                {}
                if par.num_dcp_groups == 1 and layout.pcp == 1
                else dict(pcp_rank=coords.pcp_rank, tp_rank=coords.tp_rank, dcp_group=coords.dcp_group, dcp_rank=coords.dcp_rank)
            ),
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            cpu_seconds=time.process_time(),  # since the rank's process started (all its threads)
            kv_store_mb=view.kv_store_bytes / 2**20,
            bytes_sent=bytes_sent,
        )
    ]
    return report
