"""``dcpsim.harness.runner.run_jobs``: several jobs in one world, each report its own."""

from __future__ import annotations

from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from support.helpers import builtin


def test_traffic_is_counted_per_job_when_one_world_runs_several():
    # One Collectives serves every job of a batch; each report must count only its own bytes.
    job = Job.from_options(builtin("dsv3", 2, 1))
    reports = run_jobs([job.with_options(in_process=True)] * 3)
    gathered = [r.bytes_gathered for r in reports]
    assert gathered[0] > 0 and gathered == [gathered[0]] * 3
    assert [r.ranks[0]["bytes_sent"] for r in reports] == [reports[0].ranks[0]["bytes_sent"]] * 3


def test_each_job_is_reported_as_it_ends_with_its_own_time(monkeypatch):
    import dcpsim.harness.runner as batch

    long_job, short_job = (
        Job.from_options(builtin("dsv3", 1), in_process=True),
        Job.from_options(builtin("dsv3", 1), inject="foreign-block", exchange_every=1, in_process=True),
    )  # fails at step 0
    events = []
    run_rank = batch.run_rank
    monkeypatch.setattr(batch, "run_rank", lambda job, coll, **kw: (events.append(("run", job is short_job)), run_rank(job, coll, **kw))[1])
    outcomes = batch.run_each([long_job, short_job, long_job], on_outcome=lambda k, outcome: events.append(("done", k)))
    assert events == [("run", False), ("done", 0), ("run", True), ("done", 1), ("run", False), ("done", 2)]
    assert [o.report.passed for o in outcomes] == [True, False, True]
    # measured per job, not the batch's average: one step against 35
    assert outcomes[1].seconds < outcomes[0].seconds / 5 and outcomes[1].seconds < outcomes[2].seconds / 5
