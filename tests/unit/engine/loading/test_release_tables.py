"""The engines' tables of code shapes: each release in exactly one shape (or absent) per
decision, the release table of docs/engines.md made from them, and ``engine releases``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcpsim.cli import main
from dcpsim.engine.release_tables import RELEASE_TABLES, release_markdown, release_matrix

DOCS = Path(__file__).resolve().parents[4] / "docs" / "engines.md"


@pytest.mark.parametrize("engine", sorted(RELEASE_TABLES))
def test_every_release_has_exactly_one_shape_or_none_per_decision(engine):
    t = RELEASE_TABLES[engine]
    for table in t.tables.values():
        for d in table:
            for release in t.releases:
                holders = [s.name for s in d.shapes if release in s.releases] + (["absent"] if release in d.absent else [])
                assert len(holders) == 1, (engine, d.name, release, holders)
    assert all("?" not in row for row in release_matrix(engine))


def test_the_docs_release_tables_are_the_tables():
    text = DOCS.read_text(encoding="utf-8")
    assert release_markdown("vllm", "v2") in text
    assert release_markdown("sglang") in text


def test_engine_releases_prints_the_table(capsys):
    assert main(["engine", "releases", "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SGLang 0.5.18..0.5.23 (6 releases)")
    assert "none in 0.5.18..0.5.21: has no get_dcp_chain_spec_lens" in out
    assert main(["engine", "releases", "--engine", "vllm", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["newest"] == "0.34.0" and len(doc["releases"]) == 12
    write = next(d for d in doc["variants"]["v1"] if d["decision"] == "write_slots")
    assert write["absent"] == ["0.34.0"]
    assert [s["name"] for s in write["shapes"]] == ["v1", "v1-kernel-blocks", "v1-function", "v1-function-page"]


def test_engine_releases_binds_a_tree_without_loading_it(capsys, tmp_path):
    pkg = tmp_path / "sglang" / "srt" / "layers" / "dcp"
    pkg.mkdir(parents=True)
    (pkg / "layout.py").write_text("def get_dcp_lens(lens, dcp_size, dcp_rank, start):\n    pass\n", encoding="utf-8")
    assert main(["engine", "releases", "--sglang-source", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    states = {r["decision"]: r["state"] for r in doc["decisions"]}
    assert states["local_seq_lens"] == "bound" and states["merge_alltoall"] == "mismatch"
    assert doc["known_release"] is False
