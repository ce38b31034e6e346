"""``dcpsim layout --from-report``: real failing reports drawn around their first bad index,
and every way a file can fail to be one (exit 2 naming the file)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import xml.etree.ElementTree as ET

import pytest

from dcpsim.cli import main
from support.helpers import builtin, run

pytest.importorskip("matplotlib")

SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """Real reports: the command line's own (dsv3 W=4, interleave-off-by-one: ``main``'s JSON on
    stdout, in this process; a subprocess cost each xdist worker 2.3 s of Python start-up) and,
    through the same rank code in threads, a compressed group, a write violation, a released
    window block and a pass."""
    root = tmp_path_factory.mktemp("reports")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["run", "dsv3", "--dcp", "4", "--inject", "interleave-off-by-one", "--json", "--in-process"])
    assert code == 1, stdout.getvalue()
    out = {"dsv3": root / "dsv3.json"}
    out["dsv3"].write_text(stdout.getvalue())
    for name, scenario, W, fault in (
        ("records", "dsv41-hybrid", 2, "interleave-off-by-one"),
        ("violation", "dsv3", 2, "foreign-block"),
        ("window", "dsv41-hybrid", 2, "sliding-window-early-release"),
        ("pass", "dsv3", 2, None),
    ):
        out[name] = root / f"{name}.json"
        out[name].write_text(run(builtin(scenario, W, 1), inject=fault).to_json())
    return out


def layout(capsys, *argv):
    code = main(["layout", *map(str, argv)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def svg(capsys, tmp_path, report, *extra):
    path = tmp_path / "failure.svg"
    layout(capsys, "--from-report", report, "--svg", path, *extra)
    return {el.get("id"): el for el in ET.parse(path).getroot().iter() if el.get("id")}


def xs(group) -> list[float]:
    d = next(group.iter(f"{SVG_NS}path")).get("d")
    return [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", d)][0::2]


def text_of(group) -> str:
    return "".join(t.text or "" for t in group.iter(f"{SVG_NS}text"))


def notes(ids) -> str:
    return "\n".join(text_of(ids[g]) for g in sorted(ids) if g.startswith("note-"))


@pytest.mark.slow
def test_real_report_text_names_expected_and_actual(capsys, reports):
    path = reports["dsv3"]
    f = json.loads(path.read_text())["failure"]
    assert (f["index"], f["expected_owner"], f["expected_slot"], f["block_table"]) == (0, 0, 64, [1])
    lines = layout(capsys, "--from-report", path).splitlines()
    assert lines[0].startswith(f"failure in {path} (scenario dsv3): wrong-content at step 0")
    assert "  expected: position 0 on rank 0, slot 64 (report)" in lines
    assert "  rank 0 slot 64 holds position 3 of chat-0 (step 0)" in lines
    # the entry went to rank 1's slot 64, where the layout keeps position 1 (off by one rank)
    assert "  actual: rank 1 holds position 0 at slot 64; the layout puts position 1 there" in lines
    assert "  block table: the request's row from the report, [1]" in lines
    assert "DCP layout: W=4 I=1 B=64 Bk=64 replicated=no block_table=[1]" in lines
    assert "window of 32 positions 0..31 around position 0" in lines
    assert "        ^ position 0" in lines
    d = json.loads(layout(capsys, "--from-report", path, "--json"))
    assert d["slots"]["0"][d["positions"].index(0)] == f["expected_slot"]  # the layout agrees with the checker
    assert d["slots"]["1"][d["positions"].index(1)] == f["holdings"][1]["found_at"][0]
    assert d["failure"]["kind"] == "wrong-content" and d["failure"]["block_table_from_report"] is True
    assert [(m["kind"], m["rank"], m["x0"]) for m in d["failure"]["marks"]] == [("expected", 0, 0), ("holds", 0, 0), ("actual", 1, 1)]


def test_real_report_svg_marks_the_expected_and_the_actual_cell(capsys, tmp_path, reports):
    ids = svg(capsys, tmp_path, reports["dsv3"])
    assert min(xs(ids["expected"])) == pytest.approx(min(xs(ids["cell-r0-p0"])))
    assert min(xs(ids["actual-0"])) == pytest.approx(min(xs(ids["cell-r1-p1"])))
    assert max(xs(ids["actual-0"])) == pytest.approx(max(xs(ids["cell-r1-p1"])))
    assert text_of(ids["slot-r1-p1"]) == "64" and text_of(ids["slot-r0-p0"]) == "64"
    tags = {text_of(ids[g]) for g in ids if g.startswith("tag-")}
    assert tags == {"expected (r0)", "holds 3 (r0)", "actual (r1)"}
    assert text_of(ids["title"]).startswith("dsv3: wrong-content at step 0, group MLAAttention[")
    assert "first bad position 0" in text_of(ids["title"])
    assert "block table: the request's row from the report, [1]" in notes(ids)
    assert [text_of(ids[f"lane-label-{r}"]) for r in range(4)] == [f"rank {r}" for r in range(4)]


def test_a_compressed_group_is_drawn_in_records(capsys, tmp_path, reports):
    report = json.loads(reports["records"].read_text())
    f = report["failure"]
    assert f["index_kind"] == "record" and f["expected_owner"] == 0
    d = json.loads(layout(capsys, "--from-report", reports["records"], "--json"))
    assert d["index_kind"] == "record" and d["config"]["tokens_per_state"] == 2
    assert d["around"] == 2 * f["index"] + 1  # centred on the position that emits the record
    col = d["records"].index(f["index"])
    assert d["slots"]["0"][col] == f["expected_slot"]
    (found,) = [h for h in f["holdings"] if h["found_at"]]
    where = d["records"][d["slots"][str(found["rank"])].index(found["found_at"][0])]
    ids = svg(capsys, tmp_path, reports["records"])
    assert min(xs(ids["expected"])) == pytest.approx(min(xs(ids[f"cell-r0-c{f['index']}"])))
    assert min(xs(ids["actual-0"])) == pytest.approx(min(xs(ids[f"cell-r{found['rank']}-c{where}"])))
    assert "tokens_per_state R = 2" in notes(ids)


def test_a_write_violation_marks_writes_outside_the_table(capsys, reports):
    f = json.loads(reports["violation"].read_text())["failure"]
    assert f["kind"] == "write-violation" and f["block_table"] == [1, 2]
    d = json.loads(layout(capsys, "--from-report", reports["violation"], "--json"))
    marks = d["failure"]["marks"]
    assert [(m["kind"], m["rank"], m["exact"]) for m in marks] == [("expected", 0, True), ("actual", 0, False), ("actual", 1, False)]
    assert marks[0]["label"].startswith("expected (layout model): position 128 on rank 0, slot 128")
    assert "slot 192: not in the request's block table" in marks[1]["label"]
    assert marks[2]["x0"] == 129  # rank 1's first bad write, in its own cell


def test_a_released_window_block_is_the_null_block(capsys, tmp_path, reports):
    f = json.loads(reports["window"].read_text())["failure"]
    assert f["expected_owner"] == "all" and f["block_table"][2] == 0  # position 129's entry was released
    ids = svg(capsys, tmp_path, reports["window"])
    assert text_of(ids["entry-label-2"]) == "entry 2: null block 0"
    for r in range(2):  # replicated: the expected cell is on every lane, with the report's slot
        assert min(xs(ids[f"expected-r{r}"])) == pytest.approx(min(xs(ids[f"cell-r{r}-p129"])))
        assert text_of(ids[f"slot-r{r}-p129"]) == str(f["expected_slot"])
    assert "hatched: the null block" in notes(ids)
    assert "slot 193: not in the request's block table" in notes(ids)


def test_a_report_without_a_block_table_says_what_is_assumed(capsys, tmp_path, reports):
    data = json.loads(reports["dsv3"].read_text())
    del data["failure"]["block_table"]  # as written before reports carried it
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    out = layout(capsys, "--from-report", path)
    assert "  block table not in the report: assumed [1] (1..n); the slots drawn may differ" in out
    ids = svg(capsys, tmp_path, path)
    assert "block table not in the report: assumed [1]" in notes(ids)
    assert "actual? (r1)" in {text_of(ids[g]) for g in ids if g.startswith("tag-")}
    assert min(xs(ids["actual-0"])) == pytest.approx(min(xs(ids["cell-r0-p0"])))  # at the index, in rank 1's lane


def test_a_matrix_report_shows_its_first_failing_cell(capsys, tmp_path, reports):
    failing = json.loads(reports["dsv3"].read_text())
    passing = json.loads(reports["pass"].read_text())
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps([{"cell": "a", "status": "pass", "report": passing}, {"cell": "b", "status": "fail", "report": failing}]))
    assert "expected: position 0 on rank 0, slot 64 (report)" in layout(capsys, "--from-report", path)


def test_window_and_around_apply_to_a_report(capsys, reports):
    d = json.loads(layout(capsys, "--from-report", reports["dsv3"], "--window", "8", "--json"))
    assert d["positions"] == list(range(8))
    d = json.loads(layout(capsys, "--from-report", reports["dsv3"], "--around", "40", "--json"))
    assert d["positions"] == list(range(24, 56))


def test_an_attention_mismatch_is_centred_on_its_query_position(capsys, tmp_path, reports):
    good = json.loads(reports["dsv3"].read_text())
    f = {
        **good["failure"],
        "kind": "attention-mismatch",
        "index": None,
        "expected_owner": None,
        "holdings": [],
        "query_position": 70,
        "head": 4,
        "error": "inf",
        "contributions": [{"rank": r, "keys": 0, "lse": "-inf"} for r in range(4)],
    }
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({**good, "failure": f}))
    d = json.loads(layout(capsys, "--from-report", path, "--json"))
    assert d["around"] == 70 and d["positions"] == list(range(54, 86))
    assert [(m["kind"], m["rank"], m["x0"]) for m in d["failure"]["marks"]] == [("query", None, 70)]
    ids = svg(capsys, tmp_path, path)
    for r in range(4):
        assert min(xs(ids[f"query-r{r}"])) == pytest.approx(min(xs(ids["cell-r2-p70"])))
    assert "rank 3: 0 keys visible, lse -inf" in notes(ids)


def _bad(tmp_path, reports, what):
    path = tmp_path / "bad.json"
    good = json.loads(reports["dsv3"].read_text())
    if what == "missing":
        return tmp_path / "nope.json"
    if what == "pass":
        return reports["pass"]
    content = {
        "not json": "{not json",
        "not a report": json.dumps({"cells": 3}),
        "list": json.dumps([{"cell": "a", "status": "pass", "report": json.loads(reports["pass"].read_text())}]),
        "error": json.dumps({"error": {"kind": "ScenarioError", "message": "x.toml: bad"}, "exit_code": 2}),
        "no index": json.dumps(
            {**good, "failure": {**good["failure"], "kind": "block-table-overflow", "index": None, "query_position": None}}
        ),
        "ring": json.dumps({**good, "groups": [{**good["groups"][0], "storage": "ring"}]}),
        "no group": json.dumps({**good, "failure": {**good["failure"], "group": None}}),
        "bad W": json.dumps({**good, "dcp_size": "four"}),
        "bad holding": json.dumps({**good, "failure": {**good["failure"], "holdings": [{"rank": 0, "slot": "x"}]}}),
    }[what]
    path.write_text(content)
    return path


@pytest.mark.parametrize(
    "what, needle",
    [
        ("missing", "no such report file"),
        ("not json", "not a JSON report"),
        ("not a report", "not a dcpsim run report (missing scenario, dcp_size"),
        ("pass", "the report has no failure (scenario dsv3 passed); nothing to draw"),
        ("list", "no failing cell with a report in this matrix report"),
        ("error", "the run ended with an error before anything was verified (x.toml: bad)"),
        ("no index", "a block-table-overflow failure has no bad index to draw"),
        ("ring", "is in ring group"),
        ("no group", "names no group of the report"),
        ("bad W", "dcp_size must be an integer >= 1, got 'four'"),
        ("bad holding", "failure.holdings[0].slot must be an integer >= -1, got 'x'"),
    ],
)
def test_unusable_reports_are_exit_2_naming_the_file(capsys, tmp_path, reports, what, needle):
    path = _bad(tmp_path, reports, what)
    assert main(["layout", "--from-report", str(path), "--png", str(tmp_path / "x.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"dcpsim: error: {path}: ") and needle in err
    assert not (tmp_path / "x.png").exists()


def test_layout_flags_do_not_mix_with_a_report(capsys, reports):
    assert main(["layout", "--from-report", str(reports["dsv3"]), "--dcp", "2", "--block-table", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "--from-report takes the layout from the report; drop --decode-context-parallel-size, --block-table" in err
