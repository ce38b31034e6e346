"""Benchmark: what the full correctness matrix costs, and where one world's time goes.

Builds the full grid (``matrix --full``), counts its work: valid cells, steps and rank-steps
(W x steps summed over the cells, from the parent's dry runs), then runs the cells of one
world (``--scenario``, ``--dcp``: one scenario and W, at most ``--cells`` of them) on a gloo
world and prints the world's wall time, each rank's CPU time, the CPU per rank-step, and the
projection of that figure to the whole matrix on this machine's cores, and the scheduling the
ranks asked for (``DCPSIM_RANK_SLICE_MS``: compare figures taken with the same). ``--profile`` also
prints rank 0's top functions (cProfile, CPU clock). Run:

    python benchmarks/bench_matrix.py --scenario dsv3 --dcp 8 [--profile --sort tottime]
"""

from __future__ import annotations

import argparse
import os
import time

T0 = time.perf_counter()
from dcpsim.harness.world import start_forkserver  # noqa: E402

if __name__ == "__main__":
    start_forkserver(("dcpsim.harness.runner",))

from dcpsim.campaigns.grid import full_grid  # noqa: E402
from dcpsim.campaigns.matrix import CellStatus  # noqa: E402
from dcpsim.harness.dry_run import dry_run  # noqa: E402
from dcpsim.harness.job import Job  # noqa: E402
from dcpsim.harness.rank_sched import ENV as SLICE_ENV  # noqa: E402
from dcpsim.harness.rank_sched import rank_slice_ms  # noqa: E402
from dcpsim.scenarios.registry import builtin_scenario_names  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="dsv3", help="the world's built-in (default dsv3)")
    parser.add_argument("--dcp", type=int, default=8, help="the world's W (default 8)")
    parser.add_argument("--cells", type=int, default=12, help="at most this many of its cells (default 12: a work unit)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--profile", action="store_true", help="print rank 0's cProfile top functions")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--callers", metavar="REGEX")
    parser.add_argument("--profile-out", metavar="FILE")
    args = parser.parse_args()

    start = time.perf_counter()
    cells = full_grid(builtin_scenario_names())
    grid_s = time.perf_counter() - start
    valid = [c for c in cells if c.status == CellStatus.PENDING]
    start = time.perf_counter()
    steps = {id(c): dry_run(c.scenario).steps for c in valid}
    dry_s = time.perf_counter() - start

    def ranks(c) -> int:
        cfg = c.scenario.config
        return cfg.decode_context_parallel_size * (cfg.prefill_context_parallel_size or 1)

    rank_steps = sum(ranks(c) * steps[id(c)] for c in valid)
    print(
        f"full matrix: {len(cells):,} cells, {len(valid):,} valid; {sum(steps.values()):,} steps, "
        f"{rank_steps:,} rank-steps (grid {grid_s:.1f} s, dry runs {dry_s:.1f} s)"
    )

    world = [c for c in valid if c.cell.scenario == args.scenario and c.cell.dcp == args.dcp and c.cell.pcp is None][: args.cells]
    if not world:
        parser.error(f"no valid cell of {args.scenario} at W = {args.dcp}")
    jobs = [Job.from_options(c.scenario, timeout=args.timeout, deadline=4 * args.timeout) for c in world]
    load = os.getloadavg()[0]
    start, launcher_start = time.perf_counter(), time.process_time()
    if args.profile:
        from bench_verify import profiled

        reports = profiled(jobs, args.timeout, args.top, args.sort, args.callers, args.profile_out)
    else:
        from dcpsim.harness.runner import run_jobs

        reports = run_jobs(jobs)
    wall, launcher = time.perf_counter() - start, time.process_time() - launcher_start
    failed = [c.cell.id for c, r in zip(world, reports) if not r.passed]
    world_steps = sum(r.steps for r in reports)
    cpu = [r["cpu_seconds"] for r in reports[-1].ranks]  # since each rank's process started
    per_rank_step = (sum(cpu) + launcher) / (world_steps * len(cpu))  # the launcher's schedules counted in
    cores = os.cpu_count() or 1
    print(
        f"{args.scenario} W={args.dcp}: {len(world)} cells, {world_steps} steps, "
        f"{'all passed' if not failed else 'FAILED: ' + ', '.join(failed)} (load average {load:.1f} at start)"
    )
    slice_ms = rank_slice_ms()
    asked = f"batch scheduling, a {slice_ms:g} ms slice" if slice_ms else "nothing: the caller's scheduling"
    print(f"  the ranks asked for {asked} ({SLICE_ENV}, harness.rank_sched)")
    print(
        f"  world wall time {wall:.2f} s; CPU per rank: {', '.join(f'{c:.2f}' for c in cpu)} s (total {sum(cpu):.2f} s); "
        f"launcher {launcher:.2f} s (its schedules, harness.parent_schedule, and the world's supervision)"
    )
    print(
        f"  CPU per rank-step {1e3 * per_rank_step:.2f} ms (world start, setup and the launcher included); "
        f"wall per cell {wall / len(world):.2f} s"
    )
    projected = rank_steps * per_rank_step / cores
    print(f"  projected full matrix at this rate on {cores} CPUs: {projected:.0f} s ({projected / 60:.1f} min; budget 300 s)")


if __name__ == "__main__":
    main()
