"""Helix's layout (``kv_cache_layout = "helix"``) on real gloo worlds, through the command line:
the built-in passes at W = 2 and 4 (with ``--attention`` at 4), its fault is caught by ``run
--inject`` and by ``selftest`` with a clean baseline, and what Helix cannot express is exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def dcpsim(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dcpsim", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("extra", [["--dcp", "2"], ["--dcp", "4", "--attention"]])
def test_helix_decode_passes_on_gloo(extra):
    proc = dcpsim("run", "helix-decode", *extra, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] and report["steps"] > 40


def test_unclamped_decode_owner_is_caught_on_gloo():
    proc = dcpsim("run", "helix-decode", "--dcp", "4", "--inject", "helix-decode-owner-unclamped", "--json")
    assert proc.returncode == 1, proc.stderr
    failure = json.loads(proc.stdout)["failure"]
    assert failure["kind"] == "wrong-content" and failure["expected_owner"] == 0
    proc = dcpsim("selftest", "--fault", "helix-decode-owner-unclamped", "--scenario", "helix-decode", "--timeout", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 detected, 0 missed" in proc.stdout and "0 false positives" in proc.stdout


@pytest.mark.parametrize(
    "extra,field",
    [
        (["--pcp", "2"], "prefill_context_parallel_size"),
        (["--max-cudagraph-capture-size", "8"], "max_cudagraph_capture_size"),
        (["--engine", "dcpsim.engine.example_plugin:ExampleEngine"], 'kv_cache_layout = "helix"'),
    ],
)
def test_what_helix_cannot_express_is_exit_2(extra, field):
    proc = dcpsim("run", "helix-decode", *extra)
    assert proc.returncode == 2 and field in proc.stderr, proc.stderr


def test_a_vllm_layout_scenario_under_helix_names_what_helix_cannot_express():
    # (drafts are no longer refused: helix-spec-decode; dsv3's prefix cache is)
    proc = dcpsim("run", "dsv3", "--kv-cache-layout", "helix")
    assert proc.returncode == 2 and "enable_prefix_caching" in proc.stderr, proc.stderr
