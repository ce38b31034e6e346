"""A whole selftest: the plan (``selftest_plan``), the engine faults and baselines
(``selftest.run_plan``), the P/D faults (``pd_selftest``), the verdict and the
``selftest --json`` document. Shared by ``dcpsim selftest`` and ``dcpsim.selftest``."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from dcpsim.campaigns.pd_selftest import PD_BASELINES, PD_SCENARIO, pd_fault_names, run_pd_selftest
from dcpsim.campaigns.selftest import fault_status, run_plan, verdict
from dcpsim.campaigns.selftest_plan import Plan, Row, plan_selftest
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.faults import get_pd_fault
from dcpsim.harness.world_options import WorldOptions
from dcpsim.report_file import SCHEMA_VERSION


@dataclass
class SelftestResult:
    passed: bool
    plan: Plan
    pd_faults: list[str]
    rows: list[Row]
    summary: list[str]
    seconds: float
    faults: list[str] = field(default_factory=list)
    """Every fault asked for: the engine faults, then the P/D faults."""

    def document(self) -> dict:
        """The ``selftest --json`` document."""
        return {
            "schema_version": SCHEMA_VERSION,
            "passed": self.passed,
            "faults": {n: fault_status(self.rows, n) for n in self.faults},
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "skipped": self.plan.skipped,
            "summary": self.summary,
            "wall_time_s": round(self.seconds, 2),
        }


def split_faults(faults: list[str] | None, scenarios: list[str] | None) -> tuple[list[str] | None, list[str]]:
    """(the engine faults to plan, None: all; the P/D faults to run). The P/D half runs on
    its built-in (always in gloo worlds) unless ``faults`` or ``scenarios`` leave it out."""
    names = pd_fault_names()
    pd_chosen = names if faults is None else [n for n in faults if n in names]
    if scenarios is not None:  # each P/D fault runs on its built-in (``PDFault.scenario``)
        pd_chosen = [n for n in pd_chosen if (get_pd_fault(n).scenario or PD_SCENARIO) in scenarios]
    plain = None if faults is None else [n for n in faults if n not in names]
    return plain, pd_chosen


def plan_of(faults: list[str] | None, scenarios: list[str] | None, *, dry_run: bool = True) -> tuple[Plan, list[str]]:
    """The plan of the engine faults and baselines, and the P/D faults to run."""
    plain, pd_chosen = split_faults(faults, scenarios)
    run_plain = plain is None or bool(plain) or not pd_chosen
    plan = plan_selftest(plain, scenarios, dry_run=dry_run) if run_plain else Plan(cases=[])
    return plan, pd_chosen


def runs_of(plan: Plan, pd_chosen: list[str]) -> int:
    """How many runs the selftest makes (for a progress display)."""
    return len(plan.cases) + (len(pd_chosen) + PD_BASELINES if pd_chosen else 0)


def run_selftest(
    plan: Plan, pd_chosen: list[str], *, engine: EngineChoice | None = None, world: WorldOptions | None = None,
    progress=None, on_wait=None,
) -> SelftestResult:  # fmt: skip
    """Run the plan and the P/D faults; ``progress(row)`` as each run ends."""
    start = time.perf_counter()
    world = world or WorldOptions()
    rows = run_plan(plan, engine=engine, world=world, progress=progress, on_wait=on_wait) if plan.cases or plan.rows else []
    if pd_chosen:
        rows += run_pd_selftest(pd_chosen, world=world, progress=progress, on_wait=on_wait)
    faults = plan.faults + pd_chosen
    passed, summary = verdict(rows, faults)
    return SelftestResult(passed, plan, pd_chosen, rows, summary, time.perf_counter() - start, faults)
