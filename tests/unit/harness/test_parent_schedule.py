"""The launcher's schedules (``harness.parent_schedule``): which jobs the launcher schedules for
its ranks, a replayed scheduler that says what the rank's own would say after every step, gloo
worlds whose ranks take their steps from the launcher's file and judge them as they judge their own
scheduler's, and the schedule left to the ranks wherever the launcher's run of it raised."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from dcpsim.harness import parent_schedule as ps
from dcpsim.harness import world_dir
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from support.helpers import builtin, scheduler

pytestmark = pytest.mark.dist


def test_which_jobs_the_launcher_schedules():
    job = Job.from_options(builtin("dsv3", 2))
    assert ps.ships(job)
    assert not ps.ships(Job.from_options(builtin("dsv3", 1)))  # one rank: nothing to save, a file to add
    assert not ps.ships(Job.from_options(builtin("dsv3", 2), inject="foreign-block"))  # a fault's scheduler stays in the ranks
    assert not ps.ships(Job.from_options(builtin("pd-dsv3", 2)))  # a disaggregated run's instances load between steps
    assert not ps.ships(Job.from_options(builtin("long-context-256k", 2)))  # plans of 256K tokens: megabytes a cell


@pytest.mark.parametrize("name", ["heavy-rejection", "prefix-preemption", "prefix-sharing", "dsv41-hybrid"])
def test_a_replayed_scheduler_says_what_the_ranks_own_would_say_after_every_step(name):
    scenario = builtin(name, 2)
    schedule = ps.parent_schedule(Job.from_options(scenario))
    own = scheduler(scenario)
    replayed = ps.ReplayedScheduler(scheduler(scenario), schedule)
    assert replayed.summary == own.summary and replayed.step_index == own.step_index == 0
    assert replayed.pool_sizes == own.pool_sizes and [r.request_id for r in replayed.requests] == [r.request_id for r in own.requests]
    steps = 0
    for mine, theirs in zip(own.plans(), replayed.plans(), strict=True):
        assert mine.step == theirs.step and len(mine.writes) == len(theirs.writes)
        assert all(np.array_equal(a.contents, b.contents) for a, b in zip(mine.writes, theirs.writes))
        assert (replayed.step_index, replayed.summary) == (own.step_index, own.summary)
        steps += 1
    assert steps == own.step_index > 0 and replayed.summary == own.summary


def test_the_launcher_leaves_a_schedule_that_raises_to_the_ranks(tmp_path, monkeypatch):
    stuck = dataclasses.replace(builtin("many-short", 2), max_steps=3)
    assert ps.parent_schedule(Job.from_options(stuck)) is None  # the ranks meet "did not finish" themselves
    monkeypatch.setattr(world_dir, "SHARED_MEMORY", str(tmp_path))
    with ps.parent_schedules_of([Job.from_options(stuck), Job.from_options(builtin("many-short", 2))]) as directory:
        assert ps.schedule_file(directory, 0) is None and ps.schedule_file(directory, 1) is not None
    assert list(tmp_path.iterdir()) == []  # removed with the world
    with ps.parent_schedules_of([Job.from_options(builtin("dsv3", 2), inject="foreign-block")]) as directory:
        assert directory is None  # no job ships: no directory


def _figures(report):
    return (report.passed, report.steps, report.verifications, report.verified_indices, report.metadata_checks, report.schedule)


@pytest.mark.parametrize("name", ["heavy-rejection", "prefix-preemption", "prefix-sharing"])
def test_a_world_judges_the_launchers_schedule_as_its_own(monkeypatch, name):
    jobs = [Job.from_options(builtin(name, 2)), Job.from_options(builtin(name, 2), inject="foreign-block")]
    written = []
    schedule_of = ps.parent_schedule
    monkeypatch.setattr(ps, "parent_schedule", lambda job: (written.append(job), schedule_of(job))[1])
    shipped = run_jobs(jobs)
    assert written == jobs[:1]  # the fault's job scheduled by its ranks
    monkeypatch.setattr(ps, "ships", lambda job: False)
    own = run_jobs(jobs)
    assert _figures(shipped[0]) == _figures(own[0]) and shipped[0].passed
    verdict = [(r.passed, r.failure.kind, r.failure.step) for r in (shipped[1], own[1])]
    assert verdict[0] == verdict[1]


def test_the_ranks_take_their_steps_from_the_launchers_file(monkeypatch):
    """A schedule changed in the launcher (one write's content) makes the world fail: the ranks
    wrote what the file said, and the checker, which derives its expectation from the scenario,
    read it."""
    job = Job.from_options(builtin("dsv3", 2))
    schedule_of = ps.parent_schedule

    def tampered(job):
        schedule = schedule_of(job)
        plan = schedule.plans[3]
        plan.writes[0].contents[-1] += 1
        return schedule

    monkeypatch.setattr(ps, "parent_schedule", tampered)
    (report,) = run_jobs([job])
    assert not report.passed and report.failure.step == 3
    assert not [p for p in os.listdir(world_dir.SHARED_MEMORY) if p.startswith(f"{ps.SCHEDULES_PREFIX}{os.getpid()}-")]


def test_a_thread_worlds_ranks_share_one_read_only_schedule(monkeypatch):
    """``--in-process``: the launcher's schedule is one object for every rank, its arrays
    read-only; a change made to it in the launcher fails the run as in a gloo world."""
    job = Job.from_options(builtin("heavy-rejection", 2), in_process=True)
    (loader,) = ps.shared_schedules([job])
    schedule = loader()
    assert loader() is schedule
    with pytest.raises(ValueError, match="read-only"):
        schedule.plans[0].writes[0].contents[0] = 0
    (shared,) = run_jobs([job])
    monkeypatch.setattr(ps, "ships", lambda job: False)
    (own,) = run_jobs([job])
    assert _figures(shared) == _figures(own) and shared.passed
    monkeypatch.undo()
    schedule_of = ps.parent_schedule

    def tampered(job):
        schedule = schedule_of(job)
        schedule.plans[2].writes[0].contents[0] += 1
        return schedule

    monkeypatch.setattr(ps, "parent_schedule", tampered)
    (report,) = run_jobs([job])
    assert not report.passed and report.failure.step == 2
