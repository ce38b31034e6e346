"""``dcpsim.run``: the same world as ``python -m dcpsim run``, with a typed report.

Every built-in through ``dcpsim.run(..., in_process=True)`` gives the verdict and the JSON
document (but for what is measured: times, memory) of ``run --in-process --json``: both build
the same ``Job``, whose world runs once (``one_world``); the
example plugin's broken engine fails with its kind; bad options are ``ConfigError``s that
name them. Real gloo worlds: tests/dist/test_api_gloo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dcpsim
from dcpsim.harness import launch
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names
from support.helpers import without_timings

ONE_INSTANCE = [n for n in builtin_scenario_names() if load_scenario(n).disaggregated is None]
OFF_BY_ONE = "dcpsim.engine.example_plugin:OffByOneExampleEngine"


@pytest.fixture
def one_world(monkeypatch):
    """The first launch's world runs (``harness.launch.run_jobs``); every later launch of the
    test must ask for the very same ``Job`` (the same scenario, overrides and run options) and
    gets the first world's reports: the CLI and ``dcpsim.run`` are two ways into one
    ``launch_job``, so a second world would only show that a world is deterministic (the full
    matrix's cells and the replay tests show that). Returns the jobs launched."""
    jobs, reports = [], []
    real = launch.run_jobs

    def run_once(batch, **kwargs):
        (job,) = batch
        if jobs:
            assert job == jobs[0], "the command and dcpsim.run built different jobs"
        else:
            reports.extend(real(batch, **kwargs))
        jobs.append(job)
        return list(reports)

    monkeypatch.setattr(launch, "run_jobs", run_once)
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("name", ONE_INSTANCE)
def test_every_builtin_gives_the_cli_verdict_and_document(name, run_json, one_world):
    code, cli = run_json("run", name, "--in-process")
    report = dcpsim.run(name, in_process=True)
    assert len(one_world) == 2
    assert report.passed is (code == 0) is True
    assert without_timings(report.to_dict()) == without_timings(cli)
    assert report.steps == cli["steps"] > 0 and report.verified_indices == cli["verified_indices"] > 0
    assert [r.rank for r in report.ranks] == list(range(cli["dcp_size"]))


@pytest.mark.slow
def test_the_options_reach_the_run_as_the_flags_do(run_json, one_world):
    flags = ("--dcp", "4", "--interleave", "2", "--block-size", "32", "--seed", "7", "--verify", "full", "--attention")
    code, cli = run_json("run", "dsv3", "--in-process", *flags)
    report = dcpsim.run("dsv3", dcp=4, interleave=2, block_size=32, seed=7, verify="full", attention=True, in_process=True)
    assert len(one_world) == 2
    doc = report.to_dict()
    assert without_timings(doc) == without_timings(cli)
    assert (doc["dcp_size"], doc["interleave_size"], doc["verify_mode"], doc["replay"]["scenario"]["seed"]) == (4, 2, "full", 7)
    assert doc["attention_checks"] > 0 and report.passed and code == 0


@pytest.mark.slow
def test_a_scenario_object_and_a_path_run_as_the_name_does(tmp_path):
    """And a passing report raises nothing (``raise_for_failure``)."""
    passing = dcpsim.run("llama-gqa", dcp=2, in_process=True)
    assert passing.raise_for_failure() is passing and passing.failure is None
    by_name = passing.to_dict()
    scenario = load_scenario("llama-gqa")
    by_object = dcpsim.run(scenario, dcp=2, in_process=True).to_dict()
    by_path = dcpsim.run(Path(scenario.source) if Path(scenario.source).is_file() else _builtin_path("llama-gqa"), dcp=2, in_process=True)
    assert without_timings(by_object) == without_timings(by_name)
    assert without_timings(by_path.to_dict())["replay"] == without_timings(by_name)["replay"]


def _builtin_path(name: str) -> Path:
    return Path(dcpsim.__file__).parent / "scenarios" / "builtin" / f"{name}.toml"


@pytest.mark.slow
def test_the_broken_example_plugin_fails_with_its_kind_and_the_text_report():
    report = dcpsim.run("dsv3", dcp=2, engine=OFF_BY_ONE, in_process=True)
    assert report.passed is False
    f = report.failure
    assert (f.kind, f.request, f.first_bad_index, f.expected_owner, f.expected_slot) == ("wrong-content", "chat-0", 0, 0, 64)
    assert f.group.startswith("MLAAttention") and {h.rank for h in f.holdings} == {0, 1}
    assert report.to_dict()["failure"]["kind"] == "wrong-content"
    with pytest.raises(dcpsim.CheckFailed) as caught:
        report.raise_for_failure()
    assert str(caught.value) == report.text() and "FAIL at step 0" in str(caught.value)
    assert caught.value.report is report and caught.value.exit_code == 1


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(bogus=1), "unknown option 'bogus'"),
        (dict(dcp=0), "decode_context_parallel_size must be an integer >= 1, got 0"),
        (dict(dcp=2, decode_context_parallel_size=2), "'decode_context_parallel_size' given twice"),
        (dict(verify="sometimes"), "verify"),
        (dict(engine="no.such.module:Engine"), "no.such.module"),
        (dict(inject="no-such-fault"), "no-such-fault"),
        (dict(seed=-1), "--seed must be >= 0"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(kwargs, words):
    with pytest.raises(dcpsim.ConfigError) as caught:
        dcpsim.run("dsv3", in_process=True, **kwargs)
    assert words in str(caught.value) and caught.value.exit_code == 2


def test_an_unknown_scenario_is_a_config_error():
    with pytest.raises(dcpsim.ConfigError, match="no-such-scenario"):
        dcpsim.run("no-such-scenario", in_process=True)


def test_a_pd_scenario_refuses_what_the_cli_refuses(run_json):
    name = next(n for n in builtin_scenario_names() if load_scenario(n).disaggregated is not None)
    code, cli = run_json("run", name, "--in-process")
    with pytest.raises(dcpsim.ConfigError) as caught:
        dcpsim.run(name, in_process=True)
    assert code == 2 and str(caught.value) == cli["error"]["message"] == "--in-process is not supported for P/D runs yet"
    with pytest.raises(dcpsim.ConfigError, match="verify not supported for P/D runs"):
        dcpsim.run(name, verify="full")


@pytest.mark.slow
def test_import_dcpsim_leaves_torch_for_the_first_api_name():
    import subprocess
    import sys

    code = "import sys, dcpsim; a = 'torch' in sys.modules; dcpsim.run; print(a, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


def test_the_api_names_are_the_api_packages():
    import dcpsim.api

    assert set(dcpsim.api.__all__) == set(dcpsim._API)
    assert dcpsim.Engine is dcpsim.api.Engine and dcpsim.ReferenceEngine().name == "reference"
    with pytest.raises(AttributeError):
        dcpsim.no_such_name  # noqa: B018


@pytest.mark.slow
def test_a_trace_is_written_and_its_line_kept_in_the_notes(tmp_path):
    path = tmp_path / "trace.json"
    report = dcpsim.run("llama-gqa", dcp=2, in_process=True, trace=str(path))
    events = json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    assert report.passed and len(events) > 10
    assert any(note.startswith("dcpsim: trace of") and str(path) in note for note in report.notes)
