"""The plan of ``dcpsim selftest``: which cases run (a fault, or a baseline, on a built-in
scenario in a run config) and the rows known without running anything.

For every fault of ``dcpsim.engine.faults.FAULTS`` the plan holds one *case* per built-in
scenario (``Fault.scenarios``, default all) and run config (``Fault.configs``, each with
``Fault.needs`` merged in) on which the fault applies (``Fault.applies_to_scenario``, judged
on the scenario so configured). Each distinct config used by some fault case is also run
without a fault on every built-in scenario: a *baseline*, which must pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dcpsim.campaigns.selftest_options import (
    UnknownOption,
    apply_options,
    canonical_options,
    config_text,
    options_text,
)
from dcpsim.engine.faults import FAULTS
from dcpsim.engine.faults.base import fault_applies
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.errors import ConfigError
from dcpsim.harness.dry_run import dry_run as schedule_dry_run
from dcpsim.model.scenario import Scenario
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names

BASELINE = "none"
"""The fault name of a baseline case (``FAULTS["none"]``: the correct engine)."""


class Outcome(enum.StrEnum):
    """The outcome of a row (a string in the table and in JSON)."""

    DETECTED = "detected"
    MISSED = "missed"
    PASS = "pass"
    FALSE_POSITIVE = "FALSE POSITIVE"
    ERROR = "error"
    NOT_APPLICABLE = "not applicable"


DETECTED, MISSED, PASS, FALSE_POSITIVE, ERROR, NOT_APPLICABLE = Outcome


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


class Planner:
    """Builds a ``Plan``: the faults' cases where each applies, then the baselines of every
    config some case used, each scenario and config resolved (and dry-run) once."""

    def __init__(self, fault_names=None, scenario_names=None, *, dry_run: bool = True):
        self.builtins = builtin_scenario_names()
        for name in scenario_names or ():
            if name not in self.builtins:
                raise ConfigError(f"selftest --scenario: {name!r} is not a built-in scenario; built-ins: {', '.join(self.builtins)}")
        faults = [n for n in FAULTS if n != BASELINE] if fault_names is None else list(fault_names)
        for name in faults:
            if name not in FAULTS or name == BASELINE:
                known = ", ".join(n for n in FAULTS if n != BASELINE)
                raise ConfigError(f"selftest --fault: unknown fault {name!r}; known: {known}")
        self.scenario_names = scenario_names
        self.chosen = [s for s in self.builtins if not scenario_names or s in scenario_names]
        self.dry_run = dry_run
        self.plan = Plan(cases=[], faults=faults)
        self._bases: dict[str, Scenario] = {}
        self._layouts: dict = {}
        self._valid: dict = {}
        self._configs_used: list = []

    def build(self) -> Plan:
        for name in self.plan.faults:
            self.plan.cases.extend(self.fault_cases(name))
        self.plan_baselines()
        return self.plan

    # --- one scenario in one config ----------------------------------------------------

    def resolve(self, scenario: str, options) -> tuple[Scenario, dict, str]:
        """The scenario with the options applied, its Job options and config text (cached);
        raises ``ConfigError`` when invalid."""
        key = (scenario, options)
        if key not in self.plan.resolved:
            if scenario not in self._bases:
                self._bases[scenario] = load_scenario(scenario)
            sc, job = apply_options(self._bases[scenario], dict(options))
            self.plan.resolved[key] = (sc, job, config_text(sc, options))
        return self.plan.resolved[key]

    def why_invalid(self, scenario: str, options) -> str | None:
        """Why the scenario cannot run with these options (None: it can)."""
        key = (scenario, options)
        if key not in self._valid:
            try:
                sc, _, _ = self.resolve(scenario, options)
                self._layouts[key] = ReferenceEngine().geometries(sc.layers, sc.config)
                if self.dry_run:
                    schedule_dry_run(sc)
                self._valid[key] = None
            except UnknownOption:
                raise
            except ConfigError as exc:
                self._valid[key] = str(exc).splitlines()[0]
        return self._valid[key]

    def applies(self, name: str, scenario: str, options) -> bool:
        """Does the fault apply to the scenario so configured (its layout valid)? No dry run."""
        try:
            sc, _, _ = self.resolve(scenario, options)
            geometries = ReferenceEngine().geometries(sc.layers, sc.config)
        except UnknownOption:
            raise
        except ConfigError:
            return False
        return fault_applies(FAULTS[name], sc, geometries)

    # --- the faults --------------------------------------------------------------------

    def fault_cases(self, name: str) -> list[Case]:
        """The fault's cases: every config of it on every scenario it names (or chosen)
        where the config is valid and the fault applies. A fault with none gets a row
        saying why (not applicable, or an error of its declaration)."""
        fault = FAULTS[name]
        cases = []
        for cfg in fault.configs or ({},):
            options = canonical_options({**cfg, **fault.needs})
            try:
                cases += self._config_cases(name, options)
            except UnknownOption as exc:  # the same for every scenario: one row
                self.plan.rows.append(Row(name, "-", options_text(options), ERROR, report=str(exc)))
        if not cases and not any(r.fault == name for r in self.plan.rows):
            self.plan.rows.append(Row(name, "-", "-", NOT_APPLICABLE, report=self.why_not_applicable(name)))
        return cases

    def _config_cases(self, name: str, options) -> list[Case]:
        cases = []
        for scenario in FAULTS[name].scenarios or self.chosen:
            if self.scenario_names and scenario not in self.scenario_names:
                continue
            if scenario not in self.builtins:
                report = f"the fault names {scenario!r}, which is not a built-in scenario"
                self.plan.rows.append(Row(name, scenario, options_text(options), ERROR, report=report))
                continue
            why = self.why_invalid(scenario, options)
            if why is not None:
                self.plan.skipped.append(dict(fault=name, scenario=scenario, options=dict(options), reason=why))
                continue
            sc, _, _ = self.plan.resolved[(scenario, options)]
            if fault_applies(FAULTS[name], sc, self._layouts[(scenario, options)]):
                cases.append(Case(name, scenario, options))
                if options not in self._configs_used:
                    self._configs_used.append(options)
        return cases

    def why_not_applicable(self, name: str) -> str:
        """The reason of a not-applicable row: true for the scenarios chosen, and saying
        where else the fault applies when ``--scenario`` left those out."""
        fault = FAULTS[name]
        invalid = sorted({s["scenario"] for s in self.plan.skipped if s["fault"] == name})
        tail = f"; its configs are invalid on {', '.join(invalid)}" if invalid else ""
        if not self.scenario_names:
            return "applies to no built-in scenario in its configs" + tail
        options = [canonical_options({**cfg, **fault.needs}) for cfg in fault.configs or ({},)]
        elsewhere = [
            s
            for s in (fault.scenarios or self.builtins)
            if s in self.builtins and s not in self.chosen and any(self.applies(name, s, o) for o in options)
        ]
        where = f"applies on: {', '.join(elsewhere)}" if elsewhere else "nor on any other built-in scenario"
        return f"not on {', '.join(self.chosen)} ({where}){tail}"

    # --- the baselines -----------------------------------------------------------------

    def plan_baselines(self) -> None:
        """Every chosen scenario without a fault in its own config and in every config a
        case used; a baseline whose scenario and job equal an earlier one's is skipped."""
        runs: list = []  # the baseline runs planned: (scenario, job options, options)
        for options in [()] + [o for o in self._configs_used if o != ()]:
            for scenario in self.chosen:
                why = self.why_invalid(scenario, options)
                if why is None:
                    sc, job, _ = self.plan.resolved[(scenario, options)]
                    same = next((o for s, j, o in runs if s == sc and j == job), None)
                    if same is None:
                        runs.append((sc, job, options))
                        self.plan.cases.append(Case(BASELINE, scenario, options))
                        continue
                    why = f"the same run as its baseline in config {options_text(same)}"  # a Mamba mode, say
                self.plan.skipped.append(dict(fault=BASELINE, scenario=scenario, options=dict(options), reason=why))


def plan_selftest(fault_names=None, scenario_names=None, *, dry_run: bool = True) -> Plan:
    """Which cases to run. ``dry_run`` also runs each case's schedule in this process
    (``harness.dry_run``) so a config the workload cannot run under is skipped instead of
    failing a world."""
    return Planner(fault_names, scenario_names, dry_run=dry_run).build()
