"""dcpsim fuzz end to end: search, shrink, save, and rerun the saved file on real gloo worlds."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_fuzz_saves_a_shrunk_scenario_that_fails_on_gloo(tmp_path):
    fault = "interleave-off-by-one"
    proc = subprocess.run(
        [sys.executable, "-m", "dcpsim", "fuzz", "--inject", fault, "--out", str(tmp_path), "--examples", "100"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr
    files = list(tmp_path.glob("*.toml"))
    assert len(files) == 1
    assert "FAIL at step" in proc.stdout
    rerun = [sys.executable, "-m", "dcpsim", "run", str(files[0])]
    with_fault = subprocess.run(rerun + ["--inject", fault], capture_output=True, text=True, timeout=120)
    assert with_fault.returncode == 1, with_fault.stderr
    without = subprocess.run(rerun, capture_output=True, text=True, timeout=120)
    assert without.returncode == 0, without.stdout + without.stderr
