"""``dcpsim replay``: rerun exactly the configuration and schedule recorded in a JSON report."""

from __future__ import annotations

import dataclasses

from dcpsim.cli.options import add_force_argument, add_verify_argument, add_world_arguments, json_errors, run_job


def add_arguments(p) -> None:
    p.add_argument("report", help="a report written by run, worker or matrix with --json")
    p.add_argument("--cell", metavar="ID", help="with a matrix report: the cell to rerun (default: the first that failed)")
    p.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    add_verify_argument(p, default=None)
    add_world_arguments(p, timeout=True)
    add_force_argument(p)


def run(args) -> int:
    from dcpsim.harness.replay import load_replay

    with json_errors(args.json):
        job = load_replay(args.report, args.cell)
    if args.verify is not None:  # default: the recorded mode
        job = dataclasses.replace(job, verify=args.verify)
    return run_job(job, args)
