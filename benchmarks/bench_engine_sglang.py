"""Benchmark: ``run dsv3 --dcp 4`` with the reference engine and with ``--engine sglang``
(SGLang's MLA write kernels under Triton's CPU interpreter on a sample of each write, its torch
scatter on the rest, its local lengths), in the same process, on gloo.

    python benchmarks/bench_engine_sglang.py [--sglang-source DIR] [--repeat N] [--scenario NAME] [--dcp W] [--quick]
        [--launch-cache cold|warm|off]

Prints the wall time of each world and the CPU time of its busiest rank (each the best of N),
with their ratios to the reference, for the default samples of the Triton kernels
(``--sglang-write-programs 4``, ``--sglang-read-programs 1``) and, unless --quick, the
page-table builder on 4 requests a step, none (0 and 0: SGLang's torch scatter and the
reference's pages) and a larger write sample (32). Without --sglang-source it fetches SGLang
0.5.23's source into the cache (dcpsim engine fetch). ``--launch-cache``
(``launch_cache.BENCH_STATES``): ``cold`` (the default: an empty launch cache before each timed
run, what a first run of a tree pays, comparable with the figures from before the cache), ``warm``
(the cache the untimed first run filled, a repeated run) or ``off``.
"""

from __future__ import annotations

import argparse
import time

from dcpsim.engine.loading import launch_cache
from dcpsim.engine.loading.fetch import PACKAGES, fetch
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario


def variants(sc, source: str, quick: bool = False) -> dict[str, Job]:
    """The worlds timed: the reference and the defaults; unless ``quick`` the other samples."""
    sglang = dict(engine="sglang", sglang_source=source)
    out = {
        "reference": Job.from_options(sc),
        "sglang default (writes 4 tokens, reads 1 request)": Job.from_options(sc, **sglang),
    }
    if quick:
        return out
    return out | {
        "sglang, reads on 4 requests a step": Job.from_options(sc, **sglang, sglang_read_programs=4),
        "sglang, no Triton program (writes 0, reads 0)": Job.from_options(sc, **sglang, sglang_write_programs=0, sglang_read_programs=0),
        "sglang, Triton write on 32 tokens a write": Job.from_options(sc, **sglang, sglang_write_programs=32),
    }


def best_time(job: Job, repeat: int, before_each_run) -> tuple[float, float]:
    """The best wall time of the world, and the best CPU time of its busiest rank (less
    sensitive than wall time to other load on the machine)."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        before_each_run()
        start = time.perf_counter()
        (report,) = run_jobs([job.with_options(timeout=120, deadline=1800)])
        best = min(best, time.perf_counter() - start)
        assert report.passed, report.text()
        best_cpu = min(best_cpu, max((r.get("cpu_seconds", 0.0) for r in report.ranks), default=0.0))
    return best, best_cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sglang-source", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scenario", default="dsv3")
    p.add_argument("--dcp", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="only the reference and the defaults")
    p.add_argument("--launch-cache", choices=list(launch_cache.BENCH_STATES), default="cold", help="the launch cache of each timed run")
    args = p.parse_args()
    source = args.sglang_source or str(fetch(PACKAGES["sglang"]))
    sc = load_scenario(args.scenario).with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp))
    jobs = variants(sc, source, args.quick)
    before_each_run = launch_cache.for_benchmark(args.launch_cache)  # before the forkserver starts: the ranks inherit it
    run_jobs([jobs["sglang default (writes 4 tokens, reads 1 request)"]])  # start the forkserver (Triton preloaded) untimed
    times = {name: best_time(job, args.repeat, before_each_run) for name, job in jobs.items()}
    print(f"{args.scenario} --dcp {args.dcp}, gloo, best of {args.repeat} (world wall time; CPU of the busiest rank)")
    print(f"  launch cache {args.launch_cache}: {launch_cache.BENCH_STATES[args.launch_cache]}")
    base, base_cpu = times["reference"]
    for name, (t, cpu) in times.items():
        print(f"  {name:<50} {t:7.2f} s  {t / base:5.2f}x   CPU {cpu:6.2f} s  {cpu / base_cpu:5.2f}x")


if __name__ == "__main__":
    main()
