"""``dcpsim run``: simulate a scenario on a world of W gloo ranks started here."""

from __future__ import annotations

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


def run(args) -> int:
    with json_errors(args.json):
        job = make_job(args, resolve_scenario(args))
    return run_job(job, args)
