"""Replays: a JSON report carries the resolved scenario and the run options.

``replay_record(job)`` is what ``run --json`` stores under ``"replay"``;
``load_replay(path)`` rebuilds the identical ``Job`` from a report (or from
a bare replay record), so ``dcpsim replay report.json`` reruns exactly the
failing configuration and schedule.
"""

from __future__ import annotations

import json
from pathlib import Path

from dcpsim.errors import ConfigError, ScenarioError
from dcpsim.harness.job import RUN_OPTIONS, Job
from dcpsim.options import flatten
from dcpsim.scenarios.dump import scenario_to_dict
from dcpsim.scenarios.load import scenario_from_dict

REPLAY_VERSION = 1


def replay_record(job: Job) -> dict:
    """The scenario and every run option of ``job`` (``RUN_OPTIONS``: all but where it runs)."""
    options = {key: value for key, value in flatten(job).items() if key in RUN_OPTIONS}
    return {"version": REPLAY_VERSION, "scenario": scenario_to_dict(job.scenario), "options": options}


def job_from_record(record: dict, source: str) -> Job:
    if not isinstance(record, dict) or "scenario" not in record:
        raise ScenarioError(f"{source}: no replay record (expected a report written with --json)")
    if record.get("version") != REPLAY_VERSION:
        raise ScenarioError(f"{source}: replay version {record.get('version')!r} is not {REPLAY_VERSION}")
    scenario = scenario_from_dict(record["scenario"], source=f"{source} (replay)")
    options = record.get("options", {})
    unknown = sorted(set(options) - set(RUN_OPTIONS))
    if unknown:
        raise ScenarioError(f"{source}: replay.options has unknown field(s) {unknown}")
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    try:
        return Job.from_options(scenario, **fixed)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ScenarioError(f"{source}: replay.options: {exc}") from None


def _pick_cell(cells: list, cell: str | None, path: str) -> dict:
    """From ``matrix --json`` output: the named cell, or the first that failed."""
    reports = {c.get("cell"): c for c in cells if isinstance(c, dict)}
    if cell is not None:
        if cell not in reports:
            raise ScenarioError(f"{path}: no cell {cell!r} in this matrix report")
        chosen = reports[cell]
    else:
        failed = [c for c in reports.values() if c.get("status") in ("fail", "error")]
        if not failed:
            raise ScenarioError(f"{path}: no failing cell in this matrix report; name one with --cell")
        chosen = failed[0]
    if not isinstance(chosen.get("report"), dict):
        raise ScenarioError(f"{path}: cell {chosen.get('cell')!r} has no report to replay ({chosen.get('status')})")
    return chosen["report"]


def load_replay(path: str, cell: str | None = None) -> Job:
    """The job of a ``run``/``worker --json`` report, or of one cell of a ``matrix --json`` report."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such report file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"{path}: not a JSON report: {exc}") from None
    if isinstance(data, list):
        data = _pick_cell(data, cell, path)
    record = data.get("replay", data) if isinstance(data, dict) else None
    if record is None:
        raise ScenarioError(f"{path}: the report has no replay record (it ended before the run started)")
    return job_from_record(record, path)
