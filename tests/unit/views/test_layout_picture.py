"""``dcpsim layout --svg/--png``: the picture's content against the numbers of the layout.

SVG: artists are found by their ids (``set_gid``) and their coordinates compared with each
other; PNG: the pixels of each rank's colour, lane by lane.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from dcpsim.cli import main

pytest.importorskip("matplotlib")  # the test extra installs it; the command itself needs the views extra

from matplotlib.colors import to_rgb
from matplotlib.image import imread

from dcpsim.views.layout_picture import RANK_COLOURS

SVG_NS = "{http://www.w3.org/2000/svg}"
DOC = ["layout", "--dcp", "2", "--interleave", "4", "--block-size", "16", "--positions", "0:40", "--block-table", "5,6"]


def layout_json(capsys, argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def draw(capsys, tmp_path, argv, fmt="svg"):
    path = tmp_path / f"view.{fmt}"
    assert main([*argv, f"--{fmt}", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out
    return path


def svg_ids(path) -> dict[str, ET.Element]:
    return {el.get("id"): el for el in ET.parse(path).getroot().iter() if el.get("id")}


def xs(group: ET.Element) -> list[float]:
    """The x coordinates of the first path inside an artist's group."""
    d = next(group.iter(f"{SVG_NS}path")).get("d")
    nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", d)]
    return nums[0::2]


def text_of(group: ET.Element) -> str:
    return "".join(t.text or "" for t in group.iter(f"{SVG_NS}text"))


def cells(ids, prefix="p") -> dict[int, set[int]]:
    """rank -> indices of the cells drawn in its lane."""
    out: dict[int, set[int]] = {}
    for gid in ids:
        m = re.fullmatch(rf"cell-r(\d+)-{prefix}(\d+)", gid)
        if m:
            out.setdefault(int(m[1]), set()).add(int(m[2]))
    return out


def test_svg_lanes_cells_and_slot_labels(capsys, tmp_path):
    d = layout_json(capsys, DOC)
    ids = svg_ids(draw(capsys, tmp_path, DOC))
    assert [text_of(ids[f"lane-label-{r}"]) for r in range(2)] == ["rank 0", "rank 1"]
    assert "lane-label-2" not in ids
    drawn = cells(ids)
    for r in range(2):
        stored = {p for p, s in zip(d["positions"], d["slots"][str(r)]) if s != -1}
        assert drawn[r] == stored and len(drawn[r]) == d["owned_counts"][r] == 20
        for p in stored:  # each cell is labelled with its slot on that rank
            assert text_of(ids[f"slot-r{r}-p{p}"]) == str(d["slots"][str(r)][p])
    assert text_of(ids["slot-r0-p32"]) == "96" and text_of(ids["slot-r1-p4"]) == "80"
    assert text_of(ids["title"]).startswith("DCP layout: W=2 I=4 B=16 Bk=16")


def test_svg_virtual_block_boundaries_and_pages(capsys, tmp_path):
    ids = svg_ids(draw(capsys, tmp_path, DOC))
    bounds = sorted(int(g.rsplit("-", 1)[1]) for g in ids if g.startswith("vblock-boundary-"))
    assert bounds == [0, 32]  # B*W = 32; the view ends at 40, before the next boundary
    assert not any(g.startswith("block-boundary-") for g in ids)
    # the line at 32 is the left edge of the first cell of virtual block 1 (rank 0 owns 32..35)
    x32 = xs(ids["vblock-boundary-32"])
    assert x32[0] == x32[1] == pytest.approx(min(xs(ids["cell-r0-p32"])))
    assert max(xs(ids["cell-r1-p31"])) == pytest.approx(x32[0])  # and the right edge of the last one of 0
    unit = min(xs(ids["cell-r0-p33"])) - min(xs(ids["cell-r0-p32"]))
    assert min(xs(ids["cell-r1-p4"])) == pytest.approx(xs(ids["vblock-boundary-0"])[0] + 4 * unit)
    # each rank's page of an entry spans the entry in its lane; the entry names its block id
    for r in range(2):
        page0, page1 = xs(ids[f"page-r{r}-e0"]), xs(ids[f"page-r{r}-e1"])
        assert min(page0) == pytest.approx(xs(ids["vblock-boundary-0"])[0])
        assert max(page0) == pytest.approx(min(page1)) == pytest.approx(x32[0])
        assert max(page1) == pytest.approx(x32[0] + 8 * unit)  # clipped to the view (32..39)
    assert text_of(ids["entry-label-0"]) == "entry 0: block 5"
    assert text_of(ids["entry-label-1"]) == "entry 1: block 6"


def test_svg_kernel_blocks(capsys, tmp_path):
    argv = [
        "layout",
        "--dcp",
        "2",
        "--interleave",
        "2",
        "--block-size",
        "8",
        "--kernel-block-size",
        "4",
        "--positions",
        "0:32",
        "--block-table",
        "3,9",
    ]
    d = layout_json(capsys, argv)
    ids = svg_ids(draw(capsys, tmp_path, argv))
    # expected kernel blocks: kernel block k of KV block b is slots [k*4, k*4+4) (k = 2b, 2b+1)
    for r in range(2):
        want: dict[int, list[int]] = {}
        for p, s in zip(d["positions"], d["slots"][str(r)]):
            if s != -1:
                want.setdefault(s // 4, []).append(p)
        got = {int(g.rsplit("-k", 1)[1]) for g in ids if g.startswith(f"kblock-r{r}-")}
        assert got == set(want) == {6, 7, 18, 19}
        for k, ps in want.items():
            (gid,) = [g for g in ids if g.startswith(f"kblock-r{r}-") and g.endswith(f"-k{k}")]
            box = xs(ids[gid])
            assert min(box) == pytest.approx(min(xs(ids[f"cell-r{r}-p{min(ps)}"])))
            assert max(box) == pytest.approx(max(xs(ids[f"cell-r{r}-p{max(ps)}"])))
    without = svg_ids(draw(capsys, tmp_path, argv[:7] + argv[9:]))  # Bk = B: no kernel outlines
    assert not any(g.startswith("kblock-") for g in without)


def test_svg_replicated_draws_every_position_on_every_lane(capsys, tmp_path):
    argv = ["layout", "--dcp", "3", "--interleave", "4", "--block-size", "16", "--positions", "0:40", "--dcp-replicated"]
    ids = svg_ids(draw(capsys, tmp_path, argv))
    assert cells(ids) == {r: set(range(40)) for r in range(3)}
    assert sorted(int(g.rsplit("-", 1)[1]) for g in ids if g.startswith("block-boundary-")) == [0, 16, 32]
    assert not any(g.startswith("vblock-boundary-") for g in ids)
    assert text_of(ids["slot-r2-p17"]) == text_of(ids["slot-r0-p17"]) == str(2 * 16 + 1)
    assert "replicated: every rank stores every position" in text_of(ids["note-0"])


def test_svg_records_are_cells_of_R_positions(capsys, tmp_path):
    argv = [
        "layout",
        "--dcp",
        "2",
        "--interleave",
        "4",
        "--block-size",
        "8",
        "--tokens-per-state",
        "2",
        "--positions",
        "0:40",
        "--block-table",
        "5,6",
    ]
    d = layout_json(capsys, argv)
    ids = svg_ids(draw(capsys, tmp_path, argv))
    owner = dict(zip(d["records"], d["owner"]))
    assert cells(ids, "c") == {r: {c for c, o in owner.items() if o == r} for r in range(2)}
    assert not cells(ids, "p")
    x0 = xs(ids["vblock-boundary-0"])[0]
    unit = (xs(ids["vblock-boundary-32"])[0] - x0) / 32  # one position
    for c in (0, 3, 4, 19):
        box = xs(ids[f"cell-r{owner[c]}-c{c}"])
        assert min(box) == pytest.approx(x0 + 2 * c * unit)  # record c folds positions 2c, 2c+1
        assert max(box) - min(box) == pytest.approx(2 * unit)
    assert text_of(ids["slot-r0-c19"]) == str(6 * 8 + 3)
    notes = " ".join(text_of(ids[g]) for g in ids if g.startswith("note-"))
    assert "tokens_per_state R = 2" in notes and "records are sharded by record index" in notes


def test_svg_around_marks_the_centre(capsys, tmp_path):
    argv = ["layout", "--dcp", "4", "--block-size", "16", "--around", "100", "--window", "24"]
    ids = svg_ids(draw(capsys, tmp_path, argv))
    assert cells(ids)[0] == {88, 92, 96, 100, 104, 108}
    band = xs(ids["around"])
    assert min(band) == pytest.approx(min(xs(ids["cell-r0-p100"])))
    assert max(band) == pytest.approx(max(xs(ids["cell-r0-p100"])))
    assert text_of(ids["around-label"]) == "P=100"


def test_json_and_a_picture_together(capsys, tmp_path):
    path = tmp_path / "v.svg"
    assert main([*DOC, "--json", "--svg", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pictures"] == [str(path)] and doc["slots"]["1"][4] == 80
    assert text_of(svg_ids(path)["slot-r1-p4"]) == "80"


def test_wide_views_are_refused_with_a_way_out(capsys, tmp_path):
    path = tmp_path / "wide.svg"
    assert main(["layout", "--dcp", "4", "--block-size", "64", "--positions", "0:1024", "--svg", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--svg: 1024 positions (0..1023) are too many for a readable picture (at most 512)" in err
    assert "--around P --window N" in err and not path.exists()


def test_wide_but_drawable_views_drop_labels_and_say_so(capsys, tmp_path):
    ids = svg_ids(draw(capsys, tmp_path, ["layout", "--dcp", "4", "--block-size", "64", "--positions", "0:512"]))
    assert len(cells(ids)[3]) == 128 and not any(g.startswith("slot-") for g in ids)
    assert "cells too narrow for slot numbers" in text_of(ids["note-0"])


def test_unwritable_picture_is_exit_2(capsys, tmp_path):
    path = tmp_path / "no-such-dir" / "view.png"
    assert main([*DOC, "--png", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--png {path}: cannot write the picture" in err


def test_missing_matplotlib_names_the_extra(capsys, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main([*DOC, "--svg", str(tmp_path / "v.svg")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "pip install 'dcpsim[views]'" in err and err.count("\n") == 1


@pytest.mark.slow
def test_matplotlib_is_imported_only_to_draw(tmp_path):
    code = (
        "import sys; from dcpsim.cli import main; "
        "assert main(['layout', '--dcp', '2', '--block-size', '16', '--json']) == 0; "
        "assert 'matplotlib' not in sys.modules, 'imported without a picture'; "
        f"assert main(['layout', '--dcp', '2', '--block-size', '16', '--png', {str(tmp_path / 'v.png')!r}]) == 0; "
        "assert 'matplotlib' in sys.modules; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


# --- PNG: pixels -------------------------------------------------------------------------


def colour_mask(img: np.ndarray, colour: str) -> np.ndarray:
    return np.all(np.abs(img[..., :3] - np.asarray(to_rgb(colour))) < 0.06, axis=-1)


def lane_row(mask: np.ndarray) -> int:
    """A pixel row inside a lane's cells, above their labels."""
    rows = np.flatnonzero(mask.sum(axis=1) >= 3)
    return int(rows[0] + 0.15 * (rows[-1] - rows[0]))


def runs(line: np.ndarray, gap: int = 3) -> list[tuple[int, int]]:
    """[start, stop) pixel runs of True, joining gaps of at most ``gap`` pixels (cell separators)."""
    idx = np.flatnonzero(line)
    out: list[list[int]] = []
    for x in idx:
        if out and x - out[-1][1] <= gap:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return [tuple(r) for r in out]


def test_png_lanes_carry_colour_where_the_rank_stores(capsys, tmp_path):
    d = layout_json(capsys, DOC)
    img = imread(draw(capsys, tmp_path, DOC, "png"))
    masks = [colour_mask(img, RANK_COLOURS[r]) for r in range(2)]
    rows = [lane_row(m) for m in masks]
    assert rows[0] < rows[1]  # rank 0's lane on top
    band0 = np.flatnonzero(masks[0].sum(axis=1) >= 3)
    assert not masks[1][band0].any(axis=1).any()  # rank 1's colour never in rank 0's lane
    line = [masks[r][rows[r]] for r in range(2)]
    left = min(runs(ln)[0][0] for ln in line)
    right = max(runs(ln)[-1][1] for ln in line)
    unit = (right - left) / 40  # pixels per position (the view is 0..39)
    for r in range(2):
        owned = [p for p, s in zip(d["positions"], d["slots"][str(r)]) if s != -1]
        starts = [p for p in owned if p - 1 not in owned]
        got = runs(line[r])
        assert [round((a - left) / unit) for a, _ in got] == starts  # rank 0: 0, 8, ..; rank 1: 4, 12, ..
        assert all(abs((b - a) / unit - 4) < 0.2 for a, b in got)  # runs of I = 4 positions


def test_png_replicated_fills_every_lane_and_sharded_does_not(capsys, tmp_path):
    base = ["layout", "--dcp", "3", "--interleave", "4", "--block-size", "16", "--positions", "0:48"]
    full = imread(draw(capsys, tmp_path, [*base, "--dcp-replicated"], "png"))
    shard = imread(draw(capsys, tmp_path, base, "png"))
    for img, want in ((full, 1.0), (shard, 1 / 3)):
        lines = [colour_mask(img, RANK_COLOURS[r]) for r in range(3)]
        lines = [m[lane_row(m)] for m in lines]
        left = min(np.flatnonzero(ln)[0] for ln in lines)
        right = max(np.flatnonzero(ln)[-1] for ln in lines)
        for ln in lines:
            assert abs(ln[left : right + 1].mean() - want) < 0.06
