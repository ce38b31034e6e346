"""``run_jobs`` / ``run_each`` on real gloo worlds: each job is reported by the ranks as it
ends, so a broken world reruns only the jobs it did not finish."""

from __future__ import annotations

import pytest

import dcpsim.harness.runner as runner
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_each, run_jobs
from support.helpers import builtin

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_the_ranks_report_each_job_before_the_world_ends(monkeypatch):
    ended = []
    run_world = runner.run_world

    def recording(*args, **kw):
        out = run_world(*args, **kw)
        ended.append("world")
        return out

    monkeypatch.setattr(runner, "run_world", recording)
    jobs = [Job.from_options(builtin("dsv3", 2)), Job.from_options(builtin("dsv3", 2, 16), inject="interleave-off-by-one")]
    seen = []
    reports = run_jobs(jobs, on_job=lambda k, report, seconds: seen.append((k, report.passed, len(report.ranks), ended[:])))
    assert seen == [(0, True, 2, []), (1, False, 2, [])], "both jobs reported while the world still ran"
    assert [r.passed for r in reports] == [True, False]


def test_a_broken_world_reruns_only_the_jobs_it_did_not_finish(monkeypatch):
    worlds = []
    run_world = runner.run_world
    # a[1]: (jobs, trace origin)
    monkeypatch.setattr(runner, "run_world", lambda *a, **kw: (worlds.append(len(a[1][0])), run_world(*a, **kw))[1])
    ok = Job.from_options(builtin("dsv3", 2))
    broken = Job.from_options(builtin("dsv3", 2), rank_failure=("raise", 1, 2))
    order = []
    outcomes = run_each([j.with_options(timeout=10) for j in (ok, broken, ok)], on_outcome=lambda k, o: order.append(k))
    assert worlds == [3, 1, 1], "the batch, then the two jobs it did not finish, each alone"
    assert order == [0, 1, 2]
    assert outcomes[0].report.passed and outcomes[2].report.passed
    assert outcomes[1].report is None and "simulated failure of rank 1 at step 2" in str(outcomes[1].error)
