"""``dcpsim run``: simulate a scenario on a world of W gloo ranks started here."""

from __future__ import annotations

from dcpsim.cli.disagg import add_pd_arguments, pd_overrides, run_disaggregated, with_pd_overrides
from dcpsim.cli.options import (
    add_scenario_arguments,
    add_world_arguments,
    json_errors,
    make_job,
    resolve_scenario,
    run_job,
)


def add_arguments(p) -> None:
    add_scenario_arguments(p)
    add_world_arguments(p)
    add_pd_arguments(p)


def run(args) -> int:
    with json_errors(args.json):
        scenario = with_pd_overrides(resolve_scenario(args), pd_overrides(args))
        if scenario.disaggregated is not None:
            return run_disaggregated(args, scenario)
        job = make_job(args, scenario)
    return run_job(job, args)
