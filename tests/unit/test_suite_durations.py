"""The suite's time per directory (``tests/support/durations.py``): the sums are right, the
costliest comes first, and a real pytest run prints them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.durations import directory_of, file_of, shares

ROOT = Path(__file__).resolve().parents[2]


def test_shares_sum_per_directory_and_file_costliest_first():
    per_test = {
        "tests/unit/a/test_x.py::t1": 1.0,
        "tests/unit/a/test_x.py::t2": 2.0,
        "tests/unit/a/test_y.py::t": 0.5,
        "tests/dist/test_z.py::t[1]": 4.0,
    }
    assert shares(per_test, directory_of) == [("tests/dist", 4.0, 1), ("tests/unit/a", 3.5, 3)]
    assert shares(per_test, file_of)[1] == ("tests/unit/a/test_x.py", 3.0, 2)


@pytest.mark.slow
def test_a_pytest_run_prints_and_writes_its_durations(tmp_path):
    out = tmp_path / "d.json"
    target = "tests/unit/test_plural.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", target, "--dcpsim-durations-json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    assert "test time per directory" in run.stdout
    per_test = json.loads(out.read_text())["per_test"]
    assert per_test and all(nodeid.startswith(target + "::") for nodeid in per_test)
    assert f"{len(per_test)} tests  tests/unit" in run.stdout
