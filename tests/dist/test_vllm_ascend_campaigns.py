"""``--engine vllm-ascend`` in the campaigns and the API: ``matrix`` runs the plugin per cell (its two
bugs fail exactly the cells where they show), ``selftest`` runs its baselines under the plugin,
``fuzz`` searches schedules under it (and finds bug class 39 at an interleave of 2), the pytest plugin
takes ``--dcpsim-engine vllm-ascend``, and ranks that are threads of one process (``in_process``)
each keep the schedule every other rank keeps."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import dcpsim
from dcpsim.cli import main
from dcpsim.engine.vllm_ascend.releases import NEWEST, VLLM_OF

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def trees(release_source):
    return str(release_source("vllm-ascend", NEWEST)), str(release_source("vllm", VLLM_OF[NEWEST]))


def engine_args(trees) -> list[str]:
    ascend, vllm = trees
    return ["--engine", "vllm-ascend", "--vllm-ascend-source", ascend, "--vllm-source", vllm]


def test_the_matrix_fails_exactly_the_cells_where_the_plugins_bugs_show(capsys, trees):
    argv = ["matrix", "eagle-hybrid-hit", "mtp-mask-interleave", "--dcp", "1,2,4", "--interleave", "1,128", *engine_args(trees)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith(("eagle-hybrid-hit-", "mtp-mask-interleave-"))}
    assert {cell: result for cell, result in rows.items() if result in ("pass", "fail")} == {
        "eagle-hybrid-hit-dcp1-il1-bs16": "pass",  # the page is the block: the margin is right
        "eagle-hybrid-hit-dcp2-il1-bs16": "fail",
        "eagle-hybrid-hit-dcp4-il1-bs16": "fail",
        "mtp-mask-interleave-dcp1-il1-bs128": "pass",
        "mtp-mask-interleave-dcp2-il1-bs128": "pass",  # at I = 1 its mask is right
        "mtp-mask-interleave-dcp2-il128-bs128": "fail",
        "mtp-mask-interleave-dcp4-il1-bs128": "pass",
        "mtp-mask-interleave-dcp4-il128-bs128": "fail",
    }, out
    assert "prefix-cache hit(s) shorter than the cache allows" in out and "mask row(s) differ from causality over positions" in out, out


def test_selftest_runs_its_baselines_under_the_plugin(capsys, trees):
    argv = [
        "selftest",
        *engine_args(trees),
        "--in-process",
        "--json",
        "--fault",
        "interleave-off-by-one",
        "--fault",
        "eagle-margin-unscaled",
    ]
    argv += ["--scenario", "dsv3", "--scenario", "llama-gqa", "--scenario", "eagle-hybrid-hit"]
    assert main(argv) == 1  # eagle-hybrid-hit's baseline is the plugin's own bug
    doc = json.loads(capsys.readouterr().out)
    baselines = {r["scenario"]: (r["outcome"], r["kind"]) for r in doc["rows"] if r["fault"] == "none"}
    assert baselines == {"dsv3": ("pass", None), "llama-gqa": ("pass", None), "eagle-hybrid-hit": ("FALSE POSITIVE", "prefix-hit-short")}, (
        doc["rows"]
    )
    faults = {(r["fault"], r["scenario"]): r["outcome"] for r in doc["rows"] if r["fault"] != "none"}
    assert set(faults.values()) == {"detected"} and ("eagle-margin-unscaled", "eagle-hybrid-hit") in faults, faults


def test_fuzz_finds_the_verify_mask_bug_under_the_plugin(capsys, tmp_path, monkeypatch, trees):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", *engine_args(trees), "--examples", "6", "--seed", "1", "--in-process"]) == 1
    out = capsys.readouterr().out
    assert "mask row(s) differ from causality over positions" in out, out
    saved = tmp_path / "fuzz-nofault-seed1.toml"
    assert saved.exists() and "cp_kv_cache_interleave_size = 2" in saved.read_text()


@pytest.mark.parametrize("name", ["dsv3", "prefix-sharing"])
def test_thread_ranks_keep_one_schedule(name, trees):
    """In one process the ranks share vLLM's modules: the root of the block-hash chain is drawn
    once, so every rank finds the same prefix hits as the ranks of a gloo world do (drawn per
    rank, the threads' schedules parted and the checker's exchange met rows of different
    lengths)."""
    ascend, vllm = trees
    runs = [dcpsim.run(name, engine="vllm-ascend", vllm_ascend_source=ascend, vllm_source=vllm, in_process=p) for p in (True, True, False)]
    assert all(r.passed for r in runs), [r.text() for r in runs if not r.passed]
    schedules = {json.dumps(r.to_dict()["schedule"], sort_keys=True) for r in runs}
    assert len(schedules) == 1 and runs[0].to_dict()["schedule"]["prefix_hit_tokens"] > 0, schedules


def test_the_pytest_plugin_takes_the_plugin_engine(tmp_path, trees):
    ascend, vllm = trees
    (tmp_path / "test_dcp.py").write_text(
        textwrap.dedent(
            """
            def test_dsv3(dcpsim_run):
                report = dcpsim_run("dsv3", dcp=2)
                assert report.to_dict()["engine"]["name"] == "vllm-ascend"
                report.raise_for_failure()

            def test_the_eagle_hit(dcpsim_run):
                dcpsim_run("eagle-hybrid-hit").raise_for_failure()
            """
        )
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--dcpsim-engine", "vllm-ascend"]
    cmd += ["--dcpsim-vllm-ascend-source", ascend, "--dcpsim-vllm-source", vllm, "test_dcp.py"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 failed, 1 passed" in done.stdout, done.stdout[-3000:]
    assert "test_the_eagle_hit" in done.stdout and "shorter than the cache allows" in done.stdout, done.stdout[-3000:]
