"""``RankRun``: one rank's run of a job, the engine under test and the checker side by side.

Set up once: the engine (``Job.build_engine``: the reference engine, an injected fault,
vLLM's code or a plugin) derives its geometries, schedules and writes through its model
runner; the checker, built from the scenario alone (``verify.geometry``), reads the rank
through a read-only ``WorkerView``. Then each step of the schedule goes through the phases
of ``STEP_PHASES``, one method each, and the first failure ends the run::

    write          the engine writes the step (a PCP prefill gathers its KV first)
    check_writes   the checker judges the step's write log
    verify         the checker reads the stores through the block tables (every
                   ``verify_every`` steps; rows exchanged every ``exchange_every``)
    attention      with --attention: merge the ranks' partial attention, judge it
    metadata       the checker judges the attention metadata the engine built

``run`` returns the rank's report (``harness.rank_report``). A ``Progress`` hears each
phase; a ``recorder`` (``harness.trace``, ``--trace``) marks them on a timeline.
"""

from __future__ import annotations

import dataclasses
import os
import time

from dcpsim.collectives import Collectives
from dcpsim.engine.attention.heads import group_heads
from dcpsim.engine.attention.shard import MergeVariantsDiffer, ShardAttention
from dcpsim.engine.interface import Engine, EngineError
from dcpsim.engine.worker.block_table import BlockTableOverflow
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.engine.worker.pcp_prefill import GATHER_PHASE, pcp_prefill
from dcpsim.engine.worker.view import WorkerView
from dcpsim.harness.groups import build_groups
from dcpsim.harness.job import Job, RankFailureKind
from dcpsim.harness.parent_schedule import ReplayedScheduler, ScheduleLoader
from dcpsim.harness.progress import NO_PROGRESS, Progress
from dcpsim.harness.rank_report import rank_report
from dcpsim.harness.trace import NULL_RECORDER, NullRecorder
from dcpsim.model.plan import StepPlan
from dcpsim.verify.admission import judge_admission
from dcpsim.verify.attention import AttentionVerifier
from dcpsim.verify.check import Checker, StaleFailure
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.report import Failure, FailureKind, RunReport

STEP_PHASES = ("write", GATHER_PHASE, "verify", "attention", "metadata", "agree")
"""The progress phases of one step, in order (``world.run_world``'s ``phase_order``)."""


def run_rank(
    job: Job, coll: Collectives, *, engine: Engine | None = None, progress: Progress = NO_PROGRESS,
    recorder: NullRecorder = NULL_RECORDER, instance=None, schedule: ScheduleLoader | None = None,
) -> RunReport:  # fmt: skip
    """One rank's run of ``job`` (see ``RankRun``). With ``job.check.exchange_every > 1`` the
    ranks exchange their verification rows every that many verified steps; if an exchange
    finds a failure at an older step than its newest, every rank of the DCP group (they
    judged the same data) runs the job again in lockstep, which reports that failure with
    the stores as they were at its step."""
    options = dict(engine=engine, progress=progress, recorder=recorder, instance=instance, schedule=schedule)
    try:
        return RankRun(job, coll, **options).run()
    except StaleFailure:
        lockstep = dataclasses.replace(job, check=dataclasses.replace(job.check, exchange_every=1))
        return RankRun(lockstep, coll, **options).run()


class RankRun:
    """``engine`` replaces the job's engine under test (tests of the checker run hand-made
    engine variants this way). ``instance`` (an instance of a disaggregated run,
    ``harness.pd``) gives the scheduler's KV connector (``connector``) and hears each step before its writes
    (``before_write(plan, runner)``) and after its checks (``after_step(plan, runner, scheduler)``).
    ``schedule``: the loader of the launcher's run of the scheduler (``harness.parent_schedule``),
    whose plans the rank's scheduler replays; None: the rank's scheduler makes them."""

    def __init__(
        self, job: Job, coll: Collectives, *, engine: Engine | None = None, progress: Progress = NO_PROGRESS,
        recorder: NullRecorder = NULL_RECORDER, instance=None, schedule: ScheduleLoader | None = None,
    ) -> None:  # fmt: skip
        started = recorder.now()
        self.job, self.progress, self.rec, self.instance = job, progress, recorder, instance
        self.schedule = schedule
        self.engine = job.build_engine() if engine is None else engine
        self.attention_on = job.attention_on(self.engine)
        self.par = build_groups(job.scenario.config, coll)  # the world's DCP, PCP and TP groups
        self.world, self.coll = coll, self.par.dcp  # the checker and the attention merge work in the DCP group
        self.bytes_before = self.par.bytes_sent  # a Collectives may serve several jobs in turn
        self.pcp_bytes_before = self.par.pcp.bytes_sent if self.par.pcp is not None else 0
        self.attention_bytes = 0
        self._set_up_engine()
        self._set_up_checker()
        recorder.complete("setup", "setup", started)

    def _set_up_engine(self) -> None:
        """The engine under test: its geometries, scheduler, model runner and shard attention."""
        scenario, engine = self.job.scenario, self.engine
        self.geometries = engine.geometries(scenario.layers, scenario.config)
        connector = getattr(self.instance, "connector", None)
        if connector is not None:
            self.scheduler = engine.make_scheduler(scenario, self.geometries, connector=connector)
        else:
            self.scheduler = engine.make_scheduler(scenario, self.geometries)
        if self.schedule is not None:
            self.scheduler = ReplayedScheduler(self.scheduler, self.schedule())
        self.request_ids = {r.index: r.request_id for r in self.scheduler.requests}
        # the groups with KV heads (a scenario that states its heads): this rank's, the engine's way
        heads = group_heads(engine, self.geometries, scenario.config, self.par.layout, self.world.rank) if self.attention_on else {}
        self.runner = ModelRunner(
            engine,
            self.geometries,
            self.scheduler.pool_sizes,
            engine.dcp_rank_of(self.par.layout, self.world.rank),
            max_num_reqs=len(self.scheduler.requests),
            vector_width=self.job.attention.kv_width if self.attention_on else 0,
            observer=self.rec.write_observer(self.geometries),
            kv_heads={g: h.kv_heads for g, h in heads.items()},
        )
        self.shard_attention = ShardAttention(engine, self.job.attention, self.coll, heads) if self.attention_on else None

    def _set_up_checker(self) -> None:
        """The checker: its expectation from the scenario alone, the rank through a read-only view."""
        scenario = self.job.scenario
        self.view = WorkerView(self.runner)
        self.groups = expected_groups(scenario)
        prompts = {r.request_id: r.prompt_len for r in scenario.requests}
        self.checker = Checker(self.groups, self.coll, self.view, self.request_ids, scenario.config, self.job.check, prompts)
        self.verifier = None
        if self.attention_on:  # the heads of a scenario that states them: its own derivation, from the config and world rank
            self.verifier = AttentionVerifier(
                self.job.attention, self.groups, self.coll, self.view, scenario_config=scenario.config, world_rank=self.world.rank
            )
        # Exchange the checker's rows every ``exchange_every`` verified steps, not every step;
        # lockstep where collectives meet every step anyway (attention, paranoid, several DCP
        # groups, PCP, a P/D instance) and under --trace, whose timeline shows each step's check.
        self.batched = (
            self.job.check.exchange_every > 1
            and not self.attention_on
            and not self.job.check.paranoid
            and self.instance is None
            and self.par.num_dcp_groups == 1
            and self.par.layout.pcp == 1
            and not self.rec.enabled
        )

    # --- the run ---------------------------------------------------------------------

    def run(self) -> RunReport:
        """Every step in turn until the first failure; the rank's report."""
        try:
            failure = self.admission() or self.steps()
        except EngineError as exc:  # the scheduler's: every rank's, at the same step
            failure = self.engine_failure(exc)
        if failure is None and self.batched and self.checker.pending:  # the last step always exchanges; a safeguard
            failure = self.checker.exchange(metadata=True)
        if failure is not None and self.world.rank == 0:  # rank 0's verdict is the report's
            self.rec.failure(failure)
        return rank_report(self, failure)

    def admission(self) -> Failure | None:
        """Before the first step: the checker judges the longest request the engine admits (its
        scheduler's ``Engine.max_admissible_tokens``) against the pools the stores hold."""
        if not getattr(self.scheduler, "admission_decided", False):
            return None
        blocks = [self.view.store_shape(s)[0] - 1 for s in self.checker.store_of]  # less the null block
        return judge_admission(self.groups, blocks, self.job.scenario, self.scheduler.admission_limit, self.world.rank)

    def steps(self) -> Failure | None:
        """The schedule's steps in turn; the first failure, or None."""
        scheduled = self.rec.now()  # the next step's scheduling starts
        for plan in self.scheduler.plans():
            self.rec.complete("schedule", "schedule", scheduled, args={"step": plan.step})
            with self.rec.step(plan):
                failure = self.step(plan)
            if failure is not None:
                return failure
            scheduled = self.rec.now()
        return None

    def engine_failure(self, exc: EngineError) -> Failure:
        """The run's failure when the engine under test raised: the steps still queued for an
        exchange first (their verdict comes before), else an ``engine-error`` naming where."""
        queued = self.checker.exchange(metadata=True) if self.batched and self.checker.pending else None
        step = self.scheduler.step_index
        return queued or Failure(
            kind=FailureKind.ENGINE_ERROR,
            step=step,
            message=f"the engine under test raised in {exc.what}: {exc.message}",
            details=[f"raised by {exc.function}, {exc.file}:{exc.line}" if exc.file else f"raised by {exc.function}"]
            + ([f"through {' -> '.join(exc.frames)}"] if len(exc.frames) > 1 else []),
        )

    def step(self, plan: StepPlan) -> Failure | None:
        """One step's phases; the first failure, or None."""
        self.progress.set(plan.step, "write")
        self.simulate_rank_failure(plan.step)
        for phase in (self.write, self.check_writes, self.verify, self.attention, self.metadata):
            failure = phase(plan)
            if failure is not None:
                return failure
        if self.instance is not None:
            self.instance.after_step(plan, self.runner, self.scheduler)
        return None

    # --- the phases of a step ----------------------------------------------------------

    def write(self, plan: StepPlan) -> Failure | None:
        """The engine writes the step (a PCP prefill's KV gathered first); an overflowing
        block table is the step's failure (after the steps still queued for an exchange:
        every rank's table overflows alike)."""
        during_step = None
        if self.attention_on:
            queries = self.verifier.queries(plan)

            def during_step(plan, runner, queries=queries):
                with self.rec.span("attention compute", "attention"):
                    self.shard_attention.compute(plan, runner, queries)

        layout, coords = self.par.layout, self.par.coords
        try:
            with self.rec.span("write (all groups)", "write"):
                if self.instance is not None:
                    self.instance.before_write(plan, self.runner)
                on_phase = lambda what, step=plan.step: self.progress.set(step, what)
                keys = self.runner.pcp_keys_log = []
                computed = pcp_prefill(self.engine, plan, self.par.pcp, coords.pcp_rank, layout.pcp, layout.dcp, on_phase, keys)
                self.progress.set(plan.step, "write")
                self.runner.apply(computed, self.request_ids, during_step=during_step)
        except BlockTableOverflow as exc:
            failure = self.checker.exchange(metadata=True) if self.batched else None
            return failure or Failure(
                kind=FailureKind.BLOCK_TABLE_OVERFLOW, step=plan.step, message=str(exc), group=exc.group, request_id=exc.request_id
            )
        return None

    def check_writes(self, plan: StepPlan) -> None:
        """The checker judges the step's write log (its verdict comes with the next verify)."""
        with self.rec.span("check writes", "verify"):
            self.checker.record_writes(plan)

    def verify(self, plan: StepPlan) -> Failure | None:
        """Every ``verify_every`` steps, the last step, and (incremental) when a request
        finishes: the checker reads the stores through the block tables."""
        due = plan.step % self.job.scenario.verify_every == 0 or plan.last
        if not (due or (self.checker.incremental and any(v.finished for v in plan.views))):
            return None
        self.progress.set(plan.step, "verify")
        failure = None
        with self.rec.span("verify", "verify") as span:
            indices = self.checker.verified_indices
            if not self.batched:
                failure = self.agree(self.checker.verify(plan), plan.step)
            else:
                self.checker.read(plan)
                if self.checker.pending >= self.job.check.exchange_every or plan.last:
                    failure = self.checker.exchange(metadata=True)
            span.set(step=plan.step, indices=self.checker.verified_indices - indices, result=failure.kind if failure else "pass")
        return failure

    def attention(self, plan: StepPlan) -> Failure | None:
        """With the attention check: merge the ranks' partial attention, judge it against
        the full-context reference."""
        if not self.attention_on:
            return None
        self.progress.set(plan.step, "attention")
        before = self.coll.bytes_sent
        try:
            with self.rec.span("attention merge", "attention"):
                results = self.shard_attention.finish(plan.step)
        except MergeVariantsDiffer as exc:  # every rank gathered the same choices: all fail here
            return Failure(kind=FailureKind.RANKS_DISAGREE, step=plan.step, message=str(exc), details=list(_variant_lines(exc)))
        with self.rec.span("attention check", "attention") as span:
            checks = self.verifier.checks
            failure = self.agree(self.verifier.judge(plan, results), plan.step)
            span.set(step=plan.step, checks=self.verifier.checks - checks, result=failure.kind if failure else "pass")
        self.attention_bytes += self.coll.bytes_sent - before
        if failure is None:
            self.verifier.forget_finished(plan)
        return failure

    def metadata(self, plan: StepPlan) -> Failure | None:
        """The checker judges the attention metadata the engine built for the step."""
        self.progress.set(plan.step, "metadata")
        with self.rec.span("check metadata", "verify"):
            return self.agree(self.checker.metadata_verdict(plan), plan.step)

    # --- helpers -------------------------------------------------------------------

    def agree(self, failure: Failure | None, step: int) -> Failure | None:
        """With several DCP groups (independent KV replicas), every rank takes the first
        failing group's verdict, so the world stays in lockstep and rank 0 reports it."""
        if self.par.num_dcp_groups == 1:
            return failure
        self.progress.set(step, "agree")
        verdicts = self.par.world.all_gather_object(failure)
        for rank, found in enumerate(verdicts):
            if found is not None:
                members = self.par.layout.dcp_groups()
                g = next(k for k, m in enumerate(members) if rank in m)
                ranks = ", ".join(map(str, members[g]))
                return dataclasses.replace(found, message=f"DCP group {g} (world ranks {ranks}): {found.message}")
        return None

    def simulate_rank_failure(self, step: int) -> None:
        """Break this rank now if the job says so (raise, hang forever, or exit at once)."""
        if self.job.rank_failure is None:
            return
        kind, which, at = self.job.rank_failure
        rank = self.world.rank
        if (which, at) != (rank, step):
            return
        if kind == RankFailureKind.RAISE:
            raise RuntimeError(f"simulated failure of rank {rank} at step {step}")
        self.progress.flush()  # the parent places the hang or the exit at this step
        if kind == RankFailureKind.HANG:
            while True:
                time.sleep(3600)
        os._exit(17)


def _variant_lines(exc: MergeVariantsDiffer):
    yield "a merge of different variants would run collectives of different shapes (a hang or a size error)"
    yield "every rank must take the same variant: agree on the fallback across the group (vllm#48248)"
