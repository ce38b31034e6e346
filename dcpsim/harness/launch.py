"""Launching one run: the scenario with its overrides, the checks before any rank starts (the
machine's memory, the parent's dry run), the world, the report, the trace file.

The one path behind ``dcpsim run`` / ``replay`` / ``worker`` (``dcpsim.cli.launch``) and
``dcpsim.run`` (``dcpsim.api``): what a caller says to its user (a warning, a note) goes to
its ``say(line)``, so the command line prints it on stderr and the API keeps it in the report.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from dcpsim.engine.choice import EngineChoice
from dcpsim.errors import ConfigError, HarnessError
from dcpsim.harness.budget import check_budget, check_pd_budget, cpu_warning, pool_note
from dcpsim.harness.dry_run import dry_run
from dcpsim.harness.job import Job
from dcpsim.harness.pd import run_pd
from dcpsim.harness.pd_job import PDJob, prepare_pd
from dcpsim.harness.pd_report import PDReport
from dcpsim.harness.replay import replay_record
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.trace_file import Trace, check_trace_path
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.scenario import Scenario, ScenarioOverrides
from dcpsim.options import from_flat, keys
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.pd import ROLES
from dcpsim.verify.report import RunReport

Say = Callable[[str], None]


def silent(line: str) -> None:
    """A ``say`` that drops the line."""


def resolve_scenario(scenario: str | Path | Scenario, overrides: ScenarioOverrides, world_size: int | None = None) -> Scenario:
    """The scenario (a built-in name, a file, or a ``Scenario``) with ``overrides`` applied;
    under torchrun (``world_size``) W is the torchrun world size unless PCP or TP sets the grid."""
    if overrides.seed is not None and overrides.seed < 0:  # as a file's seed
        raise ConfigError(f"--seed must be >= 0, got {overrides.seed}")
    base = scenario if isinstance(scenario, Scenario) else load_scenario(str(scenario))
    dcp = overrides.decode_context_parallel_size
    grid = overrides.prefill_context_parallel_size or overrides.tensor_parallel_size
    if world_size is not None and not grid and base.config.prefill_context_parallel_size == 1:
        if dcp is not None and dcp != world_size:
            raise ConfigError(f"--decode-context-parallel-size {dcp} does not match the torchrun world size {world_size}")
        overrides = dataclasses.replace(overrides, decode_context_parallel_size=world_size)
    try:
        return base.with_overrides(overrides)
    except ConfigError as exc:
        raise ConfigError(f"{base.source}: {exc}") from None


def check_run_budget(
    scenario: Scenario, *, force: bool = False, in_process: bool = False, attention_width: int = 0,
    local_ranks: int | None = None, say: Say = silent,
) -> None:  # fmt: skip
    """Refuse (exit 2, with the figures) a run the machine cannot hold, before the parent's
    dry run allocates anything; one warning line when the ranks outnumber the CPUs."""
    try:
        check_budget(scenario, in_process=in_process, force=force, attention_width=attention_width, local_ranks=local_ranks)
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None
    ranks = scenario.config.world_size if local_ranks is None else local_ranks
    warning = None if in_process else cpu_warning(ranks)
    if warning:
        say(warning)


def attention_width(job: Job) -> int:
    """The K/V vector width each rank stores (0 without ``--attention``)."""
    return job.attention.kv_width if job.attention.enabled else 0


def check_dry_run(job: Job, say: Say = silent) -> None:
    """The parent's dry run of the schedule: a bad scenario is exit 2; so is a
    ``--simulate-rank-failure`` step the schedule never reaches. A forced preemption that
    never fires, and a pool larger than ``kv_cache_tokens`` asked for, are one note each."""
    scenario = job.scenario
    try:
        found = dry_run(scenario)
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None
    if job.rank_failure is not None and job.rank_failure[2] >= found.steps:
        kind, rank, step = job.rank_failure
        raise ConfigError(
            f"--simulate-rank-failure {kind}:{rank}:{step}: the schedule of {scenario.name} has "
            f"{found.steps} steps (0-{found.steps - 1}), so the failure would never happen"
        )
    notes = [
        f"request {rid!r}: preempt_at_steps {step} never fires (the request is not running at step "
        f"{step}; the schedule has {found.steps} steps)"
        for rid, step in found.unfired_preemptions
    ]
    note = pool_note(scenario)
    for line in notes + ([note] if note else []):
        say(f"dcpsim: note: {scenario.source}: {line}")


def launch_job(job: Job, *, force: bool = False, say: Say = silent, on_wait=None) -> tuple[RunReport, Trace | None]:
    """Validate, start a world (or threads), verify: the merged report, with its wall time and
    replay record, and the ``--trace`` timeline (``job.world.trace``; None without), which the
    caller writes (``write_trace``) once it has shown the report."""
    trace_path = check_trace_path(job.world.trace) if job.world.trace else None
    check_run_budget(job.scenario, force=force, in_process=job.world.in_process, attention_width=attention_width(job), say=say)
    check_dry_run(job, say)
    trace = Trace(trace_path) if trace_path else None
    start = time.perf_counter()
    (report,) = run_jobs([job], trace=trace, on_wait=on_wait)
    report.wall_time_s = time.perf_counter() - start
    report.replay = replay_record(job)
    return report, trace


def launch_options(
    scenario: str | Path | Scenario, options: dict, *, force: bool = False, say: Say = silent, on_wait=None
) -> tuple[Scenario, RunReport, Trace | None]:
    """One run from run-option keys (``options``: the option tree's keys, as ``dcpsim.run`` and
    ``engine bisect`` take them): the scenario with its overrides, its ``Job``, ``launch_job``.
    A scenario with a ``[disaggregated]`` table comes back with no report (the caller runs it
    as P/D)."""
    overrides = from_flat(ScenarioOverrides, {k: v for k, v in options.items() if k in SCENARIO_KEYS})
    resolved = resolve_scenario(scenario, overrides)
    if resolved.disaggregated is not None:
        return resolved, None, None
    job = Job.from_options(resolved, **{k: v for k, v in options.items() if k in JOB_KEYS})
    report, trace = launch_job(job, force=force, say=say, on_wait=on_wait)
    return resolved, report, trace


SCENARIO_KEYS = keys(ScenarioOverrides)
JOB_KEYS = keys(Job)


def write_trace(trace: Trace, report: RunReport, say: Say = silent) -> None:
    """Write the ``--trace`` timeline of the run ``report`` tells; a write that fails now is exit 3."""
    other = dict(
        scenario=report.scenario,
        decode_context_parallel_size=report.dcp_size,
        cp_kv_cache_interleave_size=report.interleave_size,
        passed=report.passed,
        steps=report.steps,
    )
    try:
        count = trace.write(other)
    except OSError as exc:
        raise HarnessError(f"--trace {trace.path}: could not write the trace: {exc}") from None
    say(f"dcpsim: trace of {count} events written to {trace.path} (open it in ui.perfetto.dev)")


PD_UNSUPPORTED = ("in_process", "trace", "attention", "rank_failure")
"""Run options a P/D run does not take yet."""


def check_pd_options(given: dict) -> None:
    """Refuse (exit 2) the run options ``given`` (key -> value, None or False: not given) that a
    P/D run does not take: one W (its instances have their own) and ``PD_UNSUPPORTED``."""
    if given.get("decode_context_parallel_size") is not None:
        raise ConfigError(
            "--decode-context-parallel-size sizes one instance; a P/D scenario's instances take --prefill-dcp and --decode-dcp"
        )
    for key in PD_UNSUPPORTED:
        if given.get(key):
            flag = "--simulate-rank-failure" if key == "rank_failure" else "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} is not supported for P/D runs yet")


def launch_pd(
    scenario: Scenario, *, inject: str | None = None, world: WorldOptions | None = None, force: bool = False,
    say: Say = silent, on_wait=None, engine: EngineChoice | None = None,
) -> PDReport:  # fmt: skip
    """A disaggregated prefill/decode run of ``scenario`` (its ``[disaggregated]`` table):
    the budget and the dry runs of both instances, then one gloo world; ``engine``: both
    instances' engine under test (the reference by default)."""
    job = PDJob(scenario, inject=inject, engine=engine or EngineChoice())
    try:
        instances = {role: job.instance(role) for role in ROLES}
        check_pd_budget(instances, force=force)
        warning = cpu_warning(sum(sc.config.world_size for sc in instances.values()))
        if warning:
            say(warning)
        prepare_pd(job)
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None
    return run_pd(job, world=world or WorldOptions(), on_wait=on_wait)
