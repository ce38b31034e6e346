"""The checker's step queue (``Job.exchange_every``): every step is still read and judged as
of its own state, only the rows travel together; a failure at a step older than the
newest queued one has the run redone in lockstep. So every fault of the catalogue must
end in exactly the report one exchange a step gives (kind, step, place, message, what
every rank held), on the first case selftest runs it in (ranks as threads): that comparison is
``test_incremental_parity``'s, whose default run is the step queue's."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.errors import ConfigError
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.scenarios.load import load_scenario
from dcpsim.verify.check import Checker, StaleFailure
from tests.unit.verify.test_incremental_parity import first_case_job


def run(job: Job, every: int):
    (report,) = run_jobs([job.with_options(exchange_every=every, in_process=True)])
    return report


def failure_record(report) -> dict | None:
    return None if report.failure is None else dataclasses.asdict(report.failure)


@pytest.fixture
def exchanges(monkeypatch):
    """Counts ``Checker.exchange`` calls and the queued steps each one carried, and the
    stale failures raised (each redoes the run in lockstep)."""
    seen = {"calls": [], "stale": 0}
    real = Checker.exchange

    def counting(self, metadata=False):
        seen["calls"].append(self.pending)
        try:
            return real(self, metadata)
        except StaleFailure:
            seen["stale"] += 1
            raise

    monkeypatch.setattr(Checker, "exchange", counting)
    return seen


def test_a_passing_run_exchanges_once_per_queue_and_at_the_last_step(exchanges):
    job = Job.from_options(load_scenario("dsv3"))
    lockstep = run(job, 1)
    lockstep_calls = len(exchanges["calls"])
    exchanges["calls"].clear()
    queued = run(job, 8)
    assert queued.passed and lockstep.passed
    assert (queued.verifications, queued.verified_indices, queued.full_sweeps) == (
        lockstep.verifications,
        lockstep.verified_indices,
        lockstep.full_sweeps,
    )
    calls = exchanges["calls"]  # two ranks (threads), each exchanging in turn
    per_rank = len(calls) // 2
    assert lockstep_calls == 2 * lockstep.verifications
    assert per_rank == -(-queued.verifications // 8)
    assert sorted(calls)[-1] == 8 and sum(calls) == 2 * queued.verifications


def test_a_failure_inside_a_queue_is_reported_after_a_lockstep_rerun(exchanges):
    """A fault that fails at step 0 of a run that goes on: the one exchange (at the 16th
    step) finds step 0 stale, and the lockstep rerun reports it there with its details."""
    job = first_case_job("interleave-off-by-one")
    lockstep = run(job, 1)
    assert lockstep.failure.step == 0 and lockstep.failure.holdings
    exchanges["stale"] = 0
    queued = run(job, 16)
    assert exchanges["stale"] == 2  # both ranks (threads) found it, each reran
    assert failure_record(queued) == failure_record(lockstep)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8"])
def test_exchange_every_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match="exchange_every"):
        Job.from_options(load_scenario("dsv3"), exchange_every=bad)
