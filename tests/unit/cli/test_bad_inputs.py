"""Every bad input of issue 12, as a new user would type it: one clear message and the
right exit code, no traceback, bounded memory (``run_cli``'s address-space limit) and
time. What could run away runs the CLI in a subprocess, as the user would; the usage
errors, the refusals of the estimate (arithmetic: nothing is allocated) and the notes of a
tiny run run ``main`` in this process."""

from __future__ import annotations

import copy
import json
import os

import pytest

from dcpsim.cli import main
from support.helpers import TINY_SCENARIO, run_cli, scenario_toml


def scenario_file(tmp_path, name="s", *, top=None, config=None, layer=None, request=None):
    """``TINY_SCENARIO`` with fields changed, written to ``tmp_path/NAME.toml``."""
    data = copy.deepcopy(TINY_SCENARIO)
    data.update(top or {})
    data["config"].update(config or {})
    data["layers"][0].update(layer or {})
    data["requests"][0].update(request or {})
    path = tmp_path / f"{name}.toml"
    path.write_text(scenario_toml(data), encoding="utf-8")
    return str(path)


def check(result, code, *phrases):
    """The exit code, no traceback, and each phrase in stderr."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    for phrase in phrases:
        assert phrase in result.stderr, (phrase, result.stderr[-3000:])


def json_error(result) -> dict:
    """The one JSON document of a ``--json`` run that failed."""
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == result.returncode
    return doc["error"]


RUNAWAYS = {
    "dcp 1000": (lambda t: ["run", "dsv3", "--dcp", "1000"], "across 1000 ranks"),
    "a 1e9 prompt": (
        lambda t: ["run", scenario_file(t, config={"max_model_len": 2 * 10**9}, request={"prompt_len": 10**9})],
        "at least 15,625,001 steps",
    ),
    "max_model_len 1e20": (lambda t: ["run", scenario_file(t, config={"max_model_len": 99999999999999999999})], "of block tables"),
    "block size 1e9": (lambda t: ["run", scenario_file(t), "--block-size", "1000000000"], "of KV stores"),
}
"""The runaways of the issue, in a subprocess with an address-space limit."""

REFUSED = {
    "dcp 1000 from a file": (lambda t: ["run", scenario_file(t, config={"decode_context_parallel_size": 1000})], "across 1000 ranks"),
    "a 1e9 prompt in few steps": (
        lambda t: [
            "run",
            scenario_file(t, config={"max_model_len": 2 * 10**9, "max_num_batched_tokens": 10**9}, request={"prompt_len": 10**9}),
        ],
        "GiB available; --force to run anyway",
    ),
    "kv_cache_tokens 9e18": (lambda t: ["run", scenario_file(t, top={"kv_cache_tokens": 9 * 10**18})], "of KV stores"),
    "matrix of a huge pool": (
        lambda t: ["matrix", scenario_file(t, top={"kv_cache_tokens": 9 * 10**18}), "--dcp", "2", "--interleave", "1"],
        "no cell can run",
    ),
    "capacity of a huge pool": (lambda t: ["capacity", scenario_file(t, top={"kv_cache_tokens": 9 * 10**18})], "scheduler alone needs"),
}
"""More of them, in this process: the estimate is arithmetic, so nothing is allocated."""


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RUNAWAYS))
def test_a_run_the_machine_cannot_hold_is_refused_before_any_rank_starts(tmp_path, case):
    argv, phrase = RUNAWAYS[case]
    result = run_cli(argv(tmp_path), timeout=120)
    check(result, 2, phrase)
    assert result.stderr.count("\n") == 1  # one line


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_estimate_refuses_before_anything_is_allocated(tmp_path, capsys, case):
    argv, phrase = REFUSED[case]
    code = main(argv(tmp_path))
    out, err = capsys.readouterr()
    assert code == 2 and phrase in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_json_gets_the_refusal_as_one_document(tmp_path, capsys):
    code = main(["run", scenario_file(tmp_path, top={"kv_cache_tokens": 9 * 10**18}), "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == doc["exit_code"] == 2 and "Traceback" not in err, err
    assert doc["error"]["kind"] == "ConfigError" and "of KV stores" in doc["error"]["message"]


@pytest.mark.slow
def test_force_past_the_estimate_ends_in_one_out_of_memory_line(tmp_path):
    result = run_cli(["run", scenario_file(tmp_path, top={"kv_cache_tokens": 9 * 10**18}), "--force", "--json", "--in-process"])
    check(result, 3, "out of memory")
    assert json_error(result)["kind"] == "HarnessError"


USAGE = {
    "fuzz --examples 0": (lambda t: ["fuzz", "--examples", "0"], "--examples must be an integer >= 1"),
    "--timeout 0": (lambda t: ["run", scenario_file(t), "--timeout", "0"], "--timeout must be a positive"),
    "--timeout -5": (lambda t: ["run", scenario_file(t), "--timeout", "-5"], "--timeout must be a positive"),
    "--deadline 0": (lambda t: ["run", scenario_file(t), "--deadline", "0"], "--deadline must be a positive"),
    "matrix --timeout 0": (lambda t: ["matrix", "dsv3", "--timeout", "0"], "--timeout must be a positive"),
    "matrix --dcp 0": (lambda t: ["matrix", "dsv3", "--dcp", "0"], "--dcp: decode_context_parallel_size must be an integer >= 1, got 0"),
    # issue 31: a list member that is not a valid value is the error of the value alone
    "capacity --dcp 1,-2": (
        lambda t: ["capacity", "dsv3", "--dcp", "1,-2"],
        "--dcp: decode_context_parallel_size must be an integer >= 1, got -2 (in 1,-2)",
    ),
    "capacity --dcp 1,x": (lambda t: ["capacity", "dsv3", "--dcp", "1,x"], "--dcp: 'x' is not an integer (in '1,x')"),
    "interleave --interleave 1,0": (
        lambda t: ["interleave", "dsv3", "--interleave", "1,0"],
        "--interleave: cp_kv_cache_interleave_size must be an integer >= 1, got 0 (in 1,0)",
    ),
    "interleave --interleave 1,,B": (lambda t: ["interleave", "dsv3", "--interleave", "1,,B"], "--interleave: '' is not an integer or B"),
    "matrix --interleave B,0": (
        lambda t: ["matrix", "dsv3", "--dcp", "2", "--interleave", "B,0"],
        "--interleave: cp_kv_cache_interleave_size must be an integer >= 1, got 0 (in B,0)",
    ),
    "matrix --pcp 1,0": (
        lambda t: ["matrix", "dsv3", "--pcp", "1,0"],
        "--pcp: prefill_context_parallel_size must be an integer >= 1, got 0",
    ),
    "an indexer with nothing to index": (
        lambda t: ["run", scenario_file(t, layer={"kind": "indexer", "head_size": 128})],
        "layer 'layers.0.attn' (and 1 more): an indexer (kind = 'indexer') with nothing to index",
    ),
    "engine fetch into /proc": (
        lambda t: ["engine", "fetch", "vllm", "--dest", "/proc/no-such/dir"],
        "--dest /proc/no-such/dir: cannot create the directory",
    ),
    "worker outside torchrun": (lambda t: ["worker", "dsv3"], "start this entry point with torchrun"),
    "a failure after the last step": (
        lambda t: ["run", scenario_file(t), "--simulate-rank-failure", "raise:0:99999"],
        "the failure would never happen",
    ),
    "an empty failure": (
        lambda t: ["run", scenario_file(t), "--simulate-rank-failure", ""],
        "--simulate-rank-failure expects KIND:RANK:STEP",
    ),
    "preempt_at_steps 100000": (
        lambda t: ["run", scenario_file(t, request={"preempt_at_steps": [100000]})],
        "preempt_at_steps 100000 is never reached",
    ),
    "preempt_at_steps -3": (lambda t: ["run", scenario_file(t, request={"preempt_at_steps": [-3]})], "preempt_at_steps must be steps >= 0"),
    "--seed -1": (lambda t: ["run", scenario_file(t), "--seed", "-1"], "--seed must be >= 0"),
    "seed -1 in a file": (lambda t: ["run", scenario_file(t, top={"seed": -1})], "seed: must be >= 0"),
    "a directory": (lambda t: ["run", str(t)], "is a directory, not a scenario file"),
}


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("case", sorted(USAGE))
def test_a_bad_input_is_one_clear_usage_error(tmp_path, capsys, no_torchrun, case):
    """In this process (each is refused before anything is allocated or started): an
    exception escaping ``main`` fails the test as a traceback would."""
    argv, phrase = USAGE[case]
    code = main(argv(tmp_path))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert phrase in err and err.count("\n") == 1 and out == "", err


@pytest.mark.parametrize("case", ["--timeout 0", "worker outside torchrun", "an empty failure", "matrix --dcp 0"])
def test_json_gets_a_usage_error_as_one_document(tmp_path, capsys, no_torchrun, case):
    argv, phrase = USAGE[case]
    code = main([*argv(tmp_path), "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == doc["exit_code"] == 2 and phrase in doc["error"]["message"], err


@pytest.mark.slow
def test_a_pool_below_the_largest_request_says_what_was_used(tmp_path, capsys):
    code = main(["run", scenario_file(tmp_path, top={"kv_cache_tokens": 1}), "--in-process"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    assert "kv_cache_tokens = 1 does not hold the largest request" in err and "FullAttention[layers.0.attn+1] 4 blocks (128 tokens)" in err


@pytest.mark.slow
def test_a_preemption_that_never_fires_is_said(tmp_path, capsys):
    code = main(["run", scenario_file(tmp_path, request={"preempt_at_steps": [3, 50]}), "--in-process"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    assert "request 'r0': preempt_at_steps 50 never fires" in err and "the schedule has" in err
    assert "preempt_at_steps 3 " not in err  # the one that fired


@pytest.mark.slow
def test_a_huge_cudagraph_capture_size_costs_nothing(tmp_path):
    result = run_cli(["run", scenario_file(tmp_path, config={"max_cudagraph_capture_size": 10**12}), "--in-process", "--json"], timeout=60)
    check(result, 0)
    assert json.loads(result.stdout)["passed"] is True


def test_a_rank_whose_parent_is_gone_ends_silently(tmp_path):
    """A rank's pipe to a dead parent is broken: the next message ends the rank at once,
    with no traceback (exit ``EXIT_ORPHANED``)."""
    import subprocess
    import sys

    from dcpsim.harness.rank_process import EXIT_ORPHANED

    code = (
        "from multiprocessing import Pipe\n"
        "from dcpsim.harness import rank_process as world\n"
        "recv, send = Pipe(duplex=False)\n"
        "recv.close()\n"
        "world._conn = send\n"
        "world.set_progress(3, 'write')\n"
        "print('still running')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert (result.returncode, result.stdout, result.stderr) == (EXIT_ORPHANED, "", "")


def test_json_gets_a_command_line_error_as_one_document(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "dsv3", "--dcp", "abc", "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert info.value.code == doc["exit_code"] == 2 and "invalid int value: 'abc'" in doc["error"]["message"]
    assert "dcpsim: error: argument --decode-context-parallel-size/--dcp" in err


def test_json_gets_a_document_before_the_traceback_of_a_bug(capsys, monkeypatch):
    """An unexpected exception keeps its traceback (it is a bug to fix), after one document."""
    from dcpsim.cli import run as run_command

    def broken(args):
        raise ValueError("a bug")

    monkeypatch.setattr(run_command, "run", broken)
    with pytest.raises(ValueError, match="a bug"):
        main(["run", "dsv3", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"error": {"kind": "InternalError", "message": "ValueError: a bug"}, "exit_code": 3}


def test_an_in_process_rank_failure_is_a_harness_failure_with_the_ranks_traceback_indented(tmp_path, capsys):
    code = main(["run", scenario_file(tmp_path), "--in-process", "--simulate-rank-failure", "raise:1:2", "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == doc["exit_code"] == 3 and doc["error"]["kind"] == "ThreadRankError"
    assert err.startswith("dcpsim: error: rank 1 failed: RuntimeError: simulated failure of rank 1 at step 2\n")
    assert "\n    Traceback (most recent call last):" in err and "\nTraceback" not in err


def test_a_bad_rank_slice_is_one_clear_usage_error(tmp_path, capsys, monkeypatch):
    """``DCPSIM_RANK_SLICE_MS`` (how the ranks ask to be scheduled) is read as a world starts:
    a bad value is refused before any rank starts."""
    monkeypatch.setenv("DCPSIM_RANK_SLICE_MS", "fast")
    code = main(["run", scenario_file(tmp_path), "--dcp", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    expected = "DCPSIM_RANK_SLICE_MS must be 0 (the ranks keep the default scheduling) or a slice of 0.1-100 ms, got 'fast'"
    assert err == f"dcpsim: error: {expected}\n"
