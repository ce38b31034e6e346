"""Benchmark: ``run dsv3 --dcp 4`` with the reference engine and with ``--engine vllm-ascend``
(vllm-ascend 0.23.0.post1's slot mapping, local lengths and verify mask in plain torch, over vLLM
0.23.0's KV cache manager with the plugin's coordinator in dcpsim's step loop, or over dcpsim's
scheduler), beside ``--engine vllm`` on the same vLLM 0.23.0 tree, in the same process, on gloo;
with ``--attention`` also the attention check, with the plugin's merge (its all-to-all and combine).

    python benchmarks/bench_engine_vllm_ascend.py [--vllm-ascend-source DIR] [--vllm-source DIR]
        [--repeat N] [--scenario NAME] [--dcp W] [--attention] [--launch-cache cold|warm|off]

Prints the wall time of each world (best of N) and the CPU time of its busiest rank (best of
N; less sensitive to other load on the machine), each with its ratio to the reference, and the
load average before and after. Without --vllm-ascend-source (--vllm-source) it fetches
vllm-ascend 0.23.0.post1 (vLLM 0.23.0, the release it runs on) into the cache (dcpsim engine fetch).
``--launch-cache``: as bench_engine_vllm's (default ``cold``, an empty launch cache before each timed run).
"""

from __future__ import annotations

import argparse
import os

from bench_engine_vllm import best_times  # the same timing: best of N, the variants taking turns

from dcpsim.engine.loading import forkserver, launch_cache
from dcpsim.engine.loading.fetch import fetch
from dcpsim.engine.vllm_ascend.releases import NEWEST, VLLM_OF
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario

DEFAULT = "vllm-ascend: KV cache manager (default)"


def variants(sc, ascend: str, vllm: str, attention: bool) -> dict[str, Job]:
    plugin = dict(engine="vllm-ascend", vllm_ascend_source=ascend, vllm_source=vllm)
    out = {
        "reference": Job.from_options(sc),
        DEFAULT: Job.from_options(sc, **plugin),
        "vllm-ascend: dcpsim scheduler": Job.from_options(sc, **plugin, vllm_scheduler="dcpsim"),
        "vllm 0.23.0: KV cache manager, v2 kernel": Job.from_options(sc, engine="vllm", vllm_source=vllm),
    }
    if attention:
        out |= {
            "reference --attention": Job.from_options(sc, attention=True),
            "vllm-ascend --attention (its merge)": Job.from_options(sc, **plugin, attention=True),
        }
    return out


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-ascend-source", default=None)
    p.add_argument("--vllm-source", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scenario", default="dsv3")
    p.add_argument("--dcp", type=int, default=4)
    p.add_argument("--attention", action="store_true", help="also time the attention check (the plugin's merge)")
    p.add_argument("--launch-cache", choices=list(launch_cache.BENCH_STATES), default="cold", help="the launch cache of each timed run")
    args = p.parse_args()
    ascend = args.vllm_ascend_source or str(fetch(f"vllm-ascend=={NEWEST}"))
    vllm = args.vllm_source or str(fetch(f"vllm=={VLLM_OF[NEWEST]}"))
    sc = load_scenario(args.scenario).with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp))
    jobs = variants(sc, ascend, vllm, args.attention)
    before_each_run = launch_cache.for_benchmark(args.launch_cache)  # before the forkserver starts: the ranks inherit it
    # every variant's engine built once in the ranks' forkserver (its trees loaded there, not per rank), as
    # run_jobs asks for a world's own engines; then start the forkserver (Triton preloaded) untimed
    forkserver.ask([choice.forkserver_build() for choice in dict.fromkeys(j.engine for j in jobs.values()) if not choice.is_reference])
    run_jobs([jobs[DEFAULT]])
    before = load_average()
    times = best_times(jobs, args.repeat, before_each_run)
    print(f"{args.scenario} --dcp {args.dcp}, gloo, best of {args.repeat} (world wall time; CPU of the busiest rank)")
    print(f"  launch cache {args.launch_cache}: {launch_cache.BENCH_STATES[args.launch_cache]}")
    for name, (t, cpu) in times.items():
        base_name = "reference --attention" if "--attention" in name else "reference"
        base, base_cpu = times[base_name]
        print(f"  {name:<42} {t:7.2f} s  {t / base:5.2f}x   CPU {cpu:6.2f} s  {cpu / base_cpu:5.2f}x   (vs {base_name})")
    print(f"load average (1, 5, 15 min): {before} before, {load_average()} after")


if __name__ == "__main__":
    main()
