"""The pytest plugin (``dcpsim.pytest_plugin``, the ``pytest11`` entry point), in a folder
outside this repository (``pytester``, pytest in a subprocess): the fixture, the engine
options, the matrix items, their shards and their JUnit files, which ``dcpsim merge`` joins."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from dcpsim.campaigns.matrix_plan import matrix_cells
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
def test_the_fixture_passes_with_the_reference_engine(engine_repo):
    result = engine_repo.runpytest_subprocess("-p", "no:cacheprovider", "--dcpsim-in-process")
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_a_broken_engine_fails_the_test_with_the_text_report(engine_repo):
    result = engine_repo.runpytest_subprocess("-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-engine", OFF_BY_ONE)
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
    result = engine_repo.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert words in result.stderr.str()


@pytest.mark.slow
def test_the_matrix_collects_one_item_per_cell_of_dcpsim_matrix(engine_repo):
    result = engine_repo.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q", "--dcpsim-matrix")
    lines = result.stdout.lines
    ids = lines[: lines.index("")]  # -q --collect-only: one node id a line, a blank line, the summary
    assert ids == [c.cell.id for c in matrix_cells()]
    assert len(ids) > 400 and "1 deselected" in result.stdout.str()  # the repository's own test


@pytest.mark.slow
def test_the_shards_junit_files_merge_with_a_shard_of_the_command(engine_repo, tmp_path):
    """pytest shard 1/2 of llama-gqa's matrix, and the command's shard 2/2: one matrix."""
    cli = run_cli(["matrix", "llama-gqa", "--in-process", "--shard", "2/2", "--json"], cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    (tmp_path / "shard2.json").write_text(cli.stdout, encoding="utf-8")
    junit = tmp_path / "shard1.xml"
    result = engine_repo.runpytest_subprocess(
        "-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-matrix=llama-gqa", "--dcpsim-shard", "1/2", f"--junitxml={junit}"
    )
    outcomes = result.parseoutcomes()
    cases = ET.parse(junit).getroot().findall(".//testcase")
    assert len(cases) == outcomes["passed"] + outcomes.get("skipped", 0) and outcomes.get("failed", 0) == 0
    merged = tmp_path / "merged.json"
    proc = run_cli(["merge", str(junit), str(tmp_path / "shard2.json"), "--json-out", str(merged)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = json.loads(merged.read_text(encoding="utf-8"))
    assert [c["cell"] for c in cells] == [c.cell.id for c in matrix_cells(["llama-gqa"])]


@pytest.mark.slow
def test_failing_cells_fail_their_items_and_merge_as_failed(engine_repo, tmp_path):
    junit = tmp_path / "llama-gqa.xml"
    args = ("-p", "no:cacheprovider", "--dcpsim-in-process", "--dcpsim-engine", OFF_BY_ONE, "--dcpsim-matrix=llama-gqa")
    result = engine_repo.runpytest_subprocess(*args, f"--junitxml={junit}")
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] >= 1 and "errors" not in outcomes
    result.stdout.fnmatch_lines(["*FAIL at step 0*"])
    proc = run_cli(["merge", str(junit)])
    assert proc.returncode == 1, proc.stderr
    assert sum(" FAIL: " in line for line in proc.stdout.splitlines()) == outcomes["failed"]
    # -k leaves out cells: merge says the matrix is not whole
    result = engine_repo.runpytest_subprocess(*args, "-k", "dcp2-il1-", f"--junitxml={junit}")
    result.assert_outcomes(failed=1)
    proc = run_cli(["merge", str(junit)])
    assert proc.returncode == 2 and "the shards hold 1 of the matrix's 25 cells" in proc.stderr
