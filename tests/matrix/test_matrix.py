"""The correctness matrix under pytest: every valid built-in cell on real gloo worlds.

Cell ids read like ``dsv41-hybrid-dcp4-il16-bs64``. All cells of one scenario
and one W run in one world, started by whichever cell of the group comes
first. The results go to a folder that every pytest-xdist worker of the
session shares, under a per-group file lock, so a group's world runs once
however xdist spreads its cells. (``--dist loadgroup`` would keep a group on
one worker, but with pytest 9 and xdist 3.8 it silently stops grouping.)
"""

from __future__ import annotations

import dataclasses
import fcntl
import pickle

import pytest

from dcpsim.campaigns import matrix as mx
from dcpsim.campaigns.grid import full_grid
from dcpsim.scenarios.registry import builtin_scenario_names
from support.matrix_cover import covered, same_run

CELLS = mx.expand(builtin_scenario_names(), dry_run=False)
VALID = [c for c in CELLS if c.status == "pending"]
SKIPPED = [c for c in CELLS if c.status == "skipped"]


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory, worker_id):
    """A folder all xdist workers of this session see (the base temp's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    root = base if worker_id == "master" else base.parent
    path = root / "dcpsim-matrix"
    path.mkdir(exist_ok=True)
    return path


def group_results(group: str, shared_dir) -> dict[str, tuple[str, str, object]]:
    """Run the group's world once per session (whichever worker asks first); (status, reason, report) by cell id."""
    done = shared_dir / f"{group}.pickle"
    with open(shared_dir / f"{group}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            fresh = [mx.CellResult(c.cell, mx.CellStatus.PENDING, scenario=c.scenario) for c in VALID if c.cell.group == group]
            mx.run_cells(fresh)
            tmp = done.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps({r.cell.id: (r.status, r.reason, r.report) for r in fresh}))
            tmp.rename(done)
    return pickle.loads(done.read_bytes())


@pytest.mark.slow
@pytest.mark.parametrize("cell", VALID, ids=[c.cell.id for c in VALID])
def test_cell(cell, shared_dir):
    status, reason, report = group_results(cell.cell.group, shared_dir)[cell.cell.id]
    assert status == "pass", f"{cell.cell.id}: {status}: {reason}\n" + (report.text() if report else "")
    assert report.verifications >= 1 and report.verified_indices > 0
    assert report.dcp_size == cell.cell.dcp and report.interleave_size == cell.cell.interleave
    assert report.schedule["finished"] == report.schedule["requests"]


def test_the_matrix_is_large_enough():
    assert len(VALID) >= 200, f"only {len(VALID)} valid cells"
    assert {c.cell.scenario for c in VALID} == set(builtin_scenario_names())


@pytest.mark.slow
def test_every_default_cell_runs_in_the_full_matrix():
    """Why ``conftest.py`` may deselect ``test_cell``: each valid default cell is a full-grid cell
    of the same id whose block-size override changes nothing (``support.matrix_cover``)."""
    full = [c for c in full_grid(builtin_scenario_names()) if c.status == "pending"]
    assert covered(VALID, full) == {c.cell.id for c in VALID}
    # a full cell at another page is another run, even under the default cell's id
    default = next(c for c in VALID if c.cell.id == "dsv3-dcp2-il16-bs64")
    half = next(c for c in full if c.cell.id == "dsv3-dcp2-il16-bs32")
    assert not same_run(default, dataclasses.replace(half, cell=default.cell))


def test_skipped_cells_say_why():
    assert SKIPPED, "the grid is expected to contain W = 1 repeats"
    for c in SKIPPED:
        assert c.reason.startswith(("same layout as", "invalid config:")), c.reason


def test_every_cell_is_listed_once():
    ids = [c.cell.id for c in CELLS]
    assert len(ids) == len(set(ids))


def test_an_interleave_equal_to_b_is_one_cell():
    # dsv3's B is 64: "64" and "B" name the same cell, and so does a scenario given twice
    cells = mx.expand(["dsv3", "dsv3"], dcps=[2], interleaves=["16", "64", "B"], dry_run=False)
    assert [(c.cell.id, c.status) for c in cells] == [("dsv3-dcp2-il16-bs64", "pending"), ("dsv3-dcp2-il64-bs64", "pending")]


def test_invalid_combinations_are_listed_not_dropped():
    cells = mx.expand(["dsv3"], dcps=[2], interleaves=["3", "128", "B"])
    by_interleave = {c.cell.interleave: c for c in cells}
    assert set(by_interleave) == {3, 128, 64}
    assert by_interleave[3].status == "skipped" and "multiple of cp_kv_cache_interleave_size (3)" in by_interleave[3].reason
    assert by_interleave[128].status == "skipped" and "must be <=" in by_interleave[128].reason
    assert by_interleave[64].status == "pending"
