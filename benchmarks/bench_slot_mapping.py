"""Benchmark: slot mapping of 10 million contiguous positions on every DCP rank.

Compares, on W=8, I=16, B=64 with a random block table of distinct block ids:

* ``slot_mapping(range(0, N), ...)``   -- the range fast path (writes only the rank's runs),
* ``slot_mapping(np.arange(N), ...)``  -- the general array path,
* a naive masked numpy version: compute vb, off, owner, loc for every position,
  then ``np.where(owner == r, slot, PAD)``.

All three are checked equal on every rank before their timings are reported.
Each figure is the best of 3 runs (time.perf_counter). Run:

    python benchmarks/bench_slot_mapping.py [--positions N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dcpsim.model.layout import PAD, slot_mapping

W, I, B = 8, 16, 64
REPEATS = 3
TARGET_SPEEDUP = 10.0


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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    N = args.positions

    rng = np.random.default_rng(args.seed)
    num_blocks = -(-N // (B * W))
    # distinct random block ids, never the null block 0
    bt = rng.permutation(4 * num_blocks)[:num_blocks].astype(np.int64) + 1
    pos = np.arange(N, dtype=np.int64)
    kw = dict(block_size=B, dcp_size=W, interleave_size=I)

    print(f"slot_mapping benchmark: N={N:,} positions, W={W}, I={I}, B={B}, "
          f"{num_blocks:,} block-table entries, best of {REPEATS}")
    rows = []
    owned_total = 0
    for r in range(W):
        t_fast, fast = best_of(lambda r=r: slot_mapping(range(0, N), bt, dcp_rank=r, **kw))
        t_gen, gen = best_of(lambda r=r: slot_mapping(pos, bt, dcp_rank=r, **kw))
        t_naive, naive = best_of(lambda r=r: naive_masked(pos, bt, r))
        assert np.array_equal(fast, naive), f"range fast path differs from naive on rank {r}"
        assert np.array_equal(gen, naive), f"general path differs from naive on rank {r}"
        owned_total += int((fast != PAD).sum())
        del fast, gen, naive
        rows.append((r, t_fast, t_gen, t_naive))
    assert owned_total == N, f"ranks own {owned_total} positions in total, expected {N}"

    def mps(n: int, t: float) -> str:
        return f"{n / t / 1e6:10.1f}"

    header = f"{'rank':>7} | {'range fast':>10} | {'general':>10} | {'naive mask':>10} | {'fast/naive':>10} | {'gen/naive':>9}"
    print("throughput in million positions per second")
    print(header)
    print("-" * len(header))
    for r, t_fast, t_gen, t_naive in rows:
        print(f"{r:>7} | {mps(N, t_fast)} | {mps(N, t_gen)} | {mps(N, t_naive)} | "
              f"{t_naive / t_fast:9.1f}x | {t_naive / t_gen:8.2f}x")
    tot_fast = sum(t for _, t, _, _ in rows)
    tot_gen = sum(t for _, _, t, _ in rows)
    tot_naive = sum(t for _, _, _, t in rows)
    print("-" * len(header))
    print(f"{'overall':>7} | {mps(N * W, tot_fast)} | {mps(N * W, tot_gen)} | {mps(N * W, tot_naive)} | "
          f"{tot_naive / tot_fast:9.1f}x | {tot_naive / tot_gen:8.2f}x")
    print(f"(overall = {W} ranks x {N:,} positions / summed best times: "
          f"fast {tot_fast:.3f} s, general {tot_gen:.3f} s, naive {tot_naive:.3f} s)")
    speedup = tot_naive / tot_fast
    verdict = "OK" if speedup >= TARGET_SPEEDUP else "BELOW TARGET"
    print(f"range fast path vs naive masked: {speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x): {verdict}")


if __name__ == "__main__":
    main()
