"""``dcpsim run`` of a scenario with a ``[disaggregated]`` table: a prefill and a decode
instance in one gloo world, joined by a KV connector (``dcpsim.harness.pd``).

Flags override the table: ``--prefill-dcp W`` / ``--decode-dcp W`` (each instance's
``decode_context_parallel_size``), ``--prefill-interleave I`` / ``--decode-interleave I``,
``--prefill-block-size B`` / ``--decode-block-size B``, ``--prefill-pcp N``, ``--prefill-tp N`` and
``--kv-connector {nixl,resharding}``.
"""

from __future__ import annotations

import dataclasses
import sys

from dcpsim.cli.flags import options_from
from dcpsim.cli.outcome import json_errors
from dcpsim.cli.progress import print_waiting
from dcpsim.engine.choice import EngineChoice
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from dcpsim.harness.launch import PD_UNSUPPORTED, check_pd_options, launch_pd
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.pd import check_disaggregation

_INSTANCE_FLAGS = {
    "dcp": "decode_context_parallel_size",
    "interleave": "cp_kv_cache_interleave_size",
    "block_size": "block_size",
    "pcp": "prefill_context_parallel_size",
    "tp": "tensor_parallel_size",
}


def add_pd_arguments(p) -> None:
    g = p.add_argument_group("disaggregated prefill/decode (scenarios with a [disaggregated] table)")
    for role in ("prefill", "decode"):
        g.add_argument(
            f"--{role}-dcp", dest=f"{role}_dcp", type=int, metavar="W", help=f"the {role} instance's decode_context_parallel_size"
        )
        g.add_argument(
            f"--{role}-interleave",
            dest=f"{role}_interleave",
            type=int,
            metavar="I",
            help=f"the {role} instance's cp_kv_cache_interleave_size (nixl: its smallest block size when unset)",
        )
        g.add_argument(f"--{role}-block-size", dest=f"{role}_block_size", type=int, metavar="B", help=f"the {role} instance's block size")
        g.add_argument(
            f"--{role}-pcp",
            dest=f"{role}_pcp",
            type=int,
            metavar="N",
            help=f"the {role} instance's prefill_context_parallel_size (nixl: prefill only, W == N at TP 1)",
        )
        g.add_argument(
            f"--{role}-tp",
            dest=f"{role}_tp",
            type=int,
            metavar="N",
            help=f"the {role} instance's tensor_parallel_size (default: as for a plain run)",
        )
    g.add_argument(
        "--kv-connector",
        choices=("nixl", "resharding"),
        help="nixl: vLLM's block-level matching; resharding: position by position, any two layouts",
    )


def pd_overrides(args) -> dict:
    """The P/D flags given, as {role: {field: value}} plus ``kv_connector``."""
    out = {}
    for role in ("prefill", "decode"):
        for flag, fieldname in _INSTANCE_FLAGS.items():
            value = getattr(args, f"{role}_{flag}", None)
            if value is not None:
                if value < 1:
                    raise ConfigError(f"--{role}-{flag.replace('_', '-')} must be >= 1, got {value}")
                out.setdefault(role, {})[fieldname] = value
    if getattr(args, "kv_connector", None):
        out["kv_connector"] = args.kv_connector
    return out


def with_pd_overrides(scenario, overrides: dict):
    """``scenario`` with its instances and connector overridden, checked again."""
    if not overrides:
        return scenario
    if scenario.disaggregated is None:
        raise ConfigError(f"{scenario.source}: --prefill-*/--decode-*/--kv-connector need a scenario with a [disaggregated] table")
    pd = scenario.disaggregated
    changes = {role: dataclasses.replace(pd.instance(role), **overrides[role]) for role in ("prefill", "decode") if role in overrides}
    if "kv_connector" in overrides:
        changes["kv_connector"] = overrides["kv_connector"]
    out = dataclasses.replace(scenario, disaggregated=dataclasses.replace(pd, **changes))
    try:
        check_disaggregation(out)
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None
    return out


def run_disaggregated(args, scenario) -> int:
    with json_errors(args.json):
        given = {key: getattr(args, key, None) for key in ("decode_context_parallel_size", *PD_UNSUPPORTED)}
        given["rank_failure"] = getattr(args, "simulate_rank_failure", None)
        check_pd_options(given)
        world = options_from(WorldOptions, args)
        say = lambda line: print(line, file=sys.stderr)
        engine = options_from(EngineChoice, args)
        report = launch_pd(scenario, inject=args.inject, world=world, force=args.force, say=say, on_wait=print_waiting, engine=engine)
    print(report.to_json() if args.json else report.text())
    sys.stdout.flush()
    return EXIT_OK if report.passed else EXIT_CHECK_FAILED
