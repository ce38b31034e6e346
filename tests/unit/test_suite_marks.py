"""``support.marks.deselected_by_marks``: the full matrix's grid is built unless ``-m`` deselects
every chunk, judged as pytest's own deselection judges (a wrong True would leave the full
matrix out of the suite: its placeholder item then fails, ``test_matrix_full.py``)."""

from __future__ import annotations

import types

import pytest

from support.marks import deselected_by_marks

CHUNK = {"slow", "dist", "parametrize"}
"""The marks of a full-matrix chunk item."""


def config(markexpr: str):
    return types.SimpleNamespace(getoption=lambda name: {"markexpr": markexpr}[name])


@pytest.mark.parametrize(
    "markexpr, deselected",
    [
        ("", False),
        ("not slow", True),
        ("slow", False),
        ("dist", False),
        ("not dist", True),
        ("slow and not dist", True),
        ("not slow or dist", False),
        ("engine", True),
        ("dist(name=1)", True),  # a mark with keywords the chunk's marks do not carry
        ("not (", False),  # pytest rejects it; on any doubt, build the grid
    ],
)
def test_a_chunk_is_deselected_exactly_where_pytest_deselects_it(markexpr, deselected):
    assert deselected_by_marks(config(markexpr), CHUNK) is deselected
