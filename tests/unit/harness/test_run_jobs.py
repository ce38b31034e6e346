"""``dcpsim.harness.batch.run_jobs``: several jobs in one world, each report its own."""

from __future__ import annotations

from dcpsim.harness.batch import run_jobs
from dcpsim.harness.job import Job
from helpers import builtin


def test_traffic_is_counted_per_job_when_one_world_runs_several():
    # One Collectives serves every job of a batch; each report must count only its own bytes.
    job = Job(builtin("dsv3", 2, 1))
    reports = run_jobs([job, job, job], in_process=True)
    gathered = [r.bytes_gathered for r in reports]
    assert gathered[0] > 0 and gathered == [gathered[0]] * 3
    assert [r.ranks[0]["bytes_sent"] for r in reports] == [reports[0].ranks[0]["bytes_sent"]] * 3
