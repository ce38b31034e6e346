"""The full correctness grid: every built-in x W in 1..8 x every I dividing B x two block
sizes, plus kernel-block cells.

For each scenario with page size ``B`` (``matrix.page_states``):

* block sizes ``B`` and ``B / 2`` (the second halves every page, so requests cross twice
  as many block boundaries);
* for each, every W in 1..8 and every interleave size dividing that block size (W = 1
  once: interleave has no effect there);
* kernel-block cells ``Bk = B / 2`` at the scenario's own ``B``, for W >= 2 and ``I = B``,
  where every run of a rank spans two kernel blocks (with ``Bk = B``, the other cells, the
  kernel table is the block table itself; ``Bk`` matters nowhere at W = 1 that the
  ``B / 2`` cells do not already cover).

The list, its order and the cell ids depend only on the scenarios, so every machine that
expands it gets the same cells (``shard`` partitions it).
"""

from __future__ import annotations

from dcpsim.campaigns.matrix import CellResult, expand, page_states
from dcpsim.scenarios.load import load_scenario

FULL_DCP = tuple(range(1, 9))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def full_grid(scenarios: list[str], *, dry_run: bool = False) -> list[CellResult]:
    """Every cell of the full grid once, in a fixed order (see the module doc)."""
    out: list[CellResult] = []
    for name in scenarios:
        b = page_states(load_scenario(name))
        sizes = [b] + ([b // 2] if b % 2 == 0 and b > 1 else [])
        for bs in sizes:
            out += expand([name], FULL_DCP, [str(i) for i in divisors(bs)], [bs], dry_run=dry_run)
        if b % 2 == 0 and b > 1:
            out += expand([name], FULL_DCP[1:], [str(b)], [b], dry_run=dry_run, kernel_block_size=b // 2)
    return out
