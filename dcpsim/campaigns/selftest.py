"""``dcpsim selftest``: every registered fault is caught, and a correct engine is not.

The plan (``campaigns.selftest_plan``) holds the cases. Cases of one DCP size share one
world (a gloo world by default, threads with ``--in-process``), run one after another, so
world start-up does not dominate; a world that breaks is rerun case by case so the
breakage is attributed. The verdict: exit 0 iff every fault that applies somewhere is
detected in at least one case and every baseline passes; 1 otherwise.
"""

from __future__ import annotations

import dataclasses

from dcpsim.campaigns.selftest_plan import (
    DETECTED,
    ERROR,
    FALSE_POSITIVE,
    MISSED,
    NOT_APPLICABLE,
    PASS,
    Case,
    Plan,
    Row,
)
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.faults import FAULTS
from dcpsim.harness.collectives import CollectiveTimeout
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_each
from dcpsim.harness.world_failure import RankFailureError
from dcpsim.harness.world_options import WorldOptions
from dcpsim.options import from_flat
from dcpsim.plural import plural


def _jobs(plan: Plan, cases: list[Case], engine: EngineChoice, world: WorldOptions) -> list[Job]:
    """The cases' jobs, in ``world``; the baselines run ``engine``, the faults their own
    variant of the reference engine."""
    jobs = []
    for case in cases:
        scenario, job_options, _ = plan.resolved[(case.scenario, case.options)]
        branches = dict(world=world, **({"engine": engine} if case.baseline else {}))
        options = dict(job_options, inject=None if case.baseline else case.fault)
        jobs.append(from_flat(Job, options, scenario=scenario, **branches))
    return jobs


HANG_TIMEOUT_S = 10.0
"""The process-group timeout of the worlds of faults that hang (at most ``--timeout``)."""

COLLECTIVE_HANG = "collective-hang"
"""The kind of a row whose fault showed as a hang the harness reported (``Fault.expects``)."""


def is_collective_hang(exc: BaseException | None) -> bool:
    """A harness failure that reports diverging collectives: a gloo world's ``collective
    hang`` (a rank ran ahead of a collective the others waited in) or a thread rank's
    ``CollectiveTimeout``."""
    return isinstance(exc, CollectiveTimeout) or (isinstance(exc, RankFailureError) and str(exc).startswith("collective hang"))


def _expects_hang(fault: str) -> bool:
    return FAULTS[fault].expects == "hang"


def _row(plan: Plan, case: Case, *, report=None, error: str | None = None, seconds: float = 0.0, exc: BaseException | None = None) -> Row:
    scenario, _, text = plan.resolved[(case.scenario, case.options)]
    row = Row(
        case.fault,
        case.scenario,
        text,
        ERROR,
        seconds=seconds,
        dcp_size=scenario.config.decode_context_parallel_size,
        options=dict(case.options),
    )
    if error is not None:
        row.report = error
        if not case.baseline and _expects_hang(case.fault) and is_collective_hang(exc):
            row.outcome, row.kind = DETECTED, COLLECTIVE_HANG
    elif report.passed:
        row.outcome = PASS if case.baseline else MISSED
    else:
        row.outcome = FALSE_POSITIVE if case.baseline else DETECTED
        row.kind = report.failure.kind
        row.report = report.failure.lines()[0]
    return row


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}"


def _skip_baselines(plan: Plan, why) -> None:
    """Each baseline for which ``why(case)`` gives a reason (None: it runs) leaves the plan for
    its skipped list, with that reason; the other cases keep their order."""
    kept = []
    for case in plan.cases:
        reason = why(case) if case.baseline else None
        if reason is None:
            kept.append(case)
        else:
            plan.skipped.append(dict(fault=case.fault, scenario=case.scenario, options=dict(case.options), reason=reason))
    plan.cases[:] = kept


def _skip_refused_baselines(plan: Plan, engine: EngineChoice) -> None:
    """The baselines the engine under test refuses (``EngineChoice.refusal``) leave the plan
    for its skipped list, with the engine's reason: an engine is judged on what it runs (the
    faults are variants of the reference engine and run everywhere they apply)."""

    def refused(case) -> str | None:
        why = engine.refusal(plan.resolved[(case.scenario, case.options)][0])
        return None if why is None else f"the engine refuses it: {why}"

    _skip_baselines(plan, refused)


def _skip_same_baselines(plan: Plan, engine: EngineChoice, world: WorldOptions) -> None:
    """A baseline whose job, as built for the engine under test, equals an earlier baseline's
    leaves the plan for its skipped list: the planner compares the options it was given, and an
    option set to what the engine takes anyway (``lse_base=e`` where the engine computes base-e
    LSEs, as the reference does) is the same run."""
    baselines = [case for case in plan.cases if case.baseline]
    jobs = dict(zip(map(id, baselines), _jobs(plan, baselines, engine, world)))
    kept: list = []  # (job, config text) of the baselines that run

    def same(case) -> str | None:
        job = jobs[id(case)]
        text = next((text for earlier, text in kept if earlier == job), None)
        if text is None:
            kept.append((job, plan.resolved[(case.scenario, case.options)][2]))
            return None
        return f"the same run as its baseline in config {text} (the job the engine under test runs)"

    _skip_baselines(plan, same)


def run_plan(
    plan: Plan, *, engine: EngineChoice | None = None, world: WorldOptions | None = None, progress=None, on_wait=None
) -> list[Row]:
    """Run every case; rows in plan order (planning rows of a fault after its cases). The
    faults are variants of the reference engine; the baselines run ``engine`` (default the
    reference), which must pass them all; every world as ``world`` says (gloo or threads,
    its timeout). ``progress(row)`` is called as each case ends (with the time its slowest
    rank took); ``on_wait(message)`` when a world keeps the parent waiting."""
    engine, world = engine or EngineChoice(), world or WorldOptions()
    _skip_refused_baselines(plan, engine)
    _skip_same_baselines(plan, engine, world)
    by_world: dict[tuple[int, bool], list[int]] = {}
    for k, case in enumerate(plan.cases):
        scenario = plan.resolved[(case.scenario, case.options)][0]
        # a fault that hangs its world gets a world of its own: the cases after it need not rerun
        hangs = not case.baseline and _expects_hang(case.fault)
        by_world.setdefault((scenario.config.world_size, hangs), []).append(k)
    rows: list[Row | None] = [None] * len(plan.cases)
    for (_, hangs), ks in by_world.items():
        cases = [plan.cases[k] for k in ks]
        # a hang ends at the process-group timeout: a short one (a healthy step of these small
        # worlds takes milliseconds per collective)
        options = dataclasses.replace(world, timeout=min(world.timeout, HANG_TIMEOUT_S)) if hangs else world

        def settle(j, outcome, ks=ks, cases=cases):
            if outcome.error is not None:
                row = _row(plan, cases[j], error=_first_line(outcome.error), seconds=outcome.seconds, exc=outcome.error)
            else:
                row = _row(plan, cases[j], report=outcome.report, seconds=outcome.seconds)
            rows[ks[j]] = row
            if progress:
                progress(row)

        run_each(_jobs(plan, cases, engine, options), on_outcome=settle, on_wait=on_wait)
    out: list[Row] = []
    for name in plan.faults:
        out += [r for r, c in zip(rows, plan.cases) if c.fault == name]
        out += [r for r in plan.rows if r.fault == name]
    out += [r for r, c in zip(rows, plan.cases) if c.baseline]
    return out


# ----------------------------------------------------------------------------- verdict


def fault_status(rows: list[Row], name: str) -> str:
    """detected (somewhere), not applicable, or missed/error (never detected)."""
    mine = [r for r in rows if r.fault == name]
    if any(r.outcome == DETECTED for r in mine):
        return DETECTED
    if mine and all(r.outcome == NOT_APPLICABLE for r in mine):
        return NOT_APPLICABLE
    return ERROR if mine and all(r.outcome == ERROR for r in mine) else MISSED


def verdict(rows: list[Row], faults: list[str]) -> tuple[bool, list[str]]:
    """(passed, summary lines): every applicable fault detected somewhere, every baseline passes."""
    status = {name: fault_status(rows, name) for name in faults}
    baselines = [r for r in rows if r.baseline]
    bad_baselines = [r for r in baselines if r.outcome != PASS]
    undetected = [n for n, s in status.items() if s in (MISSED, ERROR)]
    counts = {s: sum(v == s for v in status.values()) for s in (DETECTED, MISSED, ERROR, NOT_APPLICABLE)}
    lines = [
        f"{plural(len(faults), 'fault')}: {counts[DETECTED]} detected, {counts[MISSED]} missed, "
        f"{plural(counts[ERROR], 'error')}, {counts[NOT_APPLICABLE]} not applicable; "
        f"{plural(len(baselines), 'baseline')}: {sum(r.outcome == PASS for r in baselines)} passed, "
        f"{plural(sum(r.outcome == FALSE_POSITIVE for r in baselines), 'false positive')}, "
        f"{plural(sum(r.outcome == ERROR for r in baselines), 'error')}"
    ]
    passed = not undetected and not bad_baselines
    if passed:
        lines.append("selftest PASSED: every applicable fault was detected and no baseline failed")
    else:
        why = [f"not detected: {', '.join(undetected)}"] if undetected else []
        if bad_baselines:
            why.append("baseline failures: " + ", ".join(f"{r.scenario} ({r.config})" for r in bad_baselines))
        lines.append("selftest FAILED: " + "; ".join(why))
    return passed, lines


def row_line(row: Row) -> str:
    """One finished run for the progress display:
    ``interleave-off-by-one on dsv3 (W=2 I=1): detected [wrong-content] (0.52 s)``."""
    who = "(baseline)" if row.baseline else row.fault
    line = f"{who} on {row.scenario} ({row.config}): {row.outcome}" + (f" [{row.kind}]" if row.kind else "")
    if row.outcome in (ERROR, FALSE_POSITIVE) and row.report:
        line += f": {row.report}"
    return line + f" ({row.seconds:.2f} s)"


def format_table(rows: list[Row]) -> str:
    headers = ("fault", "scenario", "config", "result", "first line of the report")
    cells = [
        (r.fault if not r.baseline else "(baseline)", r.scenario, r.config, r.outcome, (f"[{r.kind}] " if r.kind else "") + r.report)
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers[:4])]
    fmt = lambda c: "  ".join(f"{v:<{w}}" for v, w in zip(c[:4], widths)) + "  " + c[4]
    out = [fmt(headers), fmt(tuple("-" * w for w in widths) + ("-" * len(headers[4]),))]
    out += [fmt(c).rstrip() for c in cells]
    return "\n".join(out)


def bug_class_legend(faults: list[str]) -> list[str]:
    width = max((len(n) for n in faults), default=0)
    return [f"  {n:<{width}}  {FAULTS[n].bug_class or '(no bug class given)'}" for n in faults]
