"""The code passes the project's ruff configuration (``[tool.ruff]`` in pyproject.toml):
its lint rules and its formatter."""

from __future__ import annotations

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
