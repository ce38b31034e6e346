"""The code passes the project's ruff configuration (``[tool.ruff]`` in pyproject.toml):
its lint rules and its formatter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("dcpsim", "tests", "benchmarks")


def _ruff(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *argv, *CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
    done = _ruff("check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_leaves_the_code_as_it_is():
    done = _ruff("format", "--check")
    assert done.returncode == 0, "run `ruff format dcpsim tests benchmarks`:\n" + done.stdout + done.stderr


MAX_HARNESS_FUNCTION_LINES = 80
"""The harness is what a newcomer reads first: no function of it longer than a screen."""


def long_functions(root: Path, limit: int) -> list[str]:
    """``path:line name (N lines)`` of every function under ``root`` longer than ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_harness_function_is_longer_than_80_lines():
    assert not long_functions(ROOT / "dcpsim" / "harness", MAX_HARNESS_FUNCTION_LINES)


def test_the_length_rule_catches_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_HARNESS_FUNCTION_LINES))
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "long.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "harness", MAX_HARNESS_FUNCTION_LINES) == ["harness/long.py:5 long (81 lines)"]


def test_the_complexity_rules_catch_a_branchy_function(tmp_path):
    """C901 (max complexity 12) and PLR0915 (max 50 statements) are on: a function of 13
    branches and 51 statements fails the project's configuration."""
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(13))
    statements = "\n".join(f"    y{i} = {i}" for i in range(51))
    (tmp_path / "branchy.py").write_text(f"def branchy(x):\n{branches}\n    return -1\n\n\ndef wordy():\n{statements}\n")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", "branchy.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "C901 `branchy` is too complex (14 > 12)" in done.stdout, done.stdout + done.stderr
    assert "PLR0915 Too many statements (51 > 50)" in done.stdout, done.stdout + done.stderr
