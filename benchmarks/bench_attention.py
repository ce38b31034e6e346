"""Benchmark: what the attention check (``--attention``) costs each rank of a built-in.

Runs ``SCENARIO --dcp W`` on a gloo world with and without ``--attention``, taking turns, and
prints each variant's best (of ``--repeat``) CPU seconds: rank 0, the busiest rank and all ranks,
and the world's wall time; then the attention check's own share (the difference). CPU figures
move less than wall time with other load on the machine; compare two checkouts by running this
script from each, back to back (``cd OLD && PYTHONPATH=OLD python THIS_FILE ...``: the ranks
import ``dcpsim`` from the working directory first). Run:

    python benchmarks/bench_attention.py [--scenario dsv3] [--dcp 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time

from dcpsim.harness.world import RANK_PRELOAD, start_forkserver

if __name__ == "__main__":
    start_forkserver((RANK_PRELOAD,))

from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario


def run_once(job: Job) -> tuple[list[float], float, object]:
    """Each rank's CPU seconds, the world's wall time, and the report."""
    start = time.perf_counter()
    (report,) = run_jobs([job])
    wall = time.perf_counter() - start
    assert report.passed, report.text()
    return [float(r.get("cpu_seconds", 0.0)) for r in report.ranks], wall, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="dsv3", help="a built-in (default dsv3)")
    parser.add_argument("--dcp", type=int, default=4, help="W (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant, taking turns (default 3)")
    args = parser.parse_args()
    sc = load_scenario(args.scenario).with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp))
    jobs = {
        "without": Job.from_options(sc, timeout=120, deadline=1800),
        "--attention": Job.from_options(sc, attention=True, timeout=120, deadline=1800),
    }
    load = os.getloadavg()[0]
    best: dict[str, tuple[list[float], float]] = {}
    report = None
    for _ in range(args.repeat):
        for name, job in jobs.items():
            cpu, wall, rep = run_once(job)
            if name not in best or sum(cpu) < sum(best[name][0]):
                best[name] = (cpu, wall)
            report = rep if name == "--attention" else report
    print(f"{args.scenario} --dcp {args.dcp}, gloo, best of {args.repeat} (by all ranks' CPU); load average {load:.1f} at the start")
    for name, (cpu, wall) in best.items():
        print(f"  {name:12s} CPU rank 0 {cpu[0]:.2f} s, busiest {max(cpu):.2f} s, all ranks {sum(cpu):.2f} s; world {wall:.2f} s")
    (a, _), (b, _) = best["--attention"], best["without"]
    print(f"  the check's share: rank 0 {a[0] - b[0]:.2f} s, busiest rank {max(a) - max(b):.2f} s, all ranks {sum(a) - sum(b):.2f} s")
    checks, tokens, error = report.attention_checks, report.attention_query_tokens, report.attention_max_error
    print(f"  {checks} attention checks, {tokens} query tokens, max error {error:.2g}")


if __name__ == "__main__":
    main()
