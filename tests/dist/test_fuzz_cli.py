"""dcpsim fuzz end to end: search, shrink, save (``python -m dcpsim fuzz`` in a process of its own,
run from an empty folder: Hypothesis's files go to dcpsim's cache folder, never to the folder it
runs from), and rerun the saved file on real gloo worlds (``main`` in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcpsim.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_fuzz_saves_a_shrunk_scenario_that_fails_on_gloo(tmp_path, capsys):
    fault = "interleave-off-by-one"
    cwd, cache, out = tmp_path / "here", tmp_path / "cache", tmp_path / "out"
    cwd.mkdir()
    env = dict(os.environ, DCPSIM_CACHE=str(cache), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "dcpsim", "fuzz", "--inject", fault, "--out", str(out), "--examples", "100"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr
    files = list(out.glob("*.toml"))
    assert len(files) == 1
    assert "FAIL at step" in proc.stdout
    assert list(cwd.iterdir()) == [], "fuzz wrote into its working directory"
    assert any((cache / "hypothesis").rglob("*")), "Hypothesis's files belong in $DCPSIM_CACHE/hypothesis"
    assert main(["run", str(files[0]), "--inject", fault]) == 1, capsys.readouterr().err
    assert main(["run", str(files[0])]) == 0, capsys.readouterr()
