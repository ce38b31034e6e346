"""Benchmark: ``run dsv3 --dcp 4`` with the reference engine and with ``--engine vllm``
(both slot mapping kernels, under Triton's CPU interpreter), in the same process, on gloo.

    python benchmarks/bench_engine_vllm.py [--vllm-source DIR] [--repeat N] [--scenario NAME]

Prints the wall time of each world (best of N) and the ratio to the reference. Without
--vllm-source it fetches vLLM 0.33.0's source into the cache (dcpsim engine fetch).
"""

from __future__ import annotations

import argparse
import time

from dcpsim.engine.vllm.fetch import fetch
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-source", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scenario", default="dsv3")
    p.add_argument("--dcp", type=int, default=4)
    args = p.parse_args()
    source = args.vllm_source or str(fetch())
    sc = load_scenario(args.scenario).with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp))
    variants = {
        "reference": Job.from_options(sc),
        "vllm (runner v2 kernel)": Job.from_options(sc, engine="vllm", vllm_source=source, vllm_runner="v2"),
        "vllm (runner v1 kernel)": Job.from_options(sc, engine="vllm", vllm_source=source, vllm_runner="v1"),
    }
    run_jobs([variants["vllm (runner v2 kernel)"]])  # start the forkserver (Triton preloaded) untimed
    times = {}
    for name, job in variants.items():
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            (report,) = run_jobs([job.with_options(timeout=60)])
            best = min(best, time.perf_counter() - start)
            assert report.passed, report.text()
        times[name] = best
    print(f"{args.scenario} --dcp {args.dcp}, gloo, best of {args.repeat} (world wall time, s)")
    for name, t in times.items():
        print(f"  {name:<26} {t:7.2f} s   {t / times['reference']:5.2f}x reference")


if __name__ == "__main__":
    main()
