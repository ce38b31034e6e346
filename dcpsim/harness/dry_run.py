"""The parent's dry run of a schedule: everything validated (groups, geometry, pools) and
the whole schedule run by the reference scheduler, before any rank starts, so that a user
error ends in exit 2 and a forced preemption that never fires is one note."""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.model.plan import EventKind, PreemptReason
from dcpsim.model.scenario import Scenario


@dataclass(frozen=True)
class DryRun:
    """What the parent's dry run of a schedule found."""

    summary: dict
    """The scheduler's counters (``Scheduler.summary``)."""
    steps: int
    unfired_preemptions: tuple[tuple[str, int], ...]
    """(request id, step) of every ``preempt_at_steps`` entry that never fired: the
    request was not running at that step."""


def dry_run(scenario: Scenario, scheduler_class: type[Scheduler] = Scheduler) -> DryRun:
    """Validate everything and dry-run the schedule with the reference engine (and
    ``scheduler_class``: a P/D decode instance's loads its prompts). Always unfaulted: it
    judges the user's scenario. An injected fault acts in the ranks only, where every rank
    runs the same faulted (deterministic) scheduler, so the ranks stay in lockstep."""
    engine = ReferenceEngine()
    scheduler = scheduler_class(scenario, engine, engine.geometries(scenario.layers, scenario.config))
    fired = {
        (event.request_id, plan.step)
        for plan in scheduler.plans()
        for event in plan.events
        if event.kind is EventKind.PREEMPTED and event.reason is PreemptReason.SCENARIO
    }
    unfired = tuple((r.request_id, s) for r in scenario.requests for s in r.preempt_at_steps if (r.request_id, s) not in fired)
    return DryRun(scheduler.summary, scheduler.step_index, unfired)
