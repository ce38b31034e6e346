"""Many ``dcpsim.run`` calls in few worlds: each call's ``Job`` built as ``dcpsim.run`` builds it
(its ``ConfigError`` raised then, before any rank starts), then the jobs of one W run in turn in
one world (``run_jobs``), so a tree's engine is built once per rank rather than once per run.
Each job's report is the one ``dcpsim.run`` would give (``Report.of`` its merged report)."""

from __future__ import annotations

import dataclasses

from dcpsim.api.report import Report
from dcpsim.api.run import ALIASES
from dcpsim.harness.job import Job
from dcpsim.harness.launch import JOB_KEYS, SCENARIO_KEYS, resolve_scenario
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.options import from_flat


def job_of(scenario, **options) -> Job:
    """The ``Job`` ``dcpsim.run(scenario, **options)`` runs (the short names ``dcp``, ``tp``, ... too)."""
    options = {ALIASES.get(k, k): v for k, v in options.items()}
    unknown = set(options) - set(SCENARIO_KEYS) - set(JOB_KEYS)
    assert not unknown, unknown
    overrides = from_flat(ScenarioOverrides, {k: v for k, v in options.items() if k in SCENARIO_KEYS})
    return Job.from_options(resolve_scenario(scenario, overrides), **{k: v for k, v in options.items() if k in JOB_KEYS})


def run_batched(jobs: list[Job]) -> list[Report]:
    """Every job's report, in order: one world per (W, world options), its jobs in turn. A world
    without a ``deadline`` gets the sum of its jobs' own (as many worlds of one job each had)."""
    groups: dict[tuple, list[int]] = {}
    for k, job in enumerate(jobs):
        groups.setdefault((job.world_size, job.world), []).append(k)
    reports: list[Report | None] = [None] * len(jobs)
    for (_, world), ks in groups.items():
        batch = [jobs[k] for k in ks]
        if world.deadline is None and len(ks) > 1:
            world = dataclasses.replace(world, deadline=len(ks) * world.deadline_for(1))
            batch = [dataclasses.replace(job, world=world) for job in batch]
        for k, report in zip(ks, run_jobs(batch)):
            reports[k] = Report.of(report)
    return reports
