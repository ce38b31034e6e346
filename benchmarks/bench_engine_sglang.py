"""Benchmark: ``run dsv3 --dcp 4`` with the reference engine and with ``--engine sglang``
(SGLang's MLA write kernels under Triton's CPU interpreter on a sample of each write, its torch
scatter on the rest, its local lengths), in the same process, on gloo.

    python benchmarks/bench_engine_sglang.py [--sglang-source DIR] [--repeat N] [--scenario NAME] [--dcp W]

Prints the wall time of each world (best of N) and the ratio to the reference, for the default
samples of the Triton kernels (``--sglang-write-programs 4``, ``--sglang-read-programs 1``), the
page-table builder on 4 requests a step, none (0 and 0: SGLang's torch scatter and the
reference's pages) and a larger write sample (32). Without --sglang-source it fetches SGLang 0.5.23's source into the
cache (dcpsim engine fetch).
"""

from __future__ import annotations

import argparse
import time

from dcpsim.engine.loading.fetch import PACKAGES, fetch
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario


def variants(sc, source: str) -> dict[str, Job]:
    sglang = dict(engine="sglang", sglang_source=source)
    return {
        "reference": Job.from_options(sc),
        "sglang default (writes 4 tokens, reads 1 request)": Job.from_options(sc, **sglang),
        "sglang, reads on 4 requests a step": Job.from_options(sc, **sglang, sglang_read_programs=4),
        "sglang, no Triton program (writes 0, reads 0)": Job.from_options(sc, **sglang, sglang_write_programs=0, sglang_read_programs=0),
        "sglang, Triton write on 32 tokens a write": Job.from_options(sc, **sglang, sglang_write_programs=32),
    }


def best_time(job: Job, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        (report,) = run_jobs([job.with_options(timeout=120, deadline=1800)])
        best = min(best, time.perf_counter() - start)
        assert report.passed, report.text()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sglang-source", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scenario", default="dsv3")
    p.add_argument("--dcp", type=int, default=4)
    args = p.parse_args()
    source = args.sglang_source or str(fetch(PACKAGES["sglang"]))
    sc = load_scenario(args.scenario).with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp))
    jobs = variants(sc, source)
    run_jobs([jobs["sglang default (writes 4 tokens, reads 1 request)"]])  # start the forkserver (Triton preloaded) untimed
    times = {name: best_time(job, args.repeat) for name, job in jobs.items()}
    print(f"{args.scenario} --dcp {args.dcp}, gloo, best of {args.repeat} (world wall time, s)")
    for name, t in times.items():
        print(f"  {name:<44} {t:7.2f} s   {t / times['reference']:5.2f}x reference")


if __name__ == "__main__":
    main()
