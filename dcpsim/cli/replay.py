"""``dcpsim replay``: rerun exactly the configuration and schedule recorded in a JSON report."""

from __future__ import annotations

import dataclasses

from dcpsim.cli.flags import options_from
from dcpsim.cli.launch import run_job
from dcpsim.cli.options import add_force_argument, add_verify_argument, add_world_arguments
from dcpsim.cli.outcome import json_errors
from dcpsim.harness.replay import load_replay
from dcpsim.harness.world_options import WorldOptions


def add_arguments(p) -> None:
    p.add_argument("report", help="a report written by run, worker or matrix with --json")
    p.add_argument("--cell", metavar="ID", help="with a matrix report: the cell to rerun (default: the first that failed)")
    p.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    add_verify_argument(p, default=None)
    add_world_arguments(p, timeout=True)
    add_force_argument(p)


def run(args) -> int:
    with json_errors(args.json):
        job = load_replay(args.report, args.cell)
        changes = dict(world=options_from(WorldOptions, args))
        if args.verify is not None:  # default: the recorded mode
            changes["check"] = dataclasses.replace(job.check, mode=args.verify)
        job = dataclasses.replace(job, **changes)
    return run_job(job, as_json=args.json, force=args.force)
