"""Benchmark: what ``--trace`` costs: a run without it (the no-op recorder) and with it, in
the same process, the ranks as threads (``--in-process``, no world start to blur it) or gloo.

    python benchmarks/bench_trace.py [--scenario NAME] [--dcp W] [--repeat N] [--gloo]

Prints the best wall time of each (of N), the events recorded and the file's size.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.trace_file import Trace
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="dsv41-hybrid")
    p.add_argument("--dcp", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--gloo", action="store_true", help="gloo ranks instead of threads")
    args = p.parse_args()
    scenario = load_scenario(args.scenario).with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp))
    job = Job.from_options(scenario, in_process=not args.gloo)
    run_jobs([job])  # warm up (and start the forkserver) untimed
    path = os.path.join(tempfile.mkdtemp(prefix="dcpsim-bench-"), "trace.json")
    best = {"without --trace": float("inf"), "with --trace": float("inf")}
    events = 0
    for _ in range(args.repeat):
        for name in best:
            trace = Trace(path) if name == "with --trace" else None
            start = time.perf_counter()
            (report,) = run_jobs([job], trace=trace)
            if trace is not None:
                events = trace.write()
            best[name] = min(best[name], time.perf_counter() - start)
            assert report.passed, report.text()
    mode = "gloo" if args.gloo else "threads"
    print(f"{args.scenario} --dcp {args.dcp}, {mode}, {report.steps} steps, best of {args.repeat} (s)")
    base = best["without --trace"]
    for name, t in best.items():
        print(f"  {name:<16} {t:7.3f} s   {t / base:5.3f}x")
    print(f"  trace: {events} events, {os.path.getsize(path) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
