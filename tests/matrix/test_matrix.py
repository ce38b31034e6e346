"""The correctness matrix under pytest: every valid built-in cell on real gloo worlds.

Cell ids read like ``dsv41-hybrid-dcp4-il16-bs64``. All cells of one scenario
and one W run in one world (started by the first of them to be collected on a
worker) and carry the same ``xdist_group``, so ``--dist loadgroup`` keeps a
group on one worker and no world is started twice.
"""

from __future__ import annotations

import pytest

from dcpsim import matrix as mx
from dcpsim.registry import builtin_scenario_names

CELLS = mx.expand(builtin_scenario_names(), dry_run=False)
VALID = [c for c in CELLS if c.status == "pending"]
SKIPPED = [c for c in CELLS if c.status == "skipped"]

_done: dict[str, mx.CellResult] = {}


def _result(cell: mx.CellResult) -> mx.CellResult:
    if cell.cell.id not in _done:
        members = [c for c in VALID if c.cell.group == cell.cell.group and c.cell.id not in _done]
        fresh = [mx.CellResult(c.cell, "pending", scenario=c.scenario) for c in members]
        mx.run_cells(fresh)
        _done.update((r.cell.id, r) for r in fresh)
    return _done[cell.cell.id]


@pytest.mark.parametrize(
    "cell",
    [pytest.param(c, id=c.cell.id, marks=pytest.mark.xdist_group(c.cell.group)) for c in VALID],
)
def test_cell(cell):
    result = _result(cell)
    assert result.status == "pass", f"{cell.cell.id}: {result.status}: {result.reason}\n" + (
        result.report.text() if result.report else ""
    )
    report = result.report
    assert report.verifications >= 1 and report.verified_indices > 0
    assert report.dcp_size == cell.cell.dcp and report.interleave_size == cell.cell.interleave
    assert report.schedule["finished"] == report.schedule["requests"]


def test_the_matrix_is_large_enough():
    assert len(VALID) >= 200, f"only {len(VALID)} valid cells"
    assert {c.cell.scenario for c in VALID} == set(builtin_scenario_names())


def test_skipped_cells_say_why():
    assert SKIPPED, "the grid is expected to contain duplicates and W = 1 repeats"
    for c in SKIPPED:
        assert c.reason.startswith(("duplicate of", "same layout as", "invalid config:")), c.reason


def test_invalid_combinations_are_listed_not_dropped():
    cells = mx.expand(["dsv3"], dcps=[2], interleaves=["3", "128", "B"])
    by_interleave = {c.cell.interleave: c for c in cells}
    assert set(by_interleave) == {3, 128, 64}
    assert by_interleave[3].status == "skipped" and "multiple of cp_kv_cache_interleave_size (3)" in by_interleave[3].reason
    assert by_interleave[128].status == "skipped" and "must be <=" in by_interleave[128].reason
    assert by_interleave[64].status == "pending"
