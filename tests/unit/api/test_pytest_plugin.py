"""The pytest plugin (``dcpsim.pytest_plugin``, the ``pytest11`` entry point), in a folder
outside this repository (``pytester``, pytest in a subprocess; in this process where nothing is
patched and no world starts, or one in threads): the fixture, the engine options, the matrix
items, their shards and their JUnit files, which ``dcpsim merge`` joins; the matrix's worlds (one
per (scenario, W), counted by a conftest around ``harness.runner.run_jobs``, with and without
pytest-xdist) and a bad cell's failure on its own item. The fixture passing on the reference
engine, in a subprocess: ``test_ci_recipe.py``'s engine repository test file (dsv3 at two ranks
among its four tests)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from dcpsim.campaigns.matrix_plan import matrix_cells
from dcpsim.cli import main
from support.helpers import run_cli

pytest_plugins = ["pytester"]

OFF_BY_ONE = "dcpsim.engine.example_plugin:OffByOneExampleEngine"

ENGINE_TEST = """
def test_dsv3_at_two_ranks(dcpsim_run):
    report = dcpsim_run("dsv3", dcp=2)
    report.raise_for_failure()
    assert report.passed and report.steps > 0
"""


@pytest.fixture
def engine_repo(pytester):
    """An engine's repository: one test file, no conftest."""
    assert not list(pytester.path.glob("conftest.py"))
    pytester.makepyfile(test_engine=ENGINE_TEST)
    return pytester


@pytest.mark.slow
def test_a_broken_engine_fails_the_test_with_the_text_report(engine_repo):
    """In this process (the ranks as threads, nothing patched)."""
    result = engine_repo.runpytest_inprocess("-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-engine", OFF_BY_ONE)
    result.assert_outcomes(failed=1, errors=0)
    result.stdout.fnmatch_lines(["*the engine under test failed dcpsim's check*", "*FAIL at step 0*", "*first bad position: 0*"])
    assert "Traceback" not in result.stdout.str()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (("--dcpsim-engine", "nope"), "--dcpsim-engine nope: --engine 'nope'"),
        (("--dcpsim-shard", "3/2"), "--dcpsim-shard: expected K/N"),
        (("--dcpsim-matrix", "tests"), "--dcpsim-matrix: 'tests' is neither a built-in scenario"),
        (("--dcpsim-vllm-source", "/nowhere"), "--dcpsim-engine reference"),
        (("--dcpsim-engine", "sglang", "--dcpsim-sglang-source", "/nowhere"), "--sglang-source /nowhere: no such directory"),
        (("--dcpsim-sglang-source", "/nowhere"), "--sglang-* options are only used with --engine sglang"),
    ],
)
def test_a_bad_option_is_a_usage_error(engine_repo, args, words):
    """In this process: the session ends in ``pytest_configure``, before any test runs."""
    result = engine_repo.runpytest_inprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert words in result.stderr.str()


@pytest.mark.slow
def test_the_matrix_collects_one_item_per_cell_of_dcpsim_matrix(engine_repo):
    """In this process: collecting starts no world."""
    result = engine_repo.runpytest_inprocess("-p", "no:cacheprovider", "--collect-only", "-q", "--dcpsim-matrix")
    lines = result.stdout.lines
    ids = lines[: lines.index("")]  # -q --collect-only: one node id a line, a blank line, the summary
    assert ids == [c.cell.id for c in matrix_cells()]
    assert len(ids) > 400 and "1 deselected" in result.stdout.str()  # the repository's own test


@pytest.mark.slow
def test_the_shards_junit_files_merge_with_a_shard_of_the_command(engine_repo, tmp_path):
    """pytest shard 1/2 of llama-gqa's matrix, and the command's shard 2/2: one matrix, every
    cell an item of its own with its id, passed or skipped as planned. Without pytest-xdist the
    cells of one (scenario, W) share one world (with it: ``test_the_matrix_starts_one_world_per_scenario_and_w``)."""
    engine_repo.makeconftest(WORLD_COUNTER)
    cli = run_cli(["matrix", "llama-gqa", "--in-process", "--shard", "2/2", "--json"], cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    (tmp_path / "shard2.json").write_text(cli.stdout, encoding="utf-8")
    junit = tmp_path / "shard1.xml"
    result = engine_repo.runpytest_subprocess(
        "-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-matrix=llama-gqa", "--dcpsim-shard", "1/2", f"--junitxml={junit}"
    )
    outcomes = result.parseoutcomes()
    cases = _cases(junit)
    assert len(cases) == outcomes["passed"] + outcomes.get("skipped", 0) and outcomes.get("failed", 0) == 0
    everything = matrix_cells(["llama-gqa"])
    shard1 = [c for c in everything if c.cell.id in cases]
    assert cases == {c.cell.id: "passed" if c.status == "pending" else "skipped" for c in shard1}
    per_world: dict[str, int] = {}
    for c in shard1:
        if c.status == "pending":
            per_world[c.cell.group] = per_world.get(c.cell.group, 0) + 1
    assert sorted(_worlds(engine_repo)) == sorted(per_world.items()) and max(per_world.values()) > 1
    merged = tmp_path / "merged.json"
    proc = run_cli(["merge", str(junit), str(tmp_path / "shard2.json"), "--json-out", str(merged)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = json.loads(merged.read_text(encoding="utf-8"))
    assert [c["cell"] for c in cells] == [c.cell.id for c in everything]
    assert [c["status"] for c in cells] == ["pass" if c.status == "pending" else "skipped" for c in everything]


@pytest.mark.slow
def test_failing_cells_fail_their_items_and_merge_as_failed(engine_repo, tmp_path, capsys):
    """The merge in this process (``main``; the command in a process of its own:
    ``test_the_shards_junit_files_merge_with_a_shard_of_the_command``). A JUnit file of part of
    the matrix (``-k``): ``test_a_failing_cell_fails_its_own_item_and_no_other_of_its_world``."""
    junit = tmp_path / "llama-gqa.xml"
    args = ("-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-engine", OFF_BY_ONE, "--dcpsim-matrix=llama-gqa")
    result = engine_repo.runpytest_subprocess(*args, f"--junitxml={junit}")
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] >= 1 and "errors" not in outcomes
    result.stdout.fnmatch_lines(["*FAIL at step 0*"])
    capsys.readouterr()
    assert main(["merge", str(junit)]) == 1
    out = capsys.readouterr().out
    assert sum(" FAIL: " in line for line in out.splitlines()) == outcomes["failed"]


WORLD_COUNTER = """
import os

import dcpsim.harness.runner as runner

_run_jobs = runner.run_jobs


def _counted(jobs, **kwargs):  # every world any pytest process starts: its cells' (scenario, W), how many, the pid
    with open(os.path.join(os.path.dirname(__file__), "worlds.log"), "a") as log:
        log.write(f"{jobs[0].scenario.name}-dcp{jobs[0].world_size} {len(jobs)} {os.getpid()}\\n")
    return _run_jobs(jobs, **kwargs)


runner.run_jobs = _counted
"""

PLANTED = """
from dcpsim.engine.example_plugin import ExampleEngine


class OffByOneAtInterleave2(ExampleEngine):
    name = "off-by-one-at-interleave-2"

    def owner(self, geometry, index):  # OffByOneExampleEngine's bug, at I = 2 only
        shift = 1 if geometry.interleave_size == 2 else 0
        return (index // geometry.interleave_size + shift) % geometry.dcp_size


class BreaksAtInterleave4(ExampleEngine):
    name = "breaks-at-interleave-4"

    def owner(self, geometry, index):  # an exception in the ranks: the cell's world breaks
        if geometry.interleave_size == 4:
            raise RuntimeError("planted: the engine breaks its world at I = 4")
        return super().owner(geometry, index)
"""


def _worlds(pytester) -> list[tuple[str, int]]:
    """The worlds the session's processes started: (scenario-dcpW, cells), in order."""
    lines = (pytester.path / "worlds.log").read_text(encoding="utf-8").splitlines()
    return [(group, int(cells)) for group, cells, _ in (line.split() for line in lines)]


def _cases(junit) -> dict[str, str]:
    """A JUnit file's test cases: name -> passed, failed or skipped."""
    cases = ET.parse(junit).getroot().findall(".//testcase")
    return {
        c.get("name"): ("failed" if c.find("failure") is not None else "skipped" if c.find("skipped") is not None else "passed")
        for c in cases
    }


@pytest.mark.slow
def test_the_matrix_starts_one_world_per_scenario_and_w(engine_repo, tmp_path):
    """Every cell is an item of its own, with its id; the cells of one (scenario, W) share one
    world with pytest-xdist (a world's items go to one worker: none runs twice), here on the
    worlds of W = 1, 2 and 3 (three worlds for two workers; W = 4 and 8 add threads, not
    worlds to share out). Without xdist, and every cell's id: ``test_the_shards_junit_files_merge_with_a_shard_of_the_command``."""
    engine_repo.makeconftest(WORLD_COUNTER)
    junit = tmp_path / "matrix.xml"
    result = engine_repo.runpytest_subprocess(
        "-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-matrix=llama-gqa", "-k", "dcp1- or dcp2- or dcp3-",
        f"--junitxml={junit}", "-n", "2",
    )  # fmt: skip
    cells = [c for c in matrix_cells(["llama-gqa"]) if c.cell.dcp in (1, 2, 3)]
    assert len({c.cell.group for c in cells}) == 3
    pending = [c for c in cells if c.status == "pending"]
    result.assert_outcomes(passed=len(pending), skipped=len(cells) - len(pending))
    assert _cases(junit) == {c.cell.id: "passed" if c.status == "pending" else "skipped" for c in cells}
    per_world: dict[str, int] = {}
    for c in pending:
        per_world[c.cell.group] = per_world.get(c.cell.group, 0) + 1
    assert sorted(_worlds(engine_repo)) == sorted(per_world.items())
    assert max(per_world.values()) > 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, bad, text",
    [
        ("OffByOneAtInterleave2", "llama-gqa-dcp2-il2-bs16", "*FAIL at step 0*"),
        ("BreaksAtInterleave4", "llama-gqa-dcp2-il4-bs16", "*rank ? failed: RuntimeError: planted: the engine breaks its world at I = 4*"),
    ],
)
def test_a_failing_cell_fails_its_own_item_and_no_other_of_its_world(engine_repo, tmp_path, capsys, engine, bad, text):
    """A cell that fails its check, or breaks its world, in the middle of its world's cells:
    its item fails with its own text, the others of the world pass; a broken world's cells
    that had not ended are rerun each in a world of its own (``harness.runner.run_each``).
    ``-k`` left out the other worlds' cells: merge says the matrix is not whole."""
    engine_repo.makeconftest(WORLD_COUNTER)
    engine_repo.makepyfile(planted=PLANTED)
    junit = tmp_path / "matrix.xml"
    result = engine_repo.runpytest_subprocess(
        "-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-engine", f"planted:{engine}", "--dcpsim-matrix=llama-gqa",
        "-k", "dcp2", f"--junitxml={junit}",
    )  # fmt: skip
    world = [c.cell.id for c in matrix_cells(["llama-gqa"]) if c.cell.group == "llama-gqa-dcp2"]
    assert bad in world[1:-1]
    assert _cases(junit) == {cell: "failed" if cell == bad else "passed" for cell in world}
    result.stdout.fnmatch_lines([f"*_ dcpsim matrix cell {bad} _*", text])
    worlds = _worlds(engine_repo)
    assert worlds[0] == ("llama-gqa-dcp2", len(world))  # one world for the five cells
    assert worlds[1:] == ([] if engine.startswith("OffByOne") else [("llama-gqa-dcp2", 1)] * len(worlds[1:]))
    capsys.readouterr()
    assert main(["merge", str(junit)]) == 2
    cells = len(matrix_cells(["llama-gqa"]))
    assert f"the shards hold {len(world)} of the matrix's {cells} cells" in capsys.readouterr().err


BATCH_BREAKS = """
import importlib

api_matrix = importlib.import_module("dcpsim.api.matrix")  # the module (dcpsim.api's attribute matrix is the function)

_run_cells = api_matrix.run_cells


def _breaks_after_the_first(results, options, progress=None):  # something outside the worlds breaks a batch
    if len(results) == 1:
        return _run_cells(results, options, progress)
    _run_cells(results[:1], options, progress)
    raise RuntimeError("planted: the batch breaks after its first cell")


api_matrix.run_cells = _breaks_after_the_first
"""


@pytest.mark.slow
def test_a_batch_that_breaks_outside_its_world_runs_the_rest_one_world_each(engine_repo, tmp_path):
    """The cells of a batch that breaks off outside the worlds: the ones that ended keep their
    verdicts, the others run each in a world of its own as their items come, with a warning."""
    engine_repo.makeconftest(WORLD_COUNTER + BATCH_BREAKS)
    junit = tmp_path / "matrix.xml"
    result = engine_repo.runpytest_subprocess(
        "-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-matrix=llama-gqa", "-k", "dcp2", f"--junitxml={junit}"
    )
    world = [c.cell.id for c in matrix_cells(["llama-gqa"]) if c.cell.group == "llama-gqa-dcp2"]
    assert _cases(junit) == dict.fromkeys(world, "passed")
    assert _worlds(engine_repo) == [("llama-gqa-dcp2", 1)] * len(world)
    result.stdout.fnmatch_lines(["*dcpsim: the cells of world llama-gqa-dcp2 broke off (RuntimeError('planted: the batch breaks*"])
