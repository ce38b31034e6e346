"""Asynchronous P/D loads into recycled blocks (built-in ``pd-async-recycled``, P/D class 8, vllm#54875)
on real gloo worlds: the reference clears new blocks and what each load did not write, and passes at
decode W = 4 and 2; a decode rank that keeps the tail of a partly filled page
(``nixl-page-tail-not-cleared``) fails the page-tail check, which names the stale entry."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.harness.pd import run_pd_batch
from dcpsim.harness.pd_job import PDJob
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.load import load_scenario
from dcpsim.verify.report import FailureKind

pytestmark = [pytest.mark.dist, pytest.mark.slow]

FAULT = "nixl-page-tail-not-cleared"


def at_decode_w(w: int):
    s = load_scenario("pd-async-recycled")
    pd = s.disaggregated
    return dataclasses.replace(
        s, disaggregated=dataclasses.replace(pd, decode=dataclasses.replace(pd.decode, decode_context_parallel_size=w))
    )


def test_async_loads_into_recycled_blocks_pass_and_a_kept_page_tail_fails_at_decode_w_4_and_2():
    scenarios = [at_decode_w(4), at_decode_w(2)]
    jobs = [PDJob(s) for s in scenarios] + [PDJob(s, inject=FAULT) for s in scenarios]
    reports = run_pd_batch(jobs, world=WorldOptions(timeout=60))
    for s, report in zip(scenarios, reports[:2]):
        assert report.passed, (report.decode.failure, report.page_tails)
        prompts = sum(r.prompt_len for r in s.requests)
        assert report.entries_sent == report.entries_written == prompts
        assert report.decode.schedule["finished"] == len(s.requests)
        assert report.decode.schedule["reused_blocks"] > 0  # the late requests load into freed blocks
    where = {4: "decode rank 2: request late-0", 2: "decode rank 0: request late-0"}
    for w, report in zip((4, 2), reports[2:]):
        assert not report.passed and report.decode.passed  # every entry the checker reads is right
        failure = report.failure
        assert failure.kind is FailureKind.PD_PAGE_TAIL, failure
        assert where[w] in failure.message and "hold stale entries, not cleared" in failure.message
        assert "of request early-" in failure.message
