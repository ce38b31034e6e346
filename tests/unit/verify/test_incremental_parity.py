"""Mutation tests of ``--verify incremental``: every fault of the catalogue is caught the
same way (failure kind, step, group, request, index) as by ``--verify full``, on the first
case selftest runs it in (ranks as threads). The same default run is also held to the report
of one exchange a step (``test_exchange_batching``'s step queue: kind, step, place, message,
what every rank held), so each fault's default run serves both comparisons.

Twice: with the whole checker, and with the write guard switched off, so that a wrong
slot or a missing write must show where it matters to the incremental read path itself
(the write into another request's block marks that block's slot written, the request's
index is re-read).
"""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.campaigns.selftest_plan import plan_selftest
from dcpsim.engine.faults import FAULTS
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.verify.write_guard import WriteGuard

FAULT_NAMES = [n for n in FAULTS if n != "none" and FAULTS[n].expects != "hang"]
"""Every fault with a verdict (a hang fault ends in a collective timeout before any check,
the same in both modes; ``test_checker_faults`` covers it)."""
_PLAN = {}


def first_case_job(name: str) -> Job:
    """The job of the fault's first selftest case."""
    if name not in _PLAN:
        _PLAN[name] = plan_selftest([name], dry_run=False)
    plan = _PLAN[name]
    case = next(c for c in plan.cases if c.fault == name)
    scenario, fields, _ = plan.resolved[(case.scenario, case.options)]
    return Job.from_options(scenario, inject=name, **fields)


def detection(job: Job, mode: str, **options):
    (report,) = run_jobs([job.with_options(verify=mode, in_process=True, **options)])
    f = report.failure
    return report, (report.passed, f and f.kind, f and f.step, f and f.group, f and f.request_id, f and f.index)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAULT_NAMES)
def test_incremental_and_the_step_queue_catch_every_fault_as_full_and_lockstep_do(name):
    job = first_case_job(name)
    full_report, full = detection(job, "full")
    incremental_report, incremental = detection(job, "incremental")  # the default: a step queue of 16
    assert not full_report.passed, f"{name}: the full check misses its own selftest case"
    assert incremental == full
    assert job.check.exchange_every == 16, "the default run is a step queue"
    lockstep, _ = detection(job, "incremental", exchange_every=1)
    assert dataclasses.asdict(incremental_report.failure) == dataclasses.asdict(lockstep.failure)
    assert (incremental_report.steps, incremental_report.verifications, incremental_report.verified_indices) == (
        lockstep.steps,
        lockstep.verifications,
        lockstep.verified_indices,
    )
    # Under Helix the checker reads in full in both modes (verify.changes tracks vLLM's local order)
    helix = job.scenario.config.kv_cache_layout == "helix"
    assert incremental_report.verify_mode == ("full" if helix else "incremental") and full_report.verify_mode == "full"
    assert full_report.full_sweeps == full_report.verifications


@pytest.fixture
def no_write_guard(monkeypatch):
    monkeypatch.setattr(WriteGuard, "judge", lambda self, plan, writes, shapes: None)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAULT_NAMES)
def test_without_the_write_guard_the_reads_alone_agree(name, no_write_guard):
    job = first_case_job(name)
    _, full = detection(job, "full")
    _, incremental = detection(job, "incremental")
    assert incremental == full


def test_the_parity_is_not_vacuous_without_the_write_guard(no_write_guard):
    """The write-path faults the guard would name first still fail on what is read."""
    _, got = detection(first_case_job("foreign-block"), "incremental")
    assert got[:2] == (False, "wrong-content")
