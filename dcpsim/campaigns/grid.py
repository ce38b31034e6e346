"""The full correctness grid: every built-in x W in 1..8 x every I dividing B, the same at
B / 2 for the matrix's default W, plus kernel-block cells.

For each scenario with page size ``B`` (``matrix.page_states``):

* block size ``B``: every W in 1..8 and every interleave size dividing ``B`` (W = 1 once:
  interleave has no effect there);
* block size ``B / 2`` (every page halved, so requests cross twice as many block
  boundaries): every interleave size dividing ``B / 2`` at ``HALF_PAGE_DCP``, the W of
  ``matrix --dcp``'s default (1, 2, 3, 4, 8: powers of two and an odd W). W = 5, 6 and 7
  run at ``B`` and in the kernel-block cells; at ``B / 2`` they cost 18 of every 35
  rank-steps of W in 2..8 (a cell's cost grows with W) and would add no ratio of I to the
  page that ``B`` lacks (``(W, I, B / 2)`` has the ratios of ``(W, 2 I, B)``);
* kernel-block cells ``Bk = B / 2`` at the scenario's own ``B``, for W >= 2 and ``I = B``,
  where every run of a rank spans two kernel blocks (with ``Bk = B``, the other cells, the
  kernel table is the block table itself; ``Bk`` matters nowhere at W = 1 that the
  ``B / 2`` cells do not already cover).

Attention cells (``Cell.attention``): every built-in with the attention check, its merge
variants alternating step by step (all-gather on even steps, all-to-all on odd ones), in two
cells: W = 2 at ``I = 1`` with natural LSEs, and W = 4 at ``I = B`` with base-2 LSEs and kernel
blocks ``Bk = B / 2`` (every run of a rank spans two kernel blocks, and short requests leave
some rank's shard empty). So each built-in (but those of ``NO_ATTENTION_CELLS``) runs at W = 2
and 4, both variants, both bases and ``Bk < B`` (the full cross of W and base would double the
axis's cost: docs/matrix.md).

A block-size override gives every group the same page, so the groups' block spans then
divide each other. A scenario whose own spans do not (``prefix-ragged-spans``: 64 and 48
tokens) runs its first block size at its own pages instead, with every interleave dividing
all of them: the only cells where a prefix hit must come in LCM units of spans that do not
divide each other.

The list, its order and the cell ids depend only on the scenarios, so every machine that
expands it gets the same cells (``shard`` partitions it).
"""

from __future__ import annotations

import math

from dcpsim.campaigns.matrix import DEFAULT_DCP, CellResult, expand, page_states
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage
from dcpsim.model.scenario import Scenario
from dcpsim.scenarios.load import load_scenario

FULL_DCP = tuple(range(1, 9))
HALF_PAGE_DCP = DEFAULT_DCP
"""The W of the ``B / 2`` cells (see the module doc)."""
ATTENTION_DCP = (2, 4)
"""The W of the attention cells with natural LSEs, and of those with base-2 LSEs and ``Bk < B``."""
NO_ATTENTION_CELLS = ("dsv32-sparse",)
"""Built-ins left out of the attention axis for its time budget: ``dsv32-sparse`` scores and
selects 3,000-key contexts on every rank and in the checker, 6-6.5 s of CPU a rank (its gloo
runs with ``--attention`` at W = 2 and 4 are ``tests/dist/test_sparse_attention.py``)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def full_grid(scenarios: list[str], *, dry_run: bool = False) -> list[CellResult]:
    """Every cell of the full grid once, in a fixed order (see the module doc)."""
    out: list[CellResult] = []
    for name in scenarios:
        scenario = load_scenario(name)
        b = page_states(scenario)
        ragged = ragged_pages(scenario)
        if ragged:  # its own pages, every interleave dividing each of them
            out += expand([name], FULL_DCP, [str(i) for i in divisors(math.gcd(*ragged))], [None], dry_run=dry_run)
        else:
            out += expand([name], FULL_DCP, [str(i) for i in divisors(b)], [b], dry_run=dry_run)
        if b % 2 == 0 and b > 1:
            out += expand([name], HALF_PAGE_DCP, [str(i) for i in divisors(b // 2)], [b // 2], dry_run=dry_run)
            out += expand([name], FULL_DCP[1:], [str(b)], [b], dry_run=dry_run, kernel_block_size=b // 2)
    for name in scenarios:
        if name not in NO_ATTENTION_CELLS:
            out += attention_cells(name, dry_run=dry_run)
    return out


def attention_cells(name: str, *, dry_run: bool = False) -> list[CellResult]:
    """The attention cells of one scenario (see the module doc), at its own pages when its spans
    do not divide each other (``I`` and ``Bk`` then divide every page)."""
    scenario = load_scenario(name)
    ragged = ragged_pages(scenario)
    b = math.gcd(*ragged) if ragged else page_states(scenario)
    size = [None] if ragged else [b]
    natural, base2 = ATTENTION_DCP
    kernel = b // 2 if b % 2 == 0 and b > 1 else None
    out = expand([name], (natural,), ["1"], size, dry_run=dry_run, attention="e")
    return out + expand([name], (base2,), [str(b)], size, dry_run=dry_run, kernel_block_size=kernel, attention="2")


def ragged_pages(scenario: Scenario) -> list[int]:
    """The pages (in states) of the scenario's paged groups when their block spans (in
    tokens, at W = 1) do not divide each other, else [] (a block-size override would make
    them equal)."""
    geometries = [
        g for g in ReferenceEngine().geometries(scenario.layers, scenario.config) if g.storage not in (Storage.RING, Storage.STATE)
    ]
    spans = [g.block_size for g in geometries]
    return [g.states_per_page for g in geometries] if spans and math.lcm(*spans) > max(spans) else []
