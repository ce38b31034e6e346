"""``dcpsim run``: simulate a scenario on a world of W gloo ranks started here."""

from __future__ import annotations

from dcpsim.cli import exit_codes
from dcpsim.cli.launch import run_job
from dcpsim.cli.options import add_scenario_arguments, add_world_arguments, job_from_args, scenario_from_args
from dcpsim.cli.outcome import json_errors
from dcpsim.cli.pd import add_pd_arguments, pd_overrides, run_disaggregated, with_pd_overrides


def add_arguments(p) -> None:
    add_scenario_arguments(p)
    add_world_arguments(p)
    add_pd_arguments(p)
    exit_codes.add_argument(p)


def run(args) -> int:
    with json_errors(args.json):
        scenario = with_pd_overrides(scenario_from_args(args), pd_overrides(args))
        if scenario.disaggregated is not None:
            return run_disaggregated(args, scenario)
        job = job_from_args(args, scenario)
    return run_job(job, as_json=args.json, force=args.force)
