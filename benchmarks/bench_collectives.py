"""Benchmark: gloo's ring all-gather against a gather to one rank plus a broadcast.

``GlooCollectives.all_gather_tensor`` uses the second above ``STAR_GATHER_FROM`` ranks:
the ring's ``W - 1`` dependent hops each wait for the next rank to be scheduled, which
costs most when the ranks outnumber the cores. Prints, per world size, the wall time per
call and each rank's CPU per call, for a row the size of the checker's per-step row.
Run:

    python benchmarks/bench_collectives.py [--ranks 2,4,8] [--calls 200] [--numel 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dcpsim.harness.world import run_world

WAYS = ("all_gather", "gather+broadcast")
WARMUP = 10


def rank_timings(payload, rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    """``run_world`` target: (wall, CPU) seconds of ``calls`` collectives of each way."""
    import torch
    import torch.distributed as dist

    calls, numel = payload
    row = torch.full((numel,), rank, dtype=torch.int64)
    out = {}
    for way in WAYS:
        parts = [torch.empty_like(row) for _ in range(world_size)]
        stacked = torch.empty((world_size, numel), dtype=torch.int64)

        for _ in range(WARMUP):  # gloo connects pairs on first use
            _collective(way, rank, row, parts, stacked)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            _collective(way, rank, row, parts, stacked)
        out[way] = (time.perf_counter() - wall, time.process_time() - cpu)
        got = torch.stack(parts) if way == "all_gather" else stacked
        assert got[:, 0].tolist() == list(range(world_size)), f"{way}: rows out of order"
    return out


def _collective(way: str, rank: int, row, parts, stacked) -> None:
    import torch.distributed as dist

    if way == "all_gather":
        dist.all_gather(parts, row)
    else:
        dist.gather(row, list(stacked.unbind(0)) if rank == 0 else None, dst=0)
        dist.broadcast(stacked, src=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8", help="world sizes (default 2,4,8)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--numel", type=int, default=60, help="int64 entries per rank's row (default 60)")
    args = parser.parse_args()
    print(f"{args.calls} calls of a {args.numel}-int64 row per rank, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'ranks':>5} | {'way':<16} | {'wall ms/call':>12} | {'CPU ms/call (max rank)':>22}")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    import bench_collectives  # by module name: the ranks start without this script's __main__

    for world in (int(w) for w in args.ranks.split(",")):
        per_rank = run_world(bench_collectives.rank_timings, (args.calls, args.numel), world_size=world, pg_timeout_s=60, deadline_s=600)
        for way in WAYS:
            wall = max(r[way][0] for r in per_rank) / args.calls * 1e3
            cpu = max(r[way][1] for r in per_rank) / args.calls * 1e3
            print(f"{world:>5} | {way:<16} | {wall:>12.2f} | {cpu:>22.2f}")


if __name__ == "__main__":
    main()
