"""Running one job from the command line (``run``, ``replay``): the checks before any rank
starts (the machine's memory, the parent's dry run), the world, the report, the trace."""

from __future__ import annotations

import sys
import time

from dcpsim.cli.outcome import finish, json_errors
from dcpsim.cli.progress import print_waiting
from dcpsim.errors import ConfigError, HarnessError
from dcpsim.harness.budget import check_budget, cpu_warning, pool_note
from dcpsim.harness.dry_run import dry_run
from dcpsim.harness.job import Job
from dcpsim.harness.replay import replay_record
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.trace_file import Trace, check_trace_path
from dcpsim.model.scenario import Scenario


def check_run_budget(
    scenario: Scenario, *, force: bool = False, in_process: bool = False, attention_width: int = 0,
    local_ranks: int | None = None, say: bool = True,
) -> None:  # fmt: skip
    """Refuse (exit 2, with the figures) a run the machine cannot hold, before the parent's
    dry run allocates anything; one warning line (if ``say``) when the ranks outnumber the CPUs."""
    try:
        check_budget(scenario, in_process=in_process, force=force, attention_width=attention_width, local_ranks=local_ranks)
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None
    ranks = scenario.config.world_size if local_ranks is None else local_ranks
    warning = None if in_process else cpu_warning(ranks)
    if warning and say:
        print(warning, file=sys.stderr)


def attention_width(job: Job) -> int:
    """The K/V vector width each rank stores (0 without ``--attention``)."""
    return job.attention.kv_width if job.attention.enabled else 0


def check_dry_run(job: Job, say: bool = True) -> None:
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
    for line in (notes + ([note] if note else [])) if say else ():
        print(f"dcpsim: note: {scenario.source}: {line}", file=sys.stderr)


def run_job(job: Job, *, as_json: bool = False, force: bool = False) -> int:
    """Validate, start a world (or threads), verify, print; the exit code of the verdict."""
    scenario = job.scenario
    with json_errors(as_json):
        trace_path = check_trace_path(job.world.trace) if job.world.trace else None
        check_run_budget(scenario, force=force, in_process=job.world.in_process, attention_width=attention_width(job))
        check_dry_run(job)
        trace = Trace(trace_path) if trace_path else None
        start = time.perf_counter()
        (report,) = run_jobs([job], trace=trace, on_wait=print_waiting)
        report.wall_time_s = time.perf_counter() - start
        report.replay = replay_record(job)
    code = finish(report, as_json)
    if trace is not None:
        write_trace(trace, report)
    return code


def write_trace(trace: Trace, report) -> None:
    """Write ``--trace``'s file after the report; a write that fails now is exit 3."""
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
    print(f"dcpsim: trace of {count} events written to {trace.path} (open it in ui.perfetto.dev)", file=sys.stderr)
