"""Benchmark: one rank's chunked-context gather over a long prefill, the engine's side and the checker's.

The workload of ``bench_verify.py --layout scout`` without the world: one request of ``--context``
tokens prefilled in 16K-token chunks, W = 8 (``--dcp``), vLLM's default 64K-row workspace, so every
step past the fourth gathers a cached context longer than the workspace. For each step, rank
``--rank``'s ``ReferenceEngine.context_gather`` of the sharded full-attention group, then the
checker's judgement of it (``verify.context_gather.judge_gathers``), over a shuffled block-table row
the request grows. Prints the CPU seconds of each side, summed over the steps, per context: a cost
that grows with what each step adds stays about linear in the context, one that walks the whole
context every step grows with its square (issue 29: 5.9 s a side at 10M before the kept slots).
One process, no world, CPU clock: a figure to compare per commit even on a loaded machine.

    python benchmarks/bench_context_gather.py [--context 2097152,10485496] [--dcp 8] [--rank 0]

To measure an older checkout, run the script from inside it (``cd OLD && PYTHONPATH=OLD python THIS_FILE``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_verify import CHUNK, commit, long_request_scenario

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage
from dcpsim.model.plan import ReqWrite, StepPlan
from dcpsim.verify.context_gather import judge_gathers
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.metadata import MetadataJudge


def gather_seconds(context: int, dcp: int, rank: int) -> tuple[float, float, int, int]:
    """(engine CPU s, checker CPU s, gathers judged, failures) over the prefill of ``context`` tokens."""
    scenario = long_request_scenario("scout", context, dcp, 1, None)
    engine = ReferenceEngine()
    geometries = engine.geometries(scenario.layers, scenario.config)
    g = next(x for x in geometries if x.sharded and x.storage is Storage.PAGED and x.chunked_prefill_workspace_size)
    group = expected_groups(scenario)[g.group_id]
    judge = MetadataJudge(rank, [group], [g.group_id], scenario.config.max_model_len, (), config=scenario.config)
    unit = g.manager_block_size
    row = np.random.default_rng(0).permutation(np.arange(1, -(-context // unit) + 1, dtype=np.int64))
    engine_s = checker_s = 0.0
    for start in range(0, context, CHUNK):
        n = min(CHUNK, context - start)
        rows = {0: row[: -(-(start + n) // unit)]}
        write = ReqWrite(0, "long", start, np.zeros(n, np.int64), prefill=True)
        per_group = tuple(rows if k == g.group_id else {} for k in range(len(geometries)))
        plan = StepPlan(start // CHUNK, (write,), per_group, (), per_group)
        t0 = time.process_time()
        gather = engine.context_gather(g, [write], [rows[0]], rank)
        t1 = time.process_time()
        judge_gathers(judge, plan, [] if gather is None else [gather])
        t2 = time.process_time()
        engine_s, checker_s = engine_s + t1 - t0, checker_s + t2 - t1
    return engine_s, checker_s, judge.gather_checks, judge.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default="2097152,10485496", help="comma-separated prompt lengths")
    parser.add_argument("--dcp", type=int, default=8, help="W (default 8)")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    for context in (int(c) for c in args.context.split(",")):
        engine_s, checker_s, checks, failures = gather_seconds(context, args.dcp, args.rank)
        print(
            f"  row: | {commit()} | scout, {context:,}, W = {args.dcp}, rank {args.rank} | {engine_s:.2f} s | {checker_s:.2f} s | "
            f"{checks} gathers, {failures} failures |"
        )


if __name__ == "__main__":
    main()
