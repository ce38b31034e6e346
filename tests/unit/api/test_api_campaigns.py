"""``dcpsim.matrix``, ``dcpsim.selftest`` and ``dcpsim.layout``: the cells, rows and views of
the commands, as typed results whose ``to_json()`` is the command's ``--json`` document."""

from __future__ import annotations

import json

import pytest

import dcpsim
from support.helpers import without_timings


def _cells(entries: list[dict]) -> list[dict]:
    """A matrix --json list without what is measured."""
    return [{**{k: v for k, v in e.items() if k != "seconds"}, "report": e["report"] and without_timings(e["report"])} for e in entries]


@pytest.mark.slow
def test_matrix_gives_the_cells_of_the_command(run_json):
    flags = ("--dcp", "1,2", "--interleave", "1,B", "--shard", "1/2")
    code, cli = run_json("matrix", "llama-gqa", "dsv3", "--in-process", *flags)
    seen = []
    report = dcpsim.matrix(["llama-gqa", "dsv3"], dcp=[1, 2], interleave=[1, "B"], shard="1/2", in_process=True, progress=seen.append)
    assert _cells(json.loads(report.to_json())) == _cells(cli)
    assert [c.id for c in report.cells] == [e["cell"] for e in cli]
    assert report.passed and code == 0
    assert {c.id for c in seen} == {c.id for c in report.cells if c.status != "skipped"}
    assert all(c.report.passed for c in report.cells if c.status == "pass")
    assert {e["matrix"]["shard"] for e in cli} == {"1/2"}


@pytest.mark.slow
def test_matrix_fails_when_a_cell_fails():
    engine = "dcpsim.engine.example_plugin:OffByOneExampleEngine"
    report = dcpsim.matrix(["dsv3"], dcp=[2], interleave=[1], engine=engine, in_process=True)
    (cell,) = report.cells
    assert not report.passed and cell.status == "fail" and cell.report.failure.kind == "wrong-content"
    assert cell.id == "dsv3-dcp2-il1-bs64" and cell.id in report.text()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(dcp=[0]), "--dcp: decode_context_parallel_size must be an integer >= 1, got 0"),
        (dict(dcp=[2], interleave=[1, 0]), "--interleave: cp_kv_cache_interleave_size must be an integer >= 1, got 0 (in 1,0)"),
        (dict(full=True, dcp=[2]), "--full fixes the grid: drop --dcp"),
        (dict(shard="3/2"), "--shard: expected K/N"),
        (dict(bogus=1), "unknown option(s) 'bogus'"),
    ],
)
def test_matrix_refuses_a_bad_grid(kwargs, words):
    with pytest.raises(dcpsim.ConfigError) as caught:
        dcpsim.matrix(["dsv3"], in_process=True, **kwargs)
    assert words in str(caught.value)


@pytest.mark.slow
def test_selftest_gives_the_verdict_of_the_command(run_json):
    code, cli = run_json("selftest", "--fault", "interleave-off-by-one", "--scenario", "dsv3", "--in-process")
    report = dcpsim.selftest(["interleave-off-by-one"], ["dsv3"], in_process=True)
    doc = report.to_dict()
    assert report.passed and code == 0 and report.faults == {"interleave-off-by-one": "detected"} == cli["faults"]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(doc["rows"]) == strip(cli["rows"]) and doc["summary"] == cli["summary"]
    assert doc["schema_version"] == cli["schema_version"] == 1
    assert "selftest PASSED" in report.text()


def test_layout_gives_the_view_of_the_command(run_json):
    code, cli = run_json("layout", "--dcp", "4", "--interleave", "2", "--block-size", "16", "--positions", "0:40")
    view = dcpsim.layout(dcp=4, interleave=2, block_size=16, positions="0:40")
    assert code == 0 and view.to_dict() == cli
    assert dcpsim.layout(dcp=4, interleave=2, block_size=16, positions=range(40)).to_dict()["positions"] == cli["positions"]
    assert "rank" in view.text()
    with pytest.raises(dcpsim.ConfigError, match="needs dcp and block_size"):
        dcpsim.layout(dcp=4)


@pytest.mark.slow
def test_layout_from_a_report_file_shows_its_failure(tmp_path, run_json):
    report = dcpsim.run("dsv3", dcp=4, interleave=4, inject="interleave-off-by-one", in_process=True)
    path = tmp_path / "report.json"
    path.write_text(report.to_json(), encoding="utf-8")
    code, cli = run_json("layout", "--from-report", str(path), "--window", "32")
    view = dcpsim.layout(from_report=path, window=32)
    assert view.to_dict() == cli and cli["failure"]["index"] == report.failure.first_bad_index
    picture = view.draw(tmp_path / "failure.svg")
    assert picture.read_text(encoding="utf-8").lstrip().startswith("<?xml")
