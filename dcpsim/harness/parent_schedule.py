"""The parent's schedule: the reference scheduler run once by a world's launcher, its
plans replayed by every rank.

vLLM's scheduler runs once, in the engine core, and every worker receives its output. In
dcpsim each rank builds the engine's scheduler and runs it (``Engine.make_scheduler``): a
fault, a plugin or a real engine's scheduler is part of the engine under test, and every rank
must reach its decisions, and its errors, itself. The unfaulted reference engine is the
exception: its scheduler is deterministic and knows no rank, so every rank's copy makes the
same plans, and W copies of it were W times the work (up to a fifth of a rank's CPU in a
matrix world). So for such a job (``ships``) the launcher runs the scheduler once
(``parent_schedule``), writes its plans, with the scheduler's counters after each step, to the
world's directory (``parent_schedules_of``), and each rank still builds its own scheduler
(its requests, pools and admission decision) but takes the steps from the file
(``ReplayedScheduler``), loaded afresh for each run of the job. A thread world's ranks
(``--in-process``) share one copy (``shared_schedules``), its arrays made read-only.

Left to the ranks: a world of one rank (the launcher would do its one rank's work, and add
the file), a fault (``--inject``: its scheduler-side calls may keep state its write path reads),
a disaggregated instance (its connector and loads act between steps), a job with a request long
enough for the shared streams (its plans would be hundreds of megabytes), and any schedule the
launcher's run of the scheduler raised on (the ranks meet the error at its step, as before).
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass

import numpy as np

from dcpsim.harness.job import Job
from dcpsim.harness.world_dir import world_directory
from dcpsim.model.plan import StepPlan
from dcpsim.model.shared_streams import shareable

SCHEDULES_PREFIX = "dcpsim-schedules-"


@dataclass(frozen=True)
class ParentSchedule:
    """A job's whole schedule as the launcher's scheduler made it."""

    plans: tuple[StepPlan, ...]
    summaries: tuple[dict, ...]
    """The scheduler's counters (``Scheduler.summary``) before the first step, then after each."""


def ships(job: Job) -> bool:
    """Whether the launcher schedules ``job`` for its ranks (see the module's docstring)."""
    scenario = job.scenario
    return (
        job.world_size > 1
        and job.engine.is_reference
        and job.inject is None
        and scenario.disaggregated is None
        and not any(shareable(spec) for spec in scenario.requests)
    )


def parent_schedule(job: Job) -> ParentSchedule | None:
    """The job's schedule from one run of its engine's scheduler, or None if that run raised
    (a scenario that never finishes, an engine error): the ranks then schedule themselves."""
    engine = job.build_engine()
    scenario = job.scenario
    plans, summaries = [], []
    try:
        scheduler = engine.make_scheduler(scenario, engine.geometries(scenario.layers, scenario.config))
        summaries.append(scheduler.summary)
        for plan in scheduler.plans():
            plans.append(plan)
            summaries.append(scheduler.summary)
    except Exception:  # the ranks run into it themselves, at its step
        return None
    return ParentSchedule(tuple(plans), tuple(summaries))


ScheduleLoader = Callable[[], ParentSchedule]
"""What a rank calls for its job's schedule (once for each run of the job)."""


def schedule_file(directory: str | None, k: int) -> str | None:
    """Where job ``k``'s schedule is in ``directory``, or None if the launcher left it to the ranks."""
    if directory is None:
        return None
    path = os.path.join(directory, f"{k}.pickle")
    return path if os.path.exists(path) else None


def file_loaders(directory: str | None, jobs: int) -> list[ScheduleLoader | None]:
    """A gloo rank's loaders of the ``jobs`` schedules in ``directory`` (None: left to the rank)."""
    paths = [schedule_file(directory, k) for k in range(jobs)]
    return [None if path is None else functools.partial(load_schedule, path) for path in paths]


def shared_schedules(jobs: list[Job]) -> list[ScheduleLoader | None]:
    """A thread world's loaders: one read-only schedule per job that ``ships``, for every rank."""
    out: list[ScheduleLoader | None] = []
    for job in jobs:
        schedule = parent_schedule(job) if ships(job) else None
        out.append(None if schedule is None else functools.partial(_same, _frozen(schedule)))
    return out


def _same(schedule: ParentSchedule) -> ParentSchedule:
    return schedule


def _frozen(value):
    """``value`` with every array inside it (plans, their writes and views, rows) made read-only,
    so that a rank that wrote into its plans would fail loudly instead of changing its peers'."""
    if isinstance(value, np.ndarray):
        value.setflags(write=False)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _frozen(item)
    elif isinstance(value, dict):
        for item in value.values():
            _frozen(item)
    elif is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            _frozen(getattr(value, f.name))
    return value


@contextmanager
def parent_schedules_of(jobs: list[Job]):
    """A temp directory (``harness.world_dir``) with the schedule of every job that ``ships``,
    as ``{k}.pickle``, removed when the world is done; None if no job ships."""
    if not any(map(ships, jobs)):
        yield None
        return
    with world_directory(SCHEDULES_PREFIX) as directory:
        for k, job in enumerate(jobs):
            schedule = parent_schedule(job) if ships(job) else None
            if schedule is not None:
                with open(os.path.join(directory, f"{k}.pickle"), "wb") as out:
                    pickle.dump(schedule, out, protocol=pickle.HIGHEST_PROTOCOL)
        yield directory


def load_schedule(path: str) -> ParentSchedule:
    """A schedule ``parent_schedules_of`` wrote (a fresh copy each call: a run may change its plans' arrays)."""
    with open(path, "rb") as f:
        return pickle.load(f)


class ReplayedScheduler:
    """A rank's scheduler (``scheduler``, as ``Engine.make_scheduler`` built it: its requests,
    pools and admission decision) whose steps are the launcher's ``schedule``; ``step_index``
    and ``summary`` as the scheduler's own would be after each step."""

    def __init__(self, scheduler, schedule: ParentSchedule) -> None:
        self.requests = scheduler.requests
        self.pool_sizes = scheduler.pool_sizes
        self.admission_decided = getattr(scheduler, "admission_decided", False)
        self.admission_limit = getattr(scheduler, "admission_limit", None)
        self.schedule = schedule
        self.step_index = 0

    @property
    def summary(self) -> dict:
        return dict(self.schedule.summaries[self.step_index])

    def plans(self) -> Iterator[StepPlan]:
        for plan in self.schedule.plans:
            self.step_index = plan.step + 1
            yield plan
