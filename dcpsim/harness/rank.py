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

import resource

from dcpsim.campaigns.faults import get_fault
from dcpsim.engine.attention.shard import ShardAttention
from dcpsim.engine.interface import ENGINE_DECISIONS, Engine
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.registry import build_engine
from dcpsim.engine.scheduler.scheduler import Scheduler, pool_sizes
from dcpsim.engine.worker.block_table import BlockTableOverflow
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.engine.worker.view import WorkerView
from dcpsim.harness.collectives import Collectives
from dcpsim.harness.job import Job, simulate_rank_failure
from dcpsim.harness.trace import NULL_RECORDER, NullRecorder
from dcpsim.scenarios.scenario import Scenario
from dcpsim.verify.attention import AttentionVerifier
from dcpsim.verify.check import Checker
from dcpsim.verify.geometry import ExpectedGroup, expected_groups
from dcpsim.verify.report import Failure, FailureKind, RunReport


def job_engine(job: Job) -> Engine:
    """The engine under test of a job: ``--engine`` (vLLM's code, a plugin), else an
    injected fault, else the reference engine (``FAULTS["none"]``, the catalogue's
    correct engine)."""
    if job.engine != "reference":
        return build_engine(job.engine, vllm_source=job.vllm_source, vllm_runner=job.vllm_runner,
                            vllm_merge=job.vllm_merge)
    return get_fault(job.inject)


def engine_info(engine: Engine) -> dict:
    """What the report says of the engine: its name, version and who makes each decision."""
    own = getattr(engine, "decisions", {})
    decisions = {}
    for name in ENGINE_DECISIONS:
        decisions[name] = own.get(name) or ("reference" if isinstance(engine, ReferenceEngine) and
                                            getattr(type(engine), name) is getattr(ReferenceEngine, name)
                                            else type(engine).__name__)
    return dict(name=engine.name, version=getattr(engine, "version", None), decisions=decisions)


def attention_on(job: Job, engine: Engine) -> bool:
    """``--attention``, or an engine (a fault) that can only show in the attention check."""
    return job.attention or bool(getattr(engine, "needs", {}).get("attention"))


def prepare(scenario: Scenario) -> dict:
    """Validate everything and dry-run the schedule with the reference engine; returns its
    summary. Always unfaulted: it judges the user's scenario. An injected fault acts in
    the ranks only, where every rank runs the same faulted (deterministic) scheduler, so
    the ranks stay in lockstep."""
    engine = ReferenceEngine()
    scheduler = Scheduler(scenario, engine, engine.geometries(scenario.layers, scenario.config))
    for _ in scheduler.plans():
        pass
    return scheduler.summary


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


def run_rank(job: Job, coll: Collectives, engine: Engine | None = None,
             recorder: NullRecorder = NULL_RECORDER) -> RunReport:
    """One rank's run of ``job``. ``engine`` replaces the job's engine under test (tests
    of the checker run hand-made engine variants this way)."""
    # Imported here: set_progress lives with the launcher; in-process runs use a no-op.
    from dcpsim.harness.world import set_progress

    rec = recorder
    scenario, config = job.scenario, job.scenario.config
    bytes_before = coll.bytes_sent  # a Collectives may serve several jobs in turn
    setup = rec.now()
    engine = job_engine(job) if engine is None else engine
    attention = attention_on(job, engine)
    cfg = job.attention_config

    # the engine under test
    geometries = engine.geometries(scenario.layers, config)
    scheduler = Scheduler(scenario, engine, geometries)
    request_ids = {r.index: r.request_id for r in scheduler.requests}
    runner = ModelRunner(engine, geometries, pool_sizes(scenario, engine, geometries), coll.rank,
                         max_num_reqs=len(scheduler.requests), vector_width=cfg.kv_width if attention else 0,
                         observer=rec.write_observer(geometries))
    shard_attention = ShardAttention(engine, cfg, coll) if attention else None

    # the checker: its expectation from the scenario alone, the rank through a read-only view
    view = WorkerView(runner)
    groups = expected_groups(scenario)
    checker = Checker(groups, coll, view, request_ids, paranoid=job.paranoid, config=config, mode=job.verify)
    verifier = AttentionVerifier(cfg, groups, coll, view) if attention else None
    rec.complete("setup", "setup", setup)

    report = RunReport(
        scenario=scenario.name,
        source=scenario.source,
        dcp_size=config.decode_context_parallel_size,
        interleave_size=config.cp_kv_cache_interleave_size,
        kernel_block_size=config.kernel_block_size,
        groups=group_info(groups),
        engine=dict(engine_info(engine), groups=[
            dict(name=g.name, sharded=g.sharded, manager_block_size=g.manager_block_size,
                 block_table_width=g.block_table_width, page_size_bytes=g.page_size_bytes,
                 max_memory_usage_bytes=g.max_memory_usage_bytes)
            for g in geometries]),
    )
    failure: Failure | None = None
    attention_bytes = 0
    scheduled = rec.now()  # the next step's scheduling starts
    for plan in scheduler.plans():
        rec.complete("schedule", "schedule", scheduled, args={"step": plan.step})
        with rec.step(plan):
            set_progress(plan.step, "write")
            simulate_rank_failure(job, coll.rank, plan.step)
            during_step = None
            if attention:
                queries = verifier.queries(plan)

                def during_step(plan, runner, queries=queries):
                    with rec.span("attention compute", "attention"):
                        shard_attention.compute(plan, runner, queries)
            try:
                with rec.span("write (all groups)", "write"):
                    runner.apply(plan, request_ids, during_step=during_step)
            except BlockTableOverflow as exc:
                failure = Failure(kind=FailureKind.BLOCK_TABLE_OVERFLOW, step=plan.step, message=str(exc),
                                  group=exc.group, request_id=exc.request_id)
                break
            with rec.span("check writes", "verify"):
                checker.record_writes(plan)
            if (plan.step % scenario.verify_every == 0 or plan.last
                    or (checker.incremental and any(v.finished for v in plan.views))):
                set_progress(plan.step, "verify")
                with rec.span("verify", "verify") as span:
                    indices = checker.verified_indices
                    failure = checker.verify(plan)
                    span.set(step=plan.step, indices=checker.verified_indices - indices,
                             result=failure.kind if failure else "pass")
                if failure:
                    break
            if attention:
                set_progress(plan.step, "attention")
                before = coll.bytes_sent
                with rec.span("attention merge", "attention"):
                    results = shard_attention.finish(plan.step)
                with rec.span("attention check", "attention") as span:
                    checks = verifier.checks
                    failure = verifier.judge(plan, results)
                    span.set(step=plan.step, checks=verifier.checks - checks,
                             result=failure.kind if failure else "pass")
                attention_bytes += coll.bytes_sent - before
                if failure:
                    break
                verifier.forget_finished(plan)
            with rec.span("check metadata", "verify"):
                failure = checker.metadata_verdict(plan)
            if failure:
                break
        scheduled = rec.now()
    if failure is not None and coll.rank == 0:  # rank 0's verdict is the report's
        rec.failure(failure)
    report.steps = scheduler.step_index
    report.schedule = scheduler.summary
    report.verifications = checker.verifications
    report.verified_indices = checker.verified_indices
    report.verify_mode = "incremental" if checker.incremental else "full"
    report.full_sweeps = checker.full_sweeps
    report.metadata_checks = checker.metadata.checks if checker.metadata is not None else 0
    bytes_sent = coll.bytes_sent - bytes_before
    report.bytes_gathered = bytes_sent - attention_bytes
    if attention:
        report.attention = cfg.summary()
        report.attention_checks = verifier.checks
        report.attention_query_tokens = verifier.query_tokens
        report.attention_sampled_checks = verifier.sampled
        report.attention_max_error = verifier.max_error if verifier.checks else None
        report.attention_bytes = attention_bytes
        report.attention_merges = dict(shard_attention.merges)
    report.failure = failure
    report.passed = failure is None
    report.ranks = [
        dict(
            rank=coll.rank,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            kv_store_mb=view.kv_store_bytes / 2**20,
            bytes_sent=bytes_sent,
        )
    ]
    return report
