"""The full correctness matrix under pytest: ``campaigns.grid.full_grid`` on real gloo worlds.

Part of the default test command (about 5 minutes on 2 cores, docs/matrix.md's table);
``--dcpsim-skip-full-matrix`` leaves it out of a quick local run, ``--dcpsim-shard K/N`` runs
only the cells of ``dcpsim matrix --full --shard K/N``, so a CI system can fan it out over
machines. One test item is one chunk of at most ``UNIT`` cells of one (scenario, W) world
(a work unit of ``campaigns.shard``), so pytest-xdist spreads the chunks over its workers;
a failing chunk names each of its failing cells.
"""

from __future__ import annotations

import functools

import pytest

from dcpsim.campaigns import matrix as mx
from dcpsim.campaigns.grid import HALF_PAGE_DCP, NO_ATTENTION_CELLS, full_grid
from dcpsim.campaigns.shard import UNIT, parse_shard, select, unit_cost, work_units
from dcpsim.scenarios.registry import builtin_scenario_names
from support.helpers import builtin_names_at
from support.marks import deselected_by_marks

pytestmark = pytest.mark.slow  # about 5 minutes of gloo worlds on 2 cores


DESELECTED = "deselected"
"""The one item of the chunk test when ``-m`` deselects all of them (``deselected_by_marks``)."""


@functools.cache
def grid() -> tuple[mx.CellResult, ...]:
    """The full grid, expanded once per process (tests copy the cells they run)."""
    return tuple(full_grid(builtin_scenario_names()))


def chunks_of(cells: list[mx.CellResult]) -> list[list[mx.CellResult]]:
    """The work units of ``campaigns.shard`` (at most ``UNIT`` cells of one world), as cells,
    the costliest first (``unit_cost``: rank processes x cells), so that xdist's workers end
    together instead of one finishing a W = 8 chunk alone."""
    units = sorted(work_units(cells), key=lambda unit: -unit_cost(cells, unit))
    return [[cells[i] for i in unit] for unit in units]


def pytest_generate_tests(metafunc):
    if "chunk" not in metafunc.fixturenames:
        return
    config = metafunc.config
    shard = config.getoption("dcpsim_shard")
    if shard is None and config.getoption("dcpsim_skip_full_matrix"):
        metafunc.parametrize("chunk", [None], ids=["off"])
        return
    if deselected_by_marks(config, {mark.name for mark in metafunc.definition.iter_markers()}):
        # the fast loop's -m "not slow": every chunk would be deselected, so the grid is not
        # expanded (1.3 s of each xdist worker's collection); one placeholder item, deselected too
        metafunc.parametrize("chunk", [DESELECTED], ids=[DESELECTED])
        return
    cells = list(grid())
    if shard is not None:
        cells = [cells[i] for i in select(cells, *parse_shard(shard, "--dcpsim-shard"))]
    chunks = chunks_of(cells)
    # id: the chunk's first cell and how many follow, e.g. dsv3-dcp4-il1-bs64+6
    metafunc.parametrize("chunk", chunks, ids=[f"{c[0].cell.id}+{len(c) - 1}" for c in chunks])


def problems(res: mx.CellResult) -> str:
    """What is wrong with a finished cell, or ''."""
    if res.status != mx.CellStatus.PASS:
        return mx.cell_line(res)
    r = res.report
    if not (r.verifications >= 1 and r.verified_indices > 0):
        return f"{res.cell.id}: nothing was verified"
    if (r.dcp_size, r.interleave_size, r.kernel_block_size) != (res.cell.dcp, res.cell.interleave, res.cell.kernel_block_size):
        return f"{res.cell.id}: ran W={r.dcp_size} I={r.interleave_size} Bk={r.kernel_block_size}"
    if r.schedule["finished"] != r.schedule["requests"]:
        return f"{res.cell.id}: {r.schedule['finished']} of {r.schedule['requests']} requests finished"
    if res.cell.attention is not None and not r.attention_checks:
        return f"{res.cell.id}: no attention check ran"
    return ""


@pytest.mark.dist
def test_full_matrix_chunk(chunk):
    if chunk is None:
        pytest.skip("--dcpsim-skip-full-matrix leaves out the full matrix")
    assert chunk != DESELECTED, "-m was taken to deselect the full matrix, yet its placeholder item runs: no chunk was built"
    fresh = [mx.CellResult(c.cell, mx.CellStatus.PENDING, scenario=c.scenario) for c in chunk]
    mx.run_cells(fresh)
    bad = [p for p in map(problems, fresh) if p]
    assert not bad, f"{len(bad)} of {len(fresh)} cells failed:\n" + "\n".join(bad)


def test_the_full_grid_has_every_axis():
    cells = grid()
    valid = [c.cell for c in cells if c.status == mx.CellStatus.PENDING]
    assert len(valid) >= 1000, f"only {len(valid)} valid cells"
    assert len({c.cell.id for c in cells}) == len(cells)
    assert {c.scenario for c in valid} == set(builtin_scenario_names())
    assert {c.dcp for c in valid} == set(range(1, 9))
    dsv3 = {(c.dcp, c.interleave, c.block_size, c.kernel_block_size) for c in valid if c.scenario == "dsv3"}
    assert {i for w, i, b, k in dsv3 if b == 64 and w == 4 and k is None} == {1, 2, 4, 8, 16, 32, 64}
    assert {i for w, i, b, k in dsv3 if b == 32 and w == 4} == {1, 2, 4, 8, 16, 32}
    # B / 2 at the matrix's default W (W = 5, 6, 7 run at B and Bk = B / 2), every I at each
    assert {w for w, i, b, k in dsv3 if b == 32} == set(HALF_PAGE_DCP) == {1, 2, 3, 4, 8}
    assert all({i for w, i, b, k in dsv3 if b == 32 and w == W} == {1, 2, 4, 8, 16, 32} for W in (2, 3, 8))
    assert {w for w, i, b, k in dsv3 if b == 64 and k is None and i == 1} == set(range(1, 9))
    assert {(w, i) for w, i, b, k in dsv3 if k == 32} == {(w, 64) for w in range(2, 9)}
    assert sum(1 for w, *_ in dsv3 if w == 1) == 2, "W = 1 once per block size"


def test_chunks_keep_to_one_world_and_cover_the_pending_cells():
    # dsv3-dcp2 has 7 + 6 cells at B = 64 and 32: one full unit and one of a single cell
    cells = mx.expand(
        ["dsv3", "llama-gqa"], dcps=[1, 2], interleaves=["1", "2", "4", "8", "16", "32", "64"], block_sizes=[64, 32], dry_run=False
    )
    chunks = chunks_of(cells)
    assert all(len({c.cell.group for c in chunk}) == 1 and len(chunk) <= UNIT for chunk in chunks)
    assert [len(c) for c in chunks if c[0].cell.group == "dsv3-dcp2"] == [UNIT, 13 - UNIT]
    assert sorted(c.cell.id for chunk in chunks for c in chunk) == sorted(c.cell.id for c in cells if c.status == "pending")


def test_a_scenario_whose_spans_do_not_divide_keeps_its_own_pages():
    """prefix-ragged-spans (64- and 48-token pages) runs at its own pages at every W, with every
    interleave dividing both, so its prefix hits come in LCM units of spans that do not divide;
    every other built-in's spans divide each other and its cells override the block size."""
    cells = [c for c in grid() if c.cell.scenario == "prefix-ragged-spans" and c.status == mx.CellStatus.PENDING]
    own = [c for c in cells if c.cell.block_size_override is None]
    assert {c.cell.dcp for c in own} == set(range(1, 9))
    assert {c.cell.interleave for c in own} == {1, 2, 4, 8, 16}
    for c in own:
        pages = sorted(spec.block_size for spec in c.scenario.layers.values())
        assert pages[0] == 48 and pages[-1] == 64
    assert all(c.cell.block_size_override is not None for c in grid() if c.cell.scenario != "prefix-ragged-spans")


def test_every_built_in_has_attention_cells_with_both_bases_and_kernel_blocks():
    """W = 2 with base e at I = 1, W = 4 with base 2 at I = B and Bk = B / 2 (the merge variants
    alternate in both), so both variants, both bases and Bk < B run on every built-in; a built-in
    whose stated heads the head rule refuses at W = 4 (``gqa-pcp2-heads``) has that cell skipped
    with the rule as its reason, like its write-path cells there."""
    cells = [c for c in grid() if c.cell.attention is not None]
    skipped = [c for c in cells if c.status != mx.CellStatus.PENDING]
    refused = {(n, 4) for n in builtin_scenario_names() if n not in builtin_names_at(4, helix=True)}
    assert {(c.cell.scenario, c.cell.dcp) for c in skipped} == refused
    assert all("KV heads do not follow its queries" in c.reason for c in skipped), [(c.cell.id, c.reason) for c in skipped]
    assert not any(c.cell.scenario in NO_ATTENTION_CELLS for c in cells)
    for name in (n for n in builtin_scenario_names() if n not in NO_ATTENTION_CELLS):
        mine = [c.cell for c in cells if c.cell.scenario == name]
        assert {(c.dcp, c.attention) for c in mine} == {(2, "e"), (4, "2")}, name
        assert all(c.kernel_block_size is not None and c.kernel_block_size < c.block_size for c in mine if c.attention == "2"), name
        for c in mine:
            job = c.attention_config
            assert job.enabled and job.merge == "alternate" and job.base == c.attention
    assert len({c.cell.id for c in grid()}) == len(grid())  # no attention cell repeats a write-path cell's id
