"""``dcpsim.run`` from a plain script, as a newcomer writes one (issue 31): no ``if __name__ ==
"__main__":`` guard, fed as a file, on standard input, or calling the API from a function at
import. Each is a real process of its own whose ranks are real gloo processes, and each must
give ``python -m dcpsim run``'s verdict with nothing on stderr: the ranks never run the
caller's ``__main__`` (``dcpsim.harness.caller_main``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "dcpsim.engine.example_plugin:OffByOneExampleEngine"

UNGUARDED = f"""\
import json
import dcpsim

for engine in ("reference", "{PLUGIN}"):
    report = dcpsim.run("dsv3", dcp=2, engine=engine)
    f = report.failure
    print(json.dumps([report.passed, f and f.kind, f and f.first_bad_index]))
"""

AT_IMPORT = f"""\
import json
import dcpsim


def check(engine):
    report = dcpsim.run("dsv3", dcp=2, engine=engine)
    f = report.failure
    return [report.passed, f and f.kind, f and f.first_bad_index]


results = [check(e) for e in ("reference", "{PLUGIN}")]
for r in results:
    print(json.dumps(r))
"""

MAIN_PLUGIN = """\
import dcpsim


class Mine(dcpsim.ReferenceEngine):
    pass


try:
    dcpsim.run("dsv3", dcp=2, engine="__main__:Mine")
except dcpsim.ConfigError as exc:
    print("ConfigError:", exc)
print(dcpsim.run("dsv3", dcp=2, engine="__main__:Mine", in_process=True).passed)
"""


def _python(args, *, stdin=None, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, cwd=cwd, timeout=300, env=env)


@pytest.fixture(scope="module")
def cli_verdicts():
    """``run dsv3 --dcp 2 --json`` under the reference and the off-by-one plugin, as
    ``[passed, kind, first_bad_index]`` rows, and their exit codes."""
    rows, codes = [], []
    for engine in ("reference", PLUGIN):
        proc = run_cli(["run", "dsv3", "--dcp", "2", "--engine", engine, "--json"], timeout=300)
        doc = json.loads(proc.stdout)
        f = doc.get("failure")
        rows.append([doc["passed"], f and f["kind"], f and f["index"]])
        codes.append(proc.returncode)
    assert codes == [0, 1], codes  # the plugin's engine fails: the scripts must see it fail too
    return rows


def _rows(proc) -> list:
    assert "Traceback" not in proc.stderr and proc.stderr == "", proc.stderr[-3000:]
    assert proc.returncode == 0, proc.returncode
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("how", ["file", "stdin"])
def test_an_unguarded_script_gives_the_cli_verdicts(tmp_path, cli_verdicts, how):
    script = tmp_path / "check.py"
    script.write_text(UNGUARDED, encoding="utf-8")
    if how == "file":
        proc = _python([str(script)], cwd=tmp_path)
    else:
        proc = _python(["-"], stdin=UNGUARDED, cwd=tmp_path)
    assert _rows(proc) == cli_verdicts
    assert cli_verdicts[0][0] is True and cli_verdicts[1][0] is False


@pytest.mark.dist
@pytest.mark.slow
def test_a_run_in_a_function_called_at_import_gives_the_cli_verdicts(tmp_path, cli_verdicts):
    script = tmp_path / "at_import.py"
    script.write_text(AT_IMPORT, encoding="utf-8")
    assert _rows(_python([str(script)], cwd=tmp_path)) == cli_verdicts


@pytest.mark.dist
@pytest.mark.slow
def test_a_plugin_in_the_script_itself_is_one_clear_error(tmp_path):
    """Ranks that never run the script cannot import an engine defined in it: a
    ``ConfigError`` that says so and what to do, before any rank starts; threads can."""
    script = tmp_path / "plugin.py"
    script.write_text(MAIN_PLUGIN, encoding="utf-8")
    proc = _python([str(script)], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    first, second = proc.stdout.splitlines()
    assert first.startswith("ConfigError: --engine __main__:Mine: the ranks are fresh processes that never run the calling script")
    assert "in_process=True" in first and second == "True"
