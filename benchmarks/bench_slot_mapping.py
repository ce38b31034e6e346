"""Benchmark: slot mapping of 10 million positions on every DCP rank.

Compares, on W=8, I=16, B=64 with a random block table of distinct block ids:

* ``slot_mapping(range(0, N), ...)``      -- the range fast path (writes only the rank's runs),
* ``slot_mapping(np.arange(N), ...)``     -- a contiguous array (detected, then the range path),
* ``slot_mapping(shuffled, ...)``         -- the same positions in random order (general path),
* ``slot_mapping(random, ...)``           -- N positions drawn with repeats (general path),
* a naive masked numpy version of each: compute vb, off, owner, loc for every position,
  then ``np.where(owner == r, slot, PAD)``.

Every result is checked equal to the naive one on every rank before the timings are
reported. Each figure is the best of 3 runs (time.perf_counter). Run:

    python benchmarks/bench_slot_mapping.py [--positions N] [--ranks R]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dcpsim.model.layout import PAD, slot_mapping

W, I, B = 8, 16, 64
REPEATS = 3
TARGETS = {"range": 10.0, "contiguous array": 10.0, "shuffled": 3.0, "random, repeats": 3.0}


def naive_masked(pos: np.ndarray, bt: np.ndarray, r: int) -> np.ndarray:
    """Every position's owner and slot, then a mask: the obvious vectorized version."""
    span = B * W
    vb = pos // span
    off = pos % span
    owner = (off // I) % W
    loc = (off // (W * I)) * I + off % I
    return np.where(owner == r, bt[vb] * B + loc, PAD)


def best_of(fn, repeats: int = REPEATS) -> tuple[float, np.ndarray]:
    best = float("inf")
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=10_000_000, help="N (default 10M)")
    parser.add_argument("--ranks", type=int, default=W, help=f"time ranks 0..R-1 (default all {W})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    N = args.positions

    rng = np.random.default_rng(args.seed)
    num_blocks = -(-N // (B * W))
    # distinct random block ids, never the null block 0
    bt = rng.permutation(4 * num_blocks)[:num_blocks].astype(np.int64) + 1
    inputs = {
        "range": range(0, N),
        "contiguous array": np.arange(N, dtype=np.int64),
        "shuffled": rng.permutation(N).astype(np.int64),
        "random, repeats": rng.integers(0, N, size=N, dtype=np.int64),
    }
    kw = dict(block_size=B, dcp_size=W, interleave_size=I)

    print(
        f"slot_mapping benchmark: N={N:,} positions, W={W}, I={I}, B={B}, "
        f"{num_blocks:,} block-table entries, ranks 0..{args.ranks - 1}, best of {REPEATS}"
    )
    totals = {name: [0.0, 0.0] for name in inputs}  # summed best times: dcpsim, naive
    for r in range(args.ranks):
        for name, positions in inputs.items():
            naive_input = np.asarray(positions, dtype=np.int64)
            t_fast, fast = best_of(lambda r=r, p=positions: slot_mapping(p, bt, dcp_rank=r, **kw))
            t_naive, naive = best_of(lambda r=r, p=naive_input: naive_masked(p, bt, r))
            assert np.array_equal(fast, naive), f"{name}: slot_mapping differs from naive on rank {r}"
            totals[name][0] += t_fast
            totals[name][1] += t_naive
            del fast, naive

    def mps(t: float) -> str:
        return f"{N * args.ranks / t / 1e6:10.1f}"

    header = f"{'positions':>16} | {'slot_mapping':>12} | {'naive mask':>10} | {'speedup':>8} | target"
    print("throughput in million positions per second (ranks summed)")
    print(header)
    print("-" * len(header))
    for name, (t_fast, t_naive) in totals.items():
        speedup = t_naive / t_fast
        target = TARGETS[name]
        verdict = "OK" if speedup >= target else "BELOW TARGET"
        print(f"{name:>16} | {mps(t_fast):>12} | {mps(t_naive)} | {speedup:7.1f}x | >= {target:.0f}x {verdict}")
    t_range, t_array = totals["range"][0], totals["contiguous array"][0]
    print(f"contiguous array / range time: {t_array / t_range:.2f} (range {t_range:.3f} s, array {t_array:.3f} s summed over ranks)")


if __name__ == "__main__":
    main()
