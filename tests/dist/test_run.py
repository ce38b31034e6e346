"""``dcpsim run`` end to end on real gloo worlds: verdicts, exit codes, reports.

These start real rank processes (forkserver, FileStore rendezvous), so they
run in parallel under pytest-xdist without port collisions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from dcpsim.campaigns.grid import full_grid
from dcpsim.campaigns.matrix import page_states
from dcpsim.cli import main
from dcpsim.harness.dry_run import dry_run
from dcpsim.scenarios.load import load_scenario
from support.helpers import builtin

pytestmark = pytest.mark.dist  # two quick worlds stay in the fast loop; the rest are slow

SCENARIOS = ["dsv3", "dsv41-hybrid"]


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["run", *argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


GRID = [(scenario, dcp, interleave) for scenario in SCENARIOS for dcp in (1, 2, 3, 4, 8) for interleave in (1, 16, 64)]
"""dsv3 and dsv41-hybrid at W in 1, 2, 3, 4, 8 and I in 1, 16, 64 (64 = B of every paged group)."""
RUN_CLI = [("dsv3", 1, 1), ("dsv3", 3, 16), ("dsv41-hybrid", 4, 64)]
"""The points of ``GRID`` run through ``dcpsim run --json`` here (an odd W, each scenario, W = 1).
Until issue 29 every point of ``GRID`` was a gloo world of its own here; each is a cell of the
full matrix (``tests/matrix/test_matrix_full.py``, gloo worlds, the verdict), and its schedule's
counters are checked in every point by ``test_every_grid_point_schedules_reuse_and_preemption``."""


@pytest.mark.slow
@pytest.mark.parametrize("scenario, dcp, interleave", RUN_CLI)
def test_builtin_scenario_passes(capsys, scenario, dcp, interleave):
    code, report = run_json(capsys, scenario, "--dcp", str(dcp), "--interleave", str(interleave))
    assert code == 0, report["failure"]
    assert report["passed"] and report["failure"] is None
    assert report["dcp_size"] == dcp and report["interleave_size"] == interleave
    assert len(report["ranks"]) == dcp
    assert report["verifications"] == report["steps"]  # verify_every = 1
    assert report["verified_indices"] > 10_000
    sched = report["schedule"]
    assert sched["finished"] == sched["requests"]
    assert sched["reused_blocks"] > 0, "finished requests' blocks must be reused"
    assert sched["preemptions"] >= 1
    assert sched == dry_run(builtin(scenario, dcp, interleave)).summary  # the ranks' schedule is the parent's dry run's


@pytest.mark.slow
def test_every_grid_point_schedules_reuse_and_preemption():
    """Every point of ``GRID``: the schedule (the parent's dry run, the one the ranks follow:
    ``test_builtin_scenario_passes`` compares them) finishes every request, reuses blocks and
    preempts; and the full matrix holds each point as a cell at the scenario's own page, where
    its gloo world must pass."""
    cells = {(c.cell.scenario, c.cell.dcp, int(c.cell.interleave), c.cell.block_size, c.cell.kernel_block_size, c.cell.attention)
             for c in full_grid(SCENARIOS)}  # fmt: skip
    for scenario, dcp, interleave in GRID:
        sched = dry_run(builtin(scenario, dcp, interleave)).summary
        where = f"{scenario} W={dcp} I={interleave}"
        assert sched["finished"] == sched["requests"] and sched["reused_blocks"] > 0 and sched["preemptions"] >= 1, (where, sched)
        page = page_states(load_scenario(scenario))
        assert (scenario, dcp, interleave, page, None, None) in cells, where


def test_human_report_and_exit_code_in_a_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "dcpsim", "run", "dsv41-hybrid", "--dcp", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout
    assert "SlidingWindowMLA" in proc.stdout and "replicated" in proc.stdout
    assert "sharded" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario,fault,kind,interleave",
    [
        ("dsv3", "interleave-off-by-one", "wrong-content", 4),
        ("dsv41-hybrid", "interleave-off-by-one", "wrong-content", 16),
        ("dsv41-hybrid", "replicated-owner-only", "wrong-content", 16),
        ("dsv3", "foreign-block", "write-violation", 16),
        ("dsv41-hybrid", "foreign-block", "write-violation", 16),
    ],
)
def test_broken_write_path_fails_with_a_report(capsys, scenario, fault, kind, interleave):
    """dsv3's off-by-one at I = 4: the wrong owner's report names the owner and where the entry
    went (rank 1 holds position 0 in the slot rank 0 should have used)."""
    code, report = run_json(capsys, scenario, "--dcp", "2", "--interleave", str(interleave), "--inject", fault)
    assert code == 1
    assert not report["passed"]
    failure = report["failure"]
    assert failure["kind"] == kind
    assert failure["step"] == 0  # caught at the first verification
    if kind == "wrong-content":
        assert failure["group"] and failure["request_id"] == "chat-0"
        assert failure["index"] is not None and failure["expected_slot"] is not None
        assert len(failure["holdings"]) == 2  # what every rank holds there
        assert failure["further_bad"] > 0
    else:
        assert any("does not hold" in line for line in failure["details"])
    if (scenario, fault) == ("dsv3", "interleave-off-by-one"):  # the wrong owner and where the entry went
        assert failure["index"] == 0 and failure["expected_owner"] == 0
        rank1 = failure["holdings"][1]
        assert rank1["index"] == 0 and rank1["found_at"] == [failure["expected_slot"]]


@pytest.mark.slow
def test_text_failure_report(capsys):
    code = main(["run", "dsv41-hybrid", "--dcp", "4", "--inject", "replicated-owner-only"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL at step 0" in out
    assert "expected on: every rank (replicated)" in out
    assert "rank 3 slot" in out and "further bad positions" in out


@pytest.mark.slow
def test_paranoid_mode_passes_and_counts_more_traffic(capsys):
    _, compact = run_json(capsys, "dsv3", "--dcp", "2")
    code, paranoid = run_json(capsys, "dsv3", "--dcp", "2", "--paranoid")
    assert code == 0
    assert paranoid["bytes_gathered"] > 10 * compact["bytes_gathered"]


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


@pytest.mark.slow
def test_rank_that_raises_ends_in_exit_3_with_its_traceback(capsys):
    """In this process (``main``: its exit code, its stderr; the ranks are gloo processes all the
    same); a run in a subprocess of its own: ``test_human_report_and_exit_code_in_a_subprocess``
    (exit 0) and ``test_rank_that_hangs_ends_in_exit_3_within_the_timeout_and_leaves_no_process``
    (exit 3)."""
    assert main(["run", "dsv3", "--dcp", "3", "--simulate-rank-failure", "raise:1:4"]) == 3
    err = capsys.readouterr().err
    assert "primary: rank 1 at step 4" in err
    assert "Traceback" in err and "simulated failure of rank 1 at step 4" in err
    assert "secondary: rank 0" in err and "secondary: rank 2" in err


@pytest.mark.slow
def test_rank_that_exits_is_reported(capsys):
    """In this process, as ``test_rank_that_raises_ends_in_exit_3_with_its_traceback``."""
    assert main(["run", "dsv3", "--dcp", "2", "--simulate-rank-failure", "exit:0:2", "--timeout", "5"]) == 3
    err = capsys.readouterr().err
    assert "rank 0" in err and "exited with code 17" in err


@pytest.mark.slow
def test_rank_that_hangs_ends_in_exit_3_within_the_timeout_and_leaves_no_process():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dcpsim",
            "run",
            "dsv3",
            "--dcp",
            "3",
            "--timeout",
            "3",
            "--deadline",
            "600",
            "--simulate-rank-failure",
            "hang:2:3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    helpers = _children_of(proc.pid)
    ranks = [c for h in helpers for c in _children_of(h)]
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 3, err
    # ended by the 3 s process-group timeout, not by the 600 s deadline (the wide bounds are for
    # rank start-up: about 15 s on 2 quiet cores, minutes at a load average of 40)
    assert "Timed out waiting 3000ms" in err and "deadline" not in err
    assert "rank 2 at step 3" in err

    def alive():
        return [p for p in helpers + ranks if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]

    gone_by = time.monotonic() + 30
    while alive() and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not alive(), f"left-over processes {alive()}"


@pytest.mark.slow
def test_a_waiting_run_says_which_ranks_it_waits_for_and_where(capsys):
    """In this process, as ``test_rank_that_raises_ends_in_exit_3_with_its_traceback``."""
    # rank 2 hangs at step 3; ranks 0 and 1 wait for it in step 15's verification until the
    # 6 s process-group timeout: after 5 s without news the parent says so on stderr
    code = main(["run", "dsv3", "--dcp", "3", "--timeout", "6", "--simulate-rank-failure", "hang:2:3"])
    out, err = capsys.readouterr()
    assert code == 3, err
    waits = [line for line in err.splitlines() if line.startswith("dcpsim: waiting")]
    assert waits, err
    # ranks 0 and 1 go on to their next exchange of verification rows (Job.exchange_every):
    # 16 verified steps a queue, the first queue ends at step 15
    assert re.fullmatch(
        r"dcpsim: waiting [\d.]+ s for 3 of 3 ranks: ranks 0, 1 at step 15 \(verify\); "
        r"rank 2 at step 3 \(write\)",
        waits[0],
    ), waits
    assert out == ""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_bad_scenario_and_config_exit_2_before_any_rank(capsys, tmp_path):
    assert main(["run", "no-such-scenario"]) == 2
    assert "built-ins: compressed-prefix, dsv3, dsv3-mtp, dsv32-sparse, dsv41-hybrid" in capsys.readouterr().err
    assert main(["run", "dsv3", "--interleave", "3"]) == 2
    assert "cp_kv_cache_interleave_size (3)" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text(
        "[config]\nmax_num_batchd_tokens = 4\n"
        '[[layers]]\nname = "a"\nkind = "mla"\nblock_size = 16\nhead_size = 8\n'
        "[[requests]]\nprompt_len = 3\noutput_len = 2\n"
    )
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: config.max_num_batchd_tokens: unknown field (did you mean 'max_num_batched_tokens'?)" in err


@pytest.mark.slow
def test_torchrun_worker_gives_the_same_verdict_as_run(capsys):
    """``run``'s verdict from threads (``--in-process``, which gives a gloo world's verdict;
    ``run``'s own gloo world of dsv41-hybrid at W = 4: ``test_builtin_scenario_passes``)."""
    code, direct = run_json(capsys, "dsv41-hybrid", "--dcp", "4", "--interleave", "16", "--in-process")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "dcpsim",
            "worker",
            "dsv41-hybrid",
            "--interleave",
            "16",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    via_torchrun = json.loads(proc.stdout)
    for key in ("passed", "steps", "verifications", "verified_indices", "schedule", "groups", "dcp_size"):
        assert via_torchrun[key] == direct[key], key
    assert code == 0


@pytest.mark.slow
def test_torchrun_worker_catches_a_fault_too():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "dcpsim",
            "worker",
            "dsv3",
            "--inject",
            "interleave-off-by-one",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    report = json.loads(proc.stdout)
    assert report["failure"]["kind"] == "wrong-content"


@pytest.mark.slow
def test_replay_of_a_gloo_report_reproduces_the_failure(capsys, tmp_path):
    code, first = run_json(capsys, "dsv41-hybrid", "--dcp", "4", "--interleave", "16", "--inject", "replicated-owner-only")
    assert code == 1
    path = tmp_path / "report.json"
    path.write_text(json.dumps(first))
    code = main(["replay", str(path), "--json"])
    again = json.loads(capsys.readouterr().out)
    assert code == 1 and again["failure"] == first["failure"] and len(again["ranks"]) == 4
