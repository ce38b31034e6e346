"""Benchmark: the default grid (``matrix --dcp 2,3,4,8 --interleave 1,B``) under each real engine
against the reference engine: what an engine's CI pays to run the whole grid (issue 29: <= 4x).

    python benchmarks/bench_engine_matrix.py [--engine vllm,sglang,vllm-ascend] [--dcp LIST] [--interleave LIST]
        [--launch-cache cold|warm|off] [--vllm-source DIR] [--sglang-source DIR]
        [--vllm-ascend-source DIR] [--ascend-vllm-source DIR] [--by-scenario] [scenarios ...]

Runs the matrix (``dcpsim.matrix``, as ``python -m dcpsim matrix`` does: one world per
(scenario, W), its cells in turn) once with the reference engine, then once with each engine of
``--engine``, on gloo, one after the other. Prints, per engine:

* the wall time of the whole matrix (its plan and dry runs, every world) and its ratio to the
  reference's run of the same grid: the issue's figure;
* its cells by status (a cell the engine refuses is skipped, a cell its own code fails is a
  failure), so a ratio over fewer cells is seen as such;
* the ratio over the cells both engines passed (each cell's time: its slowest rank's, from the
  world's start to its report), which refused cells and cells that fail early cannot flatter;
* the size of the launch cache the run leaves (what a CI run would keep for the next);
* with ``--by-scenario``, that ratio per scenario, costliest first: where an engine's time goes.

Without a source option the engine's tree is fetched into the cache (``dcpsim engine fetch``):
vLLM 0.34.0, SGLang 0.5.23, vllm-ascend 0.23.0.post1 over vLLM 0.23.0. ``--launch-cache``
(``launch_cache.BENCH_STATES``): ``cold`` (the default: an empty launch cache before each engine's
run, what a CI run on a new machine or a new tree pays), ``warm`` (an untimed run of the same grid
first fills it: a repeated run) or ``off``. The engines' trees are built in the ranks' forkserver
and the forkserver is started before the timed runs, as the command line does before its first
world, so no run pays for it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from bench_engine_vllm_ascend import load_average  # the same load figures as the engine benchmarks

from dcpsim.api.matrix import MatrixOptions, matrix
from dcpsim.engine.loading import forkserver, launch_cache, launch_store
from dcpsim.engine.loading.fetch import PACKAGES, fetch
from dcpsim.engine.vllm_ascend.releases import NEWEST as ASCEND_NEWEST
from dcpsim.engine.vllm_ascend.releases import VLLM_OF
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names

ENGINES = ("vllm", "sglang", "vllm-ascend")
LIMIT = os.environ.get(launch_store.LIMIT_ENV) or 256


@dataclass(frozen=True)
class GridRun:
    """One engine's run of the grid: its wall time, and each cell's status and seconds."""

    wall: float
    cells: dict[str, tuple[str, float]]

    def count(self, status: str) -> int:
        return sum(1 for s, _ in self.cells.values() if s == status)

    def summary(self) -> str:
        return ", ".join(f"{self.count(s)} {s}" for s in ("pass", "fail", "error", "skipped") if self.count(s))


def engine_options(engine: str, args) -> dict:
    """The run options of ``engine`` (its source trees, fetched unless given)."""
    if engine == "vllm":
        return dict(engine="vllm", vllm_source=args.vllm_source or str(fetch(PACKAGES["vllm"])))
    if engine == "sglang":
        return dict(engine="sglang", sglang_source=args.sglang_source or str(fetch(PACKAGES["sglang"])))
    ascend = args.vllm_ascend_source or str(fetch(f"vllm-ascend=={ASCEND_NEWEST}"))
    vllm = args.ascend_vllm_source or str(fetch(f"vllm=={VLLM_OF[ASCEND_NEWEST]}"))
    return dict(engine="vllm-ascend", vllm_ascend_source=ascend, vllm_source=vllm)


def run_grid(args, options: dict) -> GridRun:
    """The grid's matrix under ``options``, timed; a failed or broken cell is data, not an error."""
    start = time.perf_counter()
    report = matrix(args.scenarios or None, dcp=args.dcp, interleave=args.interleave, timeout=args.timeout, **options)
    wall = time.perf_counter() - start
    return GridRun(wall, {c.id: (c.status, c.seconds) for c in report.cells})


def both_passed(base: GridRun, run: GridRun) -> list[str]:
    return [i for i, (s, _) in run.cells.items() if s == "pass" and base.cells.get(i, ("", 0))[0] == "pass"]


def common_ratio(base: GridRun, run: GridRun, cells: list[str]) -> tuple[int, float, float]:
    """(how many ``cells``, the reference's seconds over them, the engine's)."""
    return len(cells), sum(base.cells[i][1] for i in cells), sum(run.cells[i][1] for i in cells)


def by_scenario(base: GridRun, run: GridRun, scenarios: list[str]) -> list[tuple[str, int, float, float]]:
    """Per scenario (the longest name a cell id starts with), ``common_ratio`` over its cells
    both engines passed; the engine's costliest first."""
    cells: dict[str, list[str]] = {}
    for i in both_passed(base, run):
        name = max((s for s in scenarios if i.startswith(s + "-")), key=len, default=None)
        if name is not None:
            cells.setdefault(name, []).append(i)
    return sorted(((name, *common_ratio(base, run, mine)) for name, mine in cells.items()), key=lambda r: -r[3])


def folder_size(folder: str) -> tuple[int, int]:
    """(files, bytes) of the launch cache's folder."""
    sizes = [f.stat().st_size for f in Path(folder).glob("*/*") if f.is_file()]
    return len(sizes), sum(sizes)


def start_forkserver(options: list[dict]) -> None:
    """Every engine's build asked of the ranks' forkserver, which one small untimed world of a
    real engine starts, with Triton and the builds preloaded (``harness.runner``: a forkserver
    started by a reference world first would preload neither, and each rank would build its own)."""
    forkserver.ask([MatrixOptions.of(**o).engine.forkserver_build() for o in options])
    run_jobs([Job.from_options(load_scenario("dsv3"), **options[0])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", help="scenario names (default: every built-in)")
    p.add_argument("--engine", default="vllm", help=f"comma list of {', '.join(ENGINES)} (default vllm)")
    p.add_argument("--dcp", default="2,3,4,8", help="comma list of DCP sizes (default 2,3,4,8: the issue's grid)")
    p.add_argument("--interleave", default="1,B", help="comma list of interleave sizes (default 1,B)")
    p.add_argument("--launch-cache", choices=list(launch_cache.BENCH_STATES), default="cold")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--vllm-source", default=None)
    p.add_argument("--sglang-source", default=None)
    p.add_argument("--vllm-ascend-source", default=None)
    p.add_argument("--ascend-vllm-source", default=None, help="the vLLM tree vllm-ascend runs over (default vLLM 0.23.0)")
    p.add_argument("--by-scenario", action="store_true", help="also each scenario's ratio over its cells both passed")
    args = p.parse_args()
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        p.error(f"--engine: unknown engine(s) {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    args.dcp = [int(x) for x in args.dcp.split(",")]
    args.interleave = [x.strip() for x in args.interleave.split(",")]
    options = {e: engine_options(e, args) for e in engines}
    scenario_names = args.scenarios or builtin_scenario_names()
    before_each_run = launch_cache.for_benchmark(args.launch_cache)  # before the forkserver starts: the ranks inherit it
    start_forkserver(list(options.values()))
    before = load_average()
    base = run_grid(args, {})
    grid = f"--dcp {','.join(map(str, args.dcp))} --interleave {','.join(args.interleave)}"
    print(f"matrix {grid} ({args.scenarios and ' '.join(args.scenarios) or 'every built-in'}), gloo, {os.cpu_count()} CPUs")
    print(f"  launch cache {args.launch_cache}: {launch_cache.BENCH_STATES[args.launch_cache]}")
    print(f"  reference      {base.wall:7.1f} s          {base.summary()}")
    for engine, opts in options.items():
        if args.launch_cache == "warm":  # an untimed run fills the engine's own cache
            shutil.rmtree(os.environ[launch_store.FOLDER_ENV], ignore_errors=True)
            run_grid(args, opts)
        before_each_run()
        run = run_grid(args, opts)
        n, base_s, run_s = common_ratio(base, run, both_passed(base, run))
        over = f"{run_s / base_s:5.2f}x over the {n} cells both passed ({run_s:.1f} s / {base_s:.1f} s)" if n else "no cell both passed"
        print(f"  {engine:<14} {run.wall:7.1f} s {run.wall / base.wall:5.2f}x   {run.summary()}; {over}")
        if args.launch_cache != "off":
            files, size = folder_size(os.environ[launch_store.FOLDER_ENV])
            print(f"      launch cache after it: {files:,} files, {size / (1 << 20):.1f} MB (a CI cache of the grid; cap {LIMIT} MB)")
        for name, n, base_s, run_s in by_scenario(base, run, scenario_names) if args.by_scenario else ():
            print(f"      {name:<28} {run_s:6.2f} s / {base_s:5.2f} s = {run_s / base_s:5.2f}x ({n} cells)")
    print(f"load average (1, 5, 15 min): {before} before, {load_average()} after")


if __name__ == "__main__":
    main()
