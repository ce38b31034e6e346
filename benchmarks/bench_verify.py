"""Benchmark: verification cost of one long-context request, per verification mode.

The workload of issue 12: one request whose prompt of ``--context`` tokens is prefilled in
16K-token chunks, then 256 decode tokens under speculative decoding (the layout's
``num_speculative_tokens``, seeded acceptance), every step verified, on a gloo world of
``--dcp`` ranks. Layouts: ``dsv41`` (the ``dsv41-hybrid`` built-in: replicated SWA and
rings, sharded compressed caches) or ``scout`` (the ``llama4-scout`` built-in: chunked
local attention in three of four layers, sharded global attention in the fourth).

Prints the wall time of the world, checks, verified indices, each rank's peak RSS and CPU,
issue 29's goal where the workload has one (dsv41 at 1M, scout at 10,485,496, W = 8), and a
``row:`` of the per-commit table in ``benchmarks/README.md`` (the commit, ``+`` for a changed tree).
``--profile`` also prints the top functions of rank 0 (cProfile; the ranks do the same work). Run:

    python benchmarks/bench_verify.py --layout dsv41 --context 1048576 [--verify full] [--attention]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import time
from pathlib import Path

T0 = time.perf_counter()
from dcpsim.harness.world import RANK_PRELOAD, start_forkserver  # noqa: E402

if __name__ == "__main__":  # as python -m dcpsim does: the forkserver imports torch while this process does
    start_forkserver((RANK_PRELOAD,))

from dcpsim.harness.job import Job  # noqa: E402
from dcpsim.model.scenario import RequestSpec  # noqa: E402
from dcpsim.scenarios.load import load_scenario  # noqa: E402

BUILTIN = Path(__file__).resolve().parents[1] / "dcpsim" / "scenarios" / "builtin"
GOALS = {("dsv41", 1 << 20, 8): (2.5, None), ("scout", 10485496, 8): (30.0, 1024)}
"""Issue 29's goals, (world seconds, MiB a rank), by (layout, context, W)."""
LAYOUTS = {"dsv41": BUILTIN / "dsv41-hybrid.toml", "scout": BUILTIN / "llama4-scout.toml"}
SCOUT_MAX_MODEL_LEN = 10485760
"""Llama-4-Scout's ``max_position_embeddings`` (its config.json; see llama4-scout.toml)."""
CHUNK = 16384
DECODE = 256


def long_request_scenario(layout: str, context: int, dcp: int, verify_every: int, max_model_len: int | None):
    """The built-in layout with one ``context``-token request and a model length to fit it."""
    base = load_scenario(str(LAYOUTS[layout]))
    if max_model_len is None:
        max_model_len = SCOUT_MAX_MODEL_LEN if layout == "scout" else context + DECODE + 8
    config = dataclasses.replace(
        base.config,
        max_model_len=max_model_len,
        max_num_batched_tokens=CHUNK,
        decode_context_parallel_size=dcp,
        enable_prefix_caching=False,
    )
    request = RequestSpec(request_id="long", prompt_len=context, output_len=DECODE)
    return dataclasses.replace(
        base,
        name=f"{base.name}-{context}",
        config=config,
        requests=(request,),
        kv_cache_tokens=None,
        num_gpu_blocks=None,
        verify_every=verify_every,
    )


def profiled_rank_batch(payload, rank: int, world_size: int):
    """``run_world`` target: a gloo rank's batch, rank 0 under cProfile (stats to a file)."""
    from dcpsim.harness.runner import gloo_rank_batch

    jobs_payload, path = payload
    if rank != 0:
        return gloo_rank_batch(jobs_payload, rank, world_size)
    profile = cProfile.Profile(time.process_time)  # CPU time: 8 ranks share 2 cores
    profile.enable()
    try:
        return gloo_rank_batch(jobs_payload, rank, world_size)
    finally:
        profile.disable()
        profile.dump_stats(path)


def profiled(jobs, timeout: float, top: int, sort: str, callers: str | None, save: str | None = None) -> list:
    """Run the jobs on a gloo world, rank 0 under cProfile; print its top functions."""
    import os
    import sys
    import tempfile

    from dcpsim.harness.parent_schedule import parent_schedules_of
    from dcpsim.harness.runner import merge_rank_reports
    from dcpsim.harness.streams import shared_streams_of
    from dcpsim.harness.world import run_world

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    import bench_verify  # by module name, so the ranks can unpickle the target

    path = os.path.join(tempfile.mkdtemp(), "rank0.prof")
    with shared_streams_of(jobs) as streams, parent_schedules_of(jobs) as schedules:  # as run_jobs does
        per_rank = run_world(
            bench_verify.profiled_rank_batch,
            ((jobs, None, streams, schedules), path),
            world_size=jobs[0].world_size,
            pg_timeout_s=timeout,
            deadline_s=4 * timeout,
            preload=(RANK_PRELOAD,),
        )
    out = io.StringIO()
    stats = pstats.Stats(path, stream=out).sort_stats(sort)
    stats.print_stats(top)
    if callers:
        stats.print_callers(callers)
    print(out.getvalue())
    if save:
        import shutil

        shutil.copy(path, save)
    return [merge_rank_reports([reports[k] for reports, _ in per_rank]) for k in range(len(jobs))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dsv41")
    parser.add_argument("--context", type=int, default=1 << 20, help="prompt tokens (default 1M)")
    parser.add_argument("--dcp", type=int, default=8, help="W (default 8)")
    parser.add_argument("--max-model-len", type=int, help="default: the context + 264 (scout: its config's 10485760)")
    parser.add_argument("--verify", choices=("incremental", "full"), default="incremental")
    parser.add_argument("--verify-every", type=int, default=1)
    parser.add_argument("--attention", action="store_true", help="also check decode attention (--attention)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--profile", action="store_true", help="print rank 0's cProfile top functions")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", default="tottime", help="with --profile: pstats sort key (tottime, cumulative)")
    parser.add_argument("--callers", metavar="REGEX", help="with --profile: also who calls the functions matching REGEX")
    parser.add_argument("--profile-out", metavar="FILE", help="with --profile: also keep rank 0's pstats file")
    args = parser.parse_args()

    from dcpsim.harness.runner import run_jobs

    scenario = long_request_scenario(args.layout, args.context, args.dcp, args.verify_every, args.max_model_len)
    job = Job.from_options(scenario, attention=args.attention, verify=args.verify, timeout=args.timeout, deadline=4 * args.timeout)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    if args.profile:
        (report,) = profiled([job], args.timeout, args.top, args.sort, args.callers, args.profile_out)
    else:
        (report,) = run_jobs([job])
    wall = time.perf_counter() - start
    rss = max(r["peak_rss_mb"] for r in report.ranks)
    mode = args.verify
    print(
        f"{scenario.name}: W={args.dcp} context={args.context:,} max_model_len={scenario.config.max_model_len:,} "
        f"verify={mode} attention={'on' if args.attention else 'off'} (load average {load:.1f} at start)"
    )
    print(f"  passed={report.passed} steps={report.steps} checks={report.verifications} verified indices={report.verified_indices:,}")
    if args.attention:
        print(
            f"  attention checks={report.attention_checks} sampled={report.attention_sampled_checks} "
            f"skipped={getattr(report, 'attention_skipped_checks', 0)} "
            f"checked steps={getattr(report, 'attention_checked_steps', report.steps)} "
            f"query tokens={report.attention_query_tokens} max error={report.attention_max_error}"
        )
    per_rank = ", ".join(f"{r['peak_rss_mb']:.0f}" for r in report.ranks)
    print(
        f"  wall time {wall:.2f} s (this process, end to end: {time.perf_counter() - T0:.2f} s); "
        f"peak RSS per rank: max {rss:.0f} MiB ({per_rank})"
    )
    cpu = [r["cpu_seconds"] for r in report.ranks] if all("cpu_seconds" in r for r in report.ranks) else []
    if cpu:
        print(f"  CPU per rank: max {max(cpu):.2f} s, total {sum(cpu):.2f} s over {os.cpu_count()} CPUs")
    goal = GOALS.get((args.layout, args.context, args.dcp)) if not args.attention and args.verify == "incremental" else None
    if goal is not None:
        seconds, mib = goal
        said = f"  goal (issue 29): <= {seconds:g} s of world time: {'met' if wall <= seconds else 'missed'} ({wall:.2f} s)"
        if mib is not None:
            said += f"; <= {mib:,} MiB a rank: {'met' if rss <= mib else 'missed'} ({rss:,.0f} MiB)"
        print(said)
    # one row of benchmarks/README.md's table per commit (the CPU's total over the cores is what
    # the world time comes to on an idle machine, since the ranks outnumber the cores)
    cpus = os.cpu_count() or 1
    cpu_text = f"{max(cpu):.2f} s / {sum(cpu):.1f} s ({sum(cpu) / cpus:.1f} s over {cpus})" if cpu else "?"
    print(
        f"  row: | {commit()} | {args.layout}, {args.context:,}, W = {args.dcp} | {wall:.2f} s | {cpu_text} | {rss:,.0f} MiB | "
        f"{load:.1f} | {'pass' if report.passed else 'FAIL'} |"
    )


def commit() -> str:
    """The checkout's short commit, ``+`` when its tree has changes (``?`` outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    main()
