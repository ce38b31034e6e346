"""Benchmark: how often the fuzz strategy draws each situation (``campaigns.fuzz.SITUATIONS``):
prefills that gather a cached context, contexts gathered in several pieces, preemptions, CUDA-graph
padded decode steps, padded steps after a preemption, prefix hits of an EAGLE drafter's run, Helix's layout where it differs
from vLLM's; with ``--pd``, of the P/D strategy (``fuzz --pd``): a decode rank owning none of a
prompt, the resharding connector, a partly filled last page. Draws scenarios as ``fuzz`` does and
schedules them with the reference engine (runs nothing).

    python benchmarks/bench_fuzz_situations.py [--examples N] [--seed S] [--pd]

Prints the fraction of the drawn examples exercising each, and the time taken.
"""

from __future__ import annotations

import argparse
import time

from dcpsim.campaigns.fuzz import situation_fractions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pd", action="store_true", help="the P/D strategy of fuzz --pd")
    args = p.parse_args()
    start = time.perf_counter()
    fractions = situation_fractions(args.examples, args.seed, pd=args.pd)
    seconds = time.perf_counter() - start
    print(f"{args.examples} drawn{' P/D' if args.pd else ''} examples (seed {args.seed}), {seconds:.1f} s")
    for name, fraction in fractions.items():
        print(f"  {name:26s} {fraction:6.1%}")


if __name__ == "__main__":
    main()
