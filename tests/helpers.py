"""Helpers shared by the test packages (also offered as fixtures by ``conftest.py``)."""

from __future__ import annotations

import functools
import json

from dcpsim.cli import main
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.harness.batch import merge_rank_reports
from dcpsim.harness.collectives import run_in_threads
from dcpsim.harness.job import Job
from dcpsim.harness.rank import run_rank
from dcpsim.scenarios.load import load_scenario


def builtin(name: str, W: int, I: int = 1, **overrides):
    """A built-in scenario at ``W`` ranks and interleave ``I`` (plus ``with_overrides``)."""
    return load_scenario(name).with_overrides(
        decode_context_parallel_size=W, cp_kv_cache_interleave_size=I, **overrides)


def geometries(scenario, engine=None):
    """The (reference, or ``engine``'s) group geometries of a scenario."""
    return (engine or ReferenceEngine()).geometries(scenario.layers, scenario.config)


def scheduler(scenario, engine=None) -> Scheduler:
    """A fresh scheduler of the reference engine (or of ``engine``)."""
    engine = engine or ReferenceEngine()
    return Scheduler(scenario, engine, geometries(scenario, engine))


def run(scenario, *, engine=None, **job):
    """Run in process (ranks as threads); every rank must reach the same verdict. Returns the
    merged report. ``engine``: an engine variant to run instead of the job's."""
    W = scenario.config.decode_context_parallel_size
    reports = run_in_threads(functools.partial(run_rank, engine=engine), Job(scenario, **job), W)
    verdicts = {(r.passed, r.failure.kind if r.failure else None, r.steps, r.attention_checks) for r in reports}
    assert len(verdicts) == 1, f"ranks disagree: {verdicts}"
    return merge_rank_reports(reports)


def run_json(capsys, *argv) -> tuple[int, dict]:
    """``python -m dcpsim ARGV --json``: the exit code and the one JSON document on stdout."""
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)
