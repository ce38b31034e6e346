"""docs/api.md's Python examples run as written (the test functions it shows, with
``dcpsim_run`` as the fixture gives it, ranks as threads)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

import dcpsim

PAGE = Path(__file__).resolve().parents[3] / "docs" / "api.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)


def test_the_page_shows_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3 and all("dcpsim" in b for b in blocks)


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(python_blocks())))
def test_every_python_example_runs(k, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(python_blocks()[k], f"{PAGE}:block {k}", "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    for test in tests:
        test(dcpsim_run=functools.partial(dcpsim.run, in_process=True))
    assert namespace.get("dcpsim") is dcpsim or tests
