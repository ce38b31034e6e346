"""``dcpsim fuzz`` keeps Hypothesis's files in dcpsim's cache folder, never in the folder it runs from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_fuzz_leaves_no_hypothesis_folder_in_the_working_directory(tmp_path):
    cwd, cache = tmp_path / "here", tmp_path / "cache"
    cwd.mkdir()
    env = dict(os.environ, DCPSIM_CACHE=str(cache), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "dcpsim", "fuzz", "--examples", "3", "--seed", "4"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no failing schedule in 3 random examples" in proc.stdout
    assert list(cwd.iterdir()) == [], "fuzz wrote into its working directory"
    assert any((cache / "hypothesis").rglob("*")), "Hypothesis's files belong in $DCPSIM_CACHE/hypothesis"
