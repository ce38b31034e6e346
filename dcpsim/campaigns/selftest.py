"""``dcpsim selftest``: every registered fault is caught, and a correct engine is not.

For every fault of ``dcpsim.engine.faults.FAULTS`` the plan holds one *case* per
built-in scenario (``Fault.scenarios``, default all) and run config
(``Fault.configs``, each with ``Fault.needs`` merged in) on which the fault
applies (``Fault.applies_to_scenario``, judged on the scenario so
configured). Each distinct config used by some fault case is also run without
a fault on every built-in scenario: a *baseline*, which must pass (a baseline
whose scenario and job equal an earlier one's is skipped: its run is that one).

Cases of one DCP size share one world (a gloo world by default, threads with
``--in-process``), run one after another, so world start-up does not
dominate; a world that breaks is rerun case by case so the breakage is
attributed. The verdict: exit 0 iff every fault that applies somewhere is
detected in at least one case and every baseline passes; 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.errors import ConfigError
from dcpsim.harness.collectives import CollectiveTimeout
from dcpsim.harness.dry_run import dry_run as schedule_dry_run
from dcpsim.harness.job import RUN_OPTIONS, Job
from dcpsim.harness.runner import run_each
from dcpsim.harness.world_failure import RankFailureError
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.config import SimConfig
from dcpsim.model.scenario import Scenario, ScenarioOverrides
from dcpsim.options import from_flat, keys
from dcpsim.plural import plural
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names

BASELINE = "none"
"""The fault name of a baseline case (``FAULTS["none"]``: the correct engine)."""

OPTION_ALIASES = {
    "dcp": "decode_context_parallel_size",
    "W": "decode_context_parallel_size",
    "interleave": "cp_kv_cache_interleave_size",
    "I": "cp_kv_cache_interleave_size",
    "B": "block_size",
    "Bk": "kernel_block_size",
    "pcp": "prefill_context_parallel_size",
    "tp": "tensor_parallel_size",
}
_SHORT = {
    "prefill_context_parallel_size": "PCP",
    "tensor_parallel_size": "TP",
    "decode_context_parallel_size": "W",
    "cp_kv_cache_interleave_size": "I",
    "block_size": "B",
    "kernel_block_size": "Bk",
}


class Outcome(enum.StrEnum):
    """The outcome of a row (a string in the table and in JSON)."""

    DETECTED = "detected"
    MISSED = "missed"
    PASS = "pass"
    FALSE_POSITIVE = "FALSE POSITIVE"
    ERROR = "error"
    NOT_APPLICABLE = "not applicable"


DETECTED, MISSED, PASS, FALSE_POSITIVE, ERROR, NOT_APPLICABLE = Outcome


# ----------------------------------------------------------------------------- options


SCENARIO_KEYS = keys(ScenarioOverrides)
"""Run options that override the scenario (``Scenario.with_overrides``)."""
CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(SimConfig))
"""Run options that set a ``SimConfig`` field directly."""
JOB_KEYS = tuple(k for k in RUN_OPTIONS if k not in ("inject", "rank_failure"))
"""Run options of the ``Job`` (the attention check, the engine, the checks)."""


def canonical_options(options: dict) -> tuple[tuple[str, object], ...]:
    """Aliases resolved, sorted: a hashable key for one run config."""
    return tuple(sorted((OPTION_ALIASES.get(k, k), v) for k, v in options.items()))


class UnknownOption(ConfigError):
    """A fault asks for a run option nothing here knows (a declaration error)."""


def apply_options(base: Scenario, options) -> tuple[Scenario, dict]:
    """``base`` with the run options applied, and the ``Job`` options among them.

    An option is a scenario override (``ScenarioOverrides``), a ``SimConfig`` field or a
    ``Job`` option (in that order); anything else is a ``ConfigError``.
    """
    overrides, config, job = {}, {}, {}
    for key, value in dict(options).items():
        key = OPTION_ALIASES.get(key, key)
        if key in SCENARIO_KEYS:
            overrides[key] = value
        elif key in CONFIG_KEYS:
            config[key] = value
        elif key in JOB_KEYS:
            job[key] = value
        else:
            raise UnknownOption(
                f"unknown run option {key!r}: not a scenario override ({', '.join(SCENARIO_KEYS)}), "
                f"a SimConfig field or a Job option ({', '.join(sorted(JOB_KEYS))})"
            )
    scenario = base.with_overrides(ScenarioOverrides(**overrides)) if overrides else base
    if config:
        scenario = dataclasses.replace(scenario, config=dataclasses.replace(scenario.config, **config))
    return scenario, job


def config_text(scenario, options) -> str:
    """``W=2 I=1`` plus every other explicit option (``B=64 Bk=16 attention=True``)."""
    cfg = scenario.config
    parts = [f"W={cfg.decode_context_parallel_size}", f"I={cfg.cp_kv_cache_interleave_size}"]
    keys = {key for key, _ in options}
    if cfg.prefill_context_parallel_size > 1 and "prefill_context_parallel_size" not in keys:
        parts.append(f"PCP={cfg.prefill_context_parallel_size}")  # the scenario's own
    for key, value in options:
        if key in ("decode_context_parallel_size", "cp_kv_cache_interleave_size"):
            continue
        parts.append(f"{_SHORT.get(key, key)}={value}")
    return " ".join(parts)


# ----------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Case:
    fault: str  # BASELINE for a no-fault run
    scenario: str
    options: tuple[tuple[str, object], ...] = ()

    @property
    def baseline(self) -> bool:
        return self.fault == BASELINE


@dataclass
class Row:
    fault: str
    scenario: str
    config: str
    outcome: Outcome
    kind: str | None = None
    report: str = ""
    """The first line of the failure report (or of the error)."""
    seconds: float = 0.0
    dcp_size: int | None = None
    options: dict = field(default_factory=dict)

    @property
    def baseline(self) -> bool:
        return self.fault == BASELINE


@dataclass
class Plan:
    cases: list[Case]
    """Fault cases first (registry order), then baselines."""
    resolved: dict = field(default_factory=dict)
    """(scenario, options) -> (Scenario, Job fields, config text)."""
    rows: list[Row] = field(default_factory=list)
    """Rows known without running: not-applicable faults, planning errors."""
    skipped: list[dict] = field(default_factory=list)
    """(fault, scenario, config) combinations left out, with the reason."""
    faults: list[str] = field(default_factory=list)


def plan_selftest(fault_names=None, scenario_names=None, *, dry_run: bool = True) -> Plan:
    """Which cases to run. ``dry_run`` also runs each case's schedule in this
    process (``harness.dry_run``) so a config the workload cannot run under
    is skipped instead of failing a world."""
    builtins = builtin_scenario_names()
    for name in scenario_names or ():
        if name not in builtins:
            raise ConfigError(f"selftest --scenario: {name!r} is not a built-in scenario; built-ins: {', '.join(builtins)}")
    faults = [n for n in FAULTS if n != BASELINE] if fault_names is None else list(fault_names)
    for name in faults:
        if name not in FAULTS or name == BASELINE:
            known = ", ".join(n for n in FAULTS if n != BASELINE)
            raise ConfigError(f"selftest --fault: unknown fault {name!r}; known: {known}")
    chosen = [s for s in builtins if not scenario_names or s in scenario_names]
    plan = Plan(cases=[], faults=faults)
    bases: dict[str, object] = {}
    layouts_of: dict = {}
    valid: dict = {}

    def resolve(scenario: str, options) -> tuple[object, dict, str]:
        """Scenario with options (cached); raises ConfigError when invalid."""
        key = (scenario, options)
        if key not in plan.resolved:
            if scenario not in bases:
                bases[scenario] = load_scenario(scenario)
            sc, job = apply_options(bases[scenario], dict(options))
            plan.resolved[key] = (sc, job, config_text(sc, options))
        return plan.resolved[key]

    def check(scenario: str, options) -> str | None:
        """Why the scenario cannot run with these options (None: it can)."""
        key = (scenario, options)
        if key not in valid:
            try:
                sc, _, _ = resolve(scenario, options)
                layouts_of[key] = ReferenceEngine().geometries(sc.layers, sc.config)
                if dry_run:
                    schedule_dry_run(sc)
                valid[key] = None
            except UnknownOption:
                raise
            except ConfigError as exc:
                valid[key] = str(exc).splitlines()[0]
        return valid[key]

    def applies(name: str, scenario: str, options) -> bool:
        """Does the fault apply to the scenario so configured (its layout valid)? No dry run."""
        try:
            sc, _, _ = resolve(scenario, options)
            geometries = ReferenceEngine().geometries(sc.layers, sc.config)
        except UnknownOption:
            raise
        except ConfigError:
            return False
        return FAULTS[name].applies_to_scenario(sc, geometries)

    def why_not_applicable(name: str) -> str:
        """The reason of a not-applicable row: true for the scenarios chosen, and saying
        where else the fault applies when ``--scenario`` left those out."""
        fault = FAULTS[name]
        invalid = sorted({s["scenario"] for s in plan.skipped if s["fault"] == name})
        tail = f"; its configs are invalid on {', '.join(invalid)}" if invalid else ""
        if not scenario_names:
            return "applies to no built-in scenario in its configs" + tail
        options = [canonical_options({**cfg, **fault.needs}) for cfg in fault.configs or ({},)]
        elsewhere = [
            s for s in (fault.scenarios or builtins) if s in builtins and s not in chosen and any(applies(name, s, o) for o in options)
        ]
        where = f"applies on: {', '.join(elsewhere)}" if elsewhere else "nor on any other built-in scenario"
        return f"not on {', '.join(chosen)} ({where}){tail}"

    configs_used: list = []
    for name in faults:
        fault = FAULTS[name]
        cases = []
        for cfg in fault.configs or ({},):
            options = canonical_options({**cfg, **fault.needs})
            for scenario in fault.scenarios or chosen:
                if scenario_names and scenario not in scenario_names:
                    continue
                if scenario not in builtins:
                    plan.rows.append(
                        Row(
                            name,
                            scenario,
                            options_text(options),
                            ERROR,
                            report=f"the fault names {scenario!r}, which is not a built-in scenario",
                        )
                    )
                    continue
                try:
                    why = check(scenario, options)
                except UnknownOption as exc:  # the same for every scenario: one row
                    plan.rows.append(Row(name, "-", options_text(options), ERROR, report=str(exc)))
                    break
                if why is not None:
                    plan.skipped.append(dict(fault=name, scenario=scenario, options=dict(options), reason=why))
                    continue
                sc, _, _ = plan.resolved[(scenario, options)]
                if fault.applies_to_scenario(sc, layouts_of[(scenario, options)]):
                    cases.append(Case(name, scenario, options))
                    if options not in configs_used:
                        configs_used.append(options)
        if not cases and not any(r.fault == name for r in plan.rows):
            plan.rows.append(Row(name, "-", "-", NOT_APPLICABLE, report=why_not_applicable(name)))
        plan.cases.extend(cases)
    runs: list = []  # the baseline runs planned: (scenario, job fields, options)
    for options in [()] + [o for o in configs_used if o != ()]:
        for scenario in chosen:
            why = check(scenario, options)
            if why is None:
                sc, job, _ = plan.resolved[(scenario, options)]
                same = next((o for s, j, o in runs if s == sc and j == job), None)
                if same is not None:  # options the scenario has nothing for (a Mamba mode)
                    why = f"the same run as its baseline in config {options_text(same)}"
                else:
                    runs.append((sc, job, options))
                    plan.cases.append(Case(BASELINE, scenario, options))
                    continue
            plan.skipped.append(dict(fault=BASELINE, scenario=scenario, options=dict(options), reason=why))
    return plan


def options_text(options) -> str:
    return " ".join(f"{_SHORT.get(k, k)}={v}" for k, v in options) or "(scenario's own)"


# ----------------------------------------------------------------------------- running


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


def run_plan(
    plan: Plan, *, engine: EngineChoice | None = None, world: WorldOptions | None = None, progress=None, on_wait=None
) -> list[Row]:
    """Run every case; rows in plan order (planning rows of a fault after its cases). The
    faults are variants of the reference engine; the baselines run ``engine`` (default the
    reference), which must pass them all; every world as ``world`` says (gloo or threads,
    its timeout). ``progress(row)`` is called as each case ends (with the time its slowest
    rank took); ``on_wait(message)`` when a world keeps the parent waiting."""
    engine, world = engine or EngineChoice(), world or WorldOptions()
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
    fmt = lambda c: "  ".join(f"{v:<{w}}" for v, w in zip(c[:4], widths)) + "  " + c[4]  # noqa: E731
    out = [fmt(headers), fmt(tuple("-" * w for w in widths) + ("-" * len(headers[4]),))]
    out += [fmt(c).rstrip() for c in cells]
    return "\n".join(out)


def bug_class_legend(faults: list[str]) -> list[str]:
    width = max((len(n) for n in faults), default=0)
    return [f"  {n:<{width}}  {FAULTS[n].bug_class or '(no bug class given)'}" for n in faults]
