"""``matrix --shard K/N``, ``--junit`` and ``dcpsim merge``: the partition, the shard records,
the JUnit content, and every way a set of shards can fail to be one matrix."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcpsim.campaigns import junit
from dcpsim.campaigns import matrix as mx
from dcpsim.campaigns.shard import UNIT, matrix_hash, merge, parse_shard, partition, select, stamp, unit_cost, work_units
from dcpsim.cli import main
from dcpsim.errors import ConfigError

BROKEN = "dcpsim.engine.example_plugin:OffByOneExampleEngine"
SMALL = ["dsv3", "--dcp", "1,2", "--interleave", "1,4", "--in-process"]  # 4 cells: 3 run, 1 skipped


def fake_cells(spec: list[tuple[int, int, bool]]) -> list[mx.CellResult]:
    """Cells of worlds ``(scenario number, W)``, each pending or skipped."""
    out = []
    for j, (scenario, w, pending) in enumerate(spec):
        status = mx.CellStatus.PENDING if pending else mx.CellStatus.SKIPPED
        out.append(mx.CellResult(mx.Cell(f"s{scenario}", w, j, 64), status))
    return out


CELL_LISTS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8), st.booleans()), max_size=120)


@given(CELL_LISTS, st.integers(1, 12))
def test_the_shards_partition_the_cells_into_balanced_world_units(spec, n):
    cells = fake_cells(spec)
    units = work_units(cells)
    if n > max(len(units), 1):
        with pytest.raises(ConfigError, match="work unit"):
            select(cells, 1, n)
        return
    shards = [select(cells, k, n) for k in range(1, n + 1)]
    assert sorted(i for s in shards for i in s) == list(range(len(cells))), "union = all, each once"
    owner = {i: k for k, s in enumerate(shards) for i in s}
    for unit in units:  # a unit is one world's cells, never split over shards
        assert len({owner[i] for i in unit}) == 1 and len({cells[i].cell.group for i in unit}) == 1
        assert len(unit) <= UNIT
    loads = [sum(cells[i].cell.dcp for i in s if cells[i].status == "pending") for s in shards]
    biggest = max((unit_cost(cells, u) for u in units), default=0)
    assert max(loads) - min(loads) <= biggest, "greedy balance: within one unit"
    assert partition(list(reversed(cells)), n) != [] and select(cells, 1, n) == shards[0], "deterministic"


@pytest.mark.parametrize("text", ["0/2", "3/2", "1/0", "2", "a/b", "1/2/3", "-1/2", ""])
def test_a_bad_shard_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--shard: expected K/N with 1 <= K <= N"):
        parse_shard(text)


@pytest.mark.parametrize("argv", [["--shard", "0/2"], ["--shard", "3/2"], ["--shard", "x"], ["--shard", "3/3"], ["--full", "--dcp", "2"]])
def test_matrix_refuses_a_bad_shard_or_grid_before_running(capsys, argv):
    args = ["matrix", "dsv3", "--dcp", "1,2", "--interleave", "1,4"]
    if argv[0] == "--full":
        args = ["matrix", "dsv3"]
    assert main(args + argv) == 2
    err = capsys.readouterr().err
    assert "to run" not in err, "nothing ran"
    assert ("--shard" in err) or ("--full fixes the grid: drop --dcp" in err), err
    if argv == ["--shard", "3/3"]:
        assert "only 2 work units (runs of at most 12 cells of one world) to share out; use N <= 2" in err


def test_the_hash_names_the_cell_list_and_the_engine():
    assert matrix_hash(["a", "b"]) == matrix_hash(["a", "b"])
    assert len({matrix_hash(["a", "b"]), matrix_hash(["b", "a"]), matrix_hash(["a"]), matrix_hash(["a", "b"], {"engine": "vllm"})}) == 4


def shard_run(capsys, tmp_path, k: int, n: int, *extra: str) -> tuple[int, list[dict], ET.Element]:
    xml_path = tmp_path / f"shard{k}.xml"
    code = main(["matrix", *SMALL, "--shard", f"{k}/{n}", "--json", "--junit", str(xml_path), *extra])
    out = capsys.readouterr().out
    (tmp_path / f"shard{k}.json").write_text(out)
    return code, json.loads(out), ET.parse(xml_path).getroot()


def test_shards_run_their_cells_and_merge_back_into_the_matrix(capsys, tmp_path):
    code1, cells1, xml1 = shard_run(capsys, tmp_path, 1, 2)
    code2, cells2, xml2 = shard_run(capsys, tmp_path, 2, 2)
    assert (code1, code2) == (0, 0)
    # the W = 2 world (cost 2 x 2) goes to shard 1, the W = 1 one to shard 2; the skipped cell round-robin
    assert [(c["index"], c["cell"], c["status"]) for c in cells1] == [
        (1, "dsv3-dcp1-il4-bs64", "skipped"),
        (2, "dsv3-dcp2-il1-bs64", "pass"),
        (3, "dsv3-dcp2-il4-bs64", "pass"),
    ]
    assert [(c["index"], c["cell"], c["status"]) for c in cells2] == [(0, "dsv3-dcp1-il1-bs64", "pass")]
    meta = {json.dumps(c["matrix"], sort_keys=True) for c in cells1 + cells2}
    assert len({json.loads(m)["hash"] for m in meta}) == 1 and {json.loads(m)["cells"] for m in meta} == {4}
    assert cells1[2]["report"]["interleave_size"] == 4 and cells1[2]["report"]["passed"] is True

    suite = xml1.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "0", "1")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["dsv3-dcp1-il4-bs64", "dsv3-dcp2-il1-bs64", "dsv3-dcp2-il4-bs64"]
    assert cases[0].find("skipped").get("message").startswith("same layout as dsv3-dcp1-il1-bs64")
    assert cases[2].find("failure") is None and float(cases[2].get("time")) > 0
    assert {p.get("name"): p.get("value") for p in cases[2].iter("property")}["dcpsim.index"] == "3"

    # JSON and JUnit shards mix; the merged outputs hold the whole matrix in order
    out_json, out_xml = tmp_path / "all.json", tmp_path / "all.xml"
    assert (
        main(
            ["merge", str(tmp_path / "shard1.xml"), str(tmp_path / "shard2.json"), "--json-out", str(out_json), "--junit-out", str(out_xml)]
        )
        == 0
    )
    assert "merged 2 shards: 4 cells: 3 passed, 0 failed, 0 errors, 1 skipped" in capsys.readouterr().out
    merged = json.loads(out_json.read_text())
    assert [c["cell"] for c in merged] == ["dsv3-dcp1-il1-bs64", "dsv3-dcp1-il4-bs64", "dsv3-dcp2-il1-bs64", "dsv3-dcp2-il4-bs64"]
    assert merged[0]["report"]["dcp_size"] == 1 and merged[2]["report"] is None, "JSON shards keep their reports"
    assert all("matrix" not in c and "index" not in c for c in merged)
    root = ET.parse(out_xml).getroot()
    assert [c.get("name") for c in root.iter("testcase")] == [c["cell"] for c in merged]
    assert root.find("testsuite").get("tests") == "4"
    # a merged report is a matrix report: replay picks its cells
    assert main(["replay", str(out_json), "--cell", "dsv3-dcp1-il1-bs64", "--in-process"]) == 0


def test_a_failing_cell_is_a_junit_failure_and_merge_exits_1(capsys, tmp_path):
    code1, cells1, xml1 = shard_run(capsys, tmp_path, 1, 2, "--engine", BROKEN)
    code2, cells2, _ = shard_run(capsys, tmp_path, 2, 2, "--engine", BROKEN)
    assert code1 == 1, "the W = 2 cells fail"
    failed = xml1.find("testsuite").findall("testcase")[2]
    assert failed.get("name") == "dsv3-dcp2-il4-bs64"
    node = failed.find("failure")
    assert node is not None and node.get("message") == cells1[2]["reason"] and cells1[2]["status"] == "fail"
    assert "scenario dsv3" in node.text and "decode_context_parallel_size=2 cp_kv_cache_interleave_size=4" in node.text, (
        "the body is the failure report"
    )
    assert main(["merge", str(tmp_path / "shard1.xml"), str(tmp_path / "shard2.json")]) == 1
    out = capsys.readouterr().out
    assert "dsv3-dcp2-il4-bs64 FAIL:" in out and "0 errors" in out
    # the engine is part of the matrix: a broken-engine shard does not merge with a reference one
    shard_run(capsys, tmp_path, 2, 2)
    assert main(["merge", str(tmp_path / "shard1.xml"), str(tmp_path / "shard2.json")]) == 2
    assert "are not shards of one matrix: hash" in capsys.readouterr().err


def fake_shards(total: int, n: int, digest: str = "h1") -> list[tuple[str, list[dict]]]:
    out = []
    for k in range(1, n + 1):
        indices = [i for i in range(total) if i % n == k - 1]
        entries = [{"cell": f"c{i}", "status": "pass", "reason": "", "seconds": 0.1, "report": None} for i in indices]
        stamp(entries, indices, digest=digest, total=total, shard=(k, n))
        out.append((f"s{k}.json", entries))
    return out


def test_merge_round_trips_the_cells_in_order():
    shards = fake_shards(10, 3)
    assert [c["cell"] for c in merge(list(reversed(shards)))] == [f"c{i}" for i in range(10)]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda s: s[:2], "missing 1 shard of 3: 3/3"),
        (lambda s: s[:1], "missing 2 shards of 3: 2/3, 3/3"),
        (lambda s: s + [s[0]], "shard 1/3 given twice: s1.json and s1.json"),
        (lambda s: s[:2] + fake_shards(10, 3, "h2")[2:], "s3.json and s1.json are not shards of one matrix: hash h2 vs h1"),
        (lambda s: s[:2] + fake_shards(11, 3)[2:], "11 vs 10 cells"),
        (lambda s: fake_shards(10, 2)[:1] + s[1:], "not shards of one matrix"),
        (
            lambda s: [(s[0][0], s[0][1] + [dict(s[1][1][0], matrix=s[0][1][0]["matrix"])])] + s[1:],
            "cell 'c1' (index 1) is in both s1.json and s2.json",
        ),
        (lambda s: [(s[0][0], s[0][1][:-1] + [dict(s[0][1][-1], index=12)])] + s[1:], "s1.json: cell 'c9' has index 12, outside"),
        (lambda s: [(s[0][0], [{"cell": "c0", "status": "pass"}])] + s[1:], "s1.json: cell 'c0' has no matrix shard record"),
        (lambda s: [(s[0][0], [])] + s[1:], "s1.json: not a matrix shard report"),
        (lambda s: [], "merge: no shard reports given"),
    ],
)
def test_merge_refuses_shards_that_are_not_one_matrix(damage, message):
    with pytest.raises(ConfigError) as info:
        merge(damage(copy.deepcopy(fake_shards(10, 3))))
    assert message in str(info.value)


def test_merge_cli_names_unreadable_files(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["merge", str(bad)]) == 2
    assert "bad.json: neither a matrix --json report nor JUnit XML" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: no such report file" in capsys.readouterr().err
    broken_xml = tmp_path / "bad.xml"
    broken_xml.write_text("<testsuites><testsuite>")
    assert main(["merge", str(broken_xml)]) == 2
    assert "bad.xml: not a JUnit XML report" in capsys.readouterr().err


def test_junit_counts_every_status():
    entries = [
        {"cell": "a-dcp2-il1-bs8", "status": "pass", "reason": "", "seconds": 0.5},
        {"cell": "a-dcp2-il2-bs8", "status": "fail", "reason": "wrong content", "seconds": 0.25},
        {"cell": "b-dcp4-il1-bs8", "status": "error", "reason": "rank 1 died", "seconds": 1.0},
        {"cell": "b-dcp1-il2-bs8", "status": "skipped", "reason": "same layout", "seconds": 0.0},
    ]
    root = junit.to_xml(entries, details={"a-dcp2-il2-bs8": "the whole report"}).getroot()
    suite = root.find("testsuite")
    assert {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")} == {
        "tests": "4",
        "failures": "1",
        "errors": "1",
        "skipped": "1",
        "time": "1.750",
    }
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert cases["a-dcp2-il2-bs8"].find("failure").text == "the whole report"
    assert cases["b-dcp4-il1-bs8"].find("error").get("message") == "rank 1 died"
    assert cases["b-dcp4-il1-bs8"].get("classname") == "dcpsim.matrix.b"
    assert cases["a-dcp2-il1-bs8"].find("failure") is None and cases["a-dcp2-il1-bs8"].find("properties") is None
