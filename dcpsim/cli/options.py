"""The flags ``run``, ``worker`` and ``replay`` share, and the scenario and ``Job`` they
build: every run option comes from the option tree (``Job``, ``ScenarioOverrides``;
``dcpsim.cli.flags``), so its default and help are written once, on its field."""

from __future__ import annotations

import argparse

from dcpsim.cli.flags import add_flags, options_from
from dcpsim.engine.choice import EngineChoice
from dcpsim.harness.job import Job, parse_rank_failure
from dcpsim.harness.launch import resolve_scenario
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.attention_config import AttentionConfig
from dcpsim.model.scenario import Scenario, ScenarioOverrides
from dcpsim.verify.options import CheckOptions


def add_scenario_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of one run (``run`` and ``worker``): the scenario, its overrides, the
    checks, the engine under test and the attention check."""
    p.add_argument("scenario", help="a scenario .toml file or the name of a built-in scenario")
    add_flags(p, ScenarioOverrides)
    add_flags(p, CheckOptions)
    p.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    add_flags(p, Job, only=("inject",))
    p.add_argument(
        "--simulate-rank-failure",
        metavar="KIND:RANK:STEP",
        help="make one rank raise, hang or exit (os._exit(17)) at a step, to check how the harness reports a broken world (exit 3)",
    )
    add_flags(p, WorldOptions, only=("timeout",))
    add_force_argument(p)
    add_engine_arguments(p)
    add_flags(p.add_argument_group("attention check"), AttentionConfig)


def add_force_argument(p: argparse.ArgumentParser) -> None:
    """``--force``: run even where the estimate of the run's memory says it does not fit."""
    p.add_argument(
        "--force",
        action="store_true",
        help="run even if the estimate of the run's memory (ranks, KV stores, block tables, schedule) exceeds what "
        "the machine has available",
    )


def add_verify_argument(p: argparse.ArgumentParser, default: str | None = "incremental") -> None:
    """``--verify``: what each check re-reads (run, worker, matrix, replay)."""
    add_flags(p, CheckOptions, only=("verify",), defaults={"verify": default})


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--engine`` and the vLLM engine's options (run, worker, matrix, selftest, fuzz, engine info)."""
    add_flags(p.add_argument_group("engine under test"), EngineChoice)


def engine_choice(args: argparse.Namespace) -> EngineChoice:
    """The engine flags as one ``EngineChoice`` (validated: the engine is built once here)."""
    choice = options_from(EngineChoice, args)
    choice.validate()
    return choice


def add_world_arguments(p: argparse.ArgumentParser, *, timeout: bool = False) -> None:
    """The flags of a world started here (``run`` and ``replay``; ``timeout`` for a command
    that has no ``--timeout`` of its own)."""
    add_flags(p, WorldOptions, only=("deadline", "in_process", "trace", *(("timeout",) if timeout else ())))


def scenario_from_args(args: argparse.Namespace, world_size: int | None = None) -> Scenario:
    """The scenario the flags name, with their overrides (``harness.launch.resolve_scenario``);
    under torchrun (``world_size``) W is the torchrun world size unless PCP or TP sets the grid."""
    return resolve_scenario(args.scenario, options_from(ScenarioOverrides, args), world_size)


def job_from_args(args: argparse.Namespace, scenario: Scenario) -> Job:
    """The run's ``Job``; every option is validated here, before any rank starts."""
    failure = args.simulate_rank_failure
    rank_failure = None if failure is None else parse_rank_failure(failure, scenario.config.world_size)
    return options_from(Job, args, scenario=scenario, rank_failure=rank_failure)
