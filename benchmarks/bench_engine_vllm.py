"""Benchmark: ``run dsv3 --dcp 4`` with the reference engine and with ``--engine vllm``
(vLLM's KV cache manager in dcpsim's step loop, vLLM's v1 Scheduler driving the steps
(``--vllm-scheduler full``) or dcpsim's scheduler; both slot mapping kernels under Triton's
CPU interpreter), in the same process, on gloo; with ``--attention`` also the attention
check, with vLLM's combine wrappers and with the reference merge.

    python benchmarks/bench_engine_vllm.py [--vllm-source DIR] [--repeat N] [--scenario NAME] [--dcp W] [--attention] [--quick]
        [--launch-cache cold|warm|off]

Prints the wall time of each world (best of N) and the CPU time of its busiest rank (best of
N; less sensitive to other load on the machine), each with its ratio to the reference. Without
--vllm-source it fetches vLLM 0.33.0's source into the cache (dcpsim engine fetch).
``--launch-cache`` (``launch_cache.BENCH_STATES``): ``cold`` (the default: an empty launch cache
before each timed run, what a first run of a tree pays, comparable with the figures from before the
cache), ``warm`` (the cache the untimed first run filled, a repeated run) or ``off``.
"""

from __future__ import annotations

import argparse
import time

from dcpsim.engine.loading import forkserver, launch_cache
from dcpsim.engine.vllm.fetch import fetch
from dcpsim.errors import ConfigError
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario


def variants(sc, source: str, attention: bool, quick: bool = False) -> dict[str, Job]:
    """The worlds timed: the reference and the default (``--engine vllm``) always; unless
    ``quick`` the other runner, schedulers (a variant the tree refuses, say ``--vllm-runner v1``
    on 0.34.0, is left out with the reason printed) and, with ``attention``, the attention check."""
    vllm = dict(engine="vllm", vllm_source=source)
    out = {"reference": Job.from_options(sc), "vllm: KV cache manager, v2 kernel": Job.from_options(sc, **vllm)}
    others = {
        "vllm: KV cache manager, v1 kernel": dict(vllm_runner="v1"),
        "vllm: v1 Scheduler (full), v2 kernel": dict(vllm_scheduler="full"),
        "vllm: dcpsim scheduler, v2 kernel": dict(vllm_scheduler="dcpsim"),
    }
    for name, extra in ({} if quick else others).items():
        try:
            out[name] = Job.from_options(sc, **vllm, **extra)
        except ConfigError as exc:
            print(f"  {name}: left out ({exc})")
    if attention and not quick:
        out |= {
            "reference --attention": Job.from_options(sc, attention=True),
            "vllm --attention, reference merge": Job.from_options(sc, **vllm, attention=True, vllm_merge="reference"),
            "vllm --attention, vLLM's wrappers": Job.from_options(sc, **vllm, attention=True),
        }
    return out


def timed_run(job: Job) -> tuple[float, float]:
    """The wall time of the world, and the CPU time of its busiest rank (less sensitive than
    wall time to other load on the machine)."""
    start = time.perf_counter()
    (report,) = run_jobs([job.with_options(timeout=60, deadline=1800)])
    wall = time.perf_counter() - start
    assert report.passed, report.text()
    return wall, max((r.get("cpu_seconds", 0.0) for r in report.ranks), default=0.0)


def best_times(jobs: dict[str, Job], repeat: int, before_each_run) -> dict[str, tuple[float, float]]:
    """Each variant's best wall and CPU time; the repeats take turns over the variants, so a
    change of load on a shared machine falls on all of them alike."""
    best = {name: (float("inf"), float("inf")) for name in jobs}
    for _ in range(repeat):
        for name, job in jobs.items():
            before_each_run()
            wall, cpu = timed_run(job)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-source", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scenario", default="dsv3")
    p.add_argument("--dcp", type=int, default=4)
    p.add_argument("--attention", action="store_true", help="also time the attention check (vLLM's merge wrappers)")
    p.add_argument("--quick", action="store_true", help="only the reference and the default --engine vllm")
    p.add_argument("--launch-cache", choices=list(launch_cache.BENCH_STATES), default="cold", help="the launch cache of each timed run")
    args = p.parse_args()
    source = args.vllm_source or str(fetch())
    sc = load_scenario(args.scenario).with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp))
    jobs = variants(sc, source, args.attention, args.quick)
    before_each_run = launch_cache.for_benchmark(args.launch_cache)  # before the forkserver starts: the ranks inherit it
    # every variant's engine built once in the ranks' forkserver (its tree loaded there, not per rank), as
    # run_jobs asks for a world's own engines; then start the forkserver (Triton preloaded) untimed
    forkserver.ask([choice.forkserver_build() for choice in dict.fromkeys(j.engine for j in jobs.values()) if not choice.is_reference])
    run_jobs([jobs["vllm: KV cache manager, v2 kernel"]])
    times = best_times(jobs, args.repeat, before_each_run)
    print(f"{args.scenario} --dcp {args.dcp}, gloo, best of {args.repeat} (world wall time; CPU of the busiest rank)")
    print(f"  launch cache {args.launch_cache}: {launch_cache.BENCH_STATES[args.launch_cache]}")
    for name, (t, cpu) in times.items():
        base_name = "reference --attention" if "--attention" in name else "reference"
        base, base_cpu = times[base_name]
        print(f"  {name:<38} {t:7.2f} s  {t / base:5.2f}x   CPU {cpu:6.2f} s  {cpu / base_cpu:5.2f}x   (vs {base_name})")


if __name__ == "__main__":
    main()
