"""PCP x TP x DCP on real gloo worlds: every combination vLLM 0.33.0 allows with at most 8
processes passes (all combinations of one world size share a world), the rank-local gather
plan of vllm#53573 ends as a collective hang naming the rank (exit 3), and the built-in runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from support.helpers import allowed_parallel_sizes, pcp_scenario

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BY_WORLD: dict[int, list[tuple[int, int, int]]] = {}
for sizes in allowed_parallel_sizes(8):
    BY_WORLD.setdefault(sizes[0] * sizes[1], []).append(sizes)


@pytest.mark.parametrize("world", sorted(BY_WORLD))
def test_every_allowed_combination_passes(world):
    combos = BY_WORLD[world]
    reports = run_jobs([Job.from_options(pcp_scenario(*c), timeout=60) for c in combos])
    for (pcp, tp, dcp), report in zip(combos, reports):
        assert report.passed, ((pcp, tp, dcp), report.failure and report.failure.lines())
        assert report.dcp_size == dcp and report.prefill_context_parallel_size == pcp
        assert len(report.ranks) == world
        assert report.schedule["finished"] == report.schedule["requests"] == 3
        if world > dcp or pcp > 1:  # each rank says where it sits
            assert [(r["pcp_rank"], r["tp_rank"]) for r in report.ranks] == [divmod(k, tp) for k in range(world)]
            assert len({r["dcp_group"] for r in report.ranks}) == world // dcp


def test_a_rank_that_skips_the_pcp_gather_is_named_in_a_collective_hang():
    proc = subprocess.run(
        [sys.executable, "-m", "dcpsim", "run", "glm-pcp2-dcp2", "--inject", "pcp-gather-rank-local", "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 3, proc.stderr
    assert (
        "dcpsim: error: collective hang in a world of 2 ranks: rank 0 skipped a collective: ran ahead to step 9 "
        "(verify) while rank 1 waited at step 9 (pcp kv gather); every rank then timed out"
    ) in proc.stderr


def test_the_pcp_builtin_passes_at_its_own_sizes_and_at_pcp8():
    from dcpsim.scenarios.load import load_scenario

    base = load_scenario("glm-pcp2-dcp2")
    jobs = [
        Job.from_options(base, timeout=60),
        Job.from_options(base.with_overrides(ScenarioOverrides(decode_context_parallel_size=1)), timeout=60),
    ]  # both worlds of 2
    for report in run_jobs(jobs):
        assert report.passed, report.failure and report.failure.lines()
    pcp8 = base.with_overrides(ScenarioOverrides(prefill_context_parallel_size=8, decode_context_parallel_size=1))
    (report,) = run_jobs([Job.from_options(pcp8, timeout=60)])
    assert report.passed and len(report.ranks) == 8


@pytest.mark.slow
def test_attention_merges_over_a_dcp_group_whose_ranks_are_not_in_world_order():
    """DCP over the (PCP, TP) grid (PCP 2, TP 2, DCP 4): the DCP group lists world ranks 0, 2,
    1, 3 while torch.distributed numbers its processes 0, 1, 2, 3 by world rank. Every
    collective must speak in DCP ranks (GlooCollectives reorders), or the merge weighs rank
    1's output by rank 2's factor: the LSE still matches, the output does not. Both merge
    variants (alternating), both LSE bases."""
    for base in ("e", "2"):
        job = Job.from_options(pcp_scenario(2, 2, 4), attention=True, lse_base=base, timeout=60)
        (report,) = run_jobs([job])
        assert report.passed, report.failure and report.failure.lines()
        assert report.attention_checks > 0 and report.attention_merges["alltoall"] > 0 and report.attention_merges["allgather"] > 0
