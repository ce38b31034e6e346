"""Command line: ``python -m dcpsim <command>``. Flags follow vLLM's names."""

from __future__ import annotations

import argparse
import sys

from dcpsim.errors import EXIT_USAGE, DcpsimError


class _Parser(argparse.ArgumentParser):
    """argparse that exits with our usage code (2) and one clear line."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        print(f"dcpsim: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dcpsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    from dcpsim import layout_view

    p = sub.add_parser("layout", help="show which rank stores each position, and its slots")
    layout_view.add_arguments(p)
    p.set_defaults(handler=layout_view.run)

    from dcpsim import run_command

    p = sub.add_parser("run", help="simulate a scenario on W gloo ranks and verify every write")
    run_command.add_run_arguments(p)
    p.set_defaults(handler=run_command.run)

    from dcpsim import catalogue_command

    p = sub.add_parser("list", help="the built-in scenarios, one line each")
    catalogue_command.add_list_arguments(p)
    p.set_defaults(handler=catalogue_command.list_scenarios)

    p = sub.add_parser("matrix", help="run every valid scenario x W x I x B cell and print a table")
    catalogue_command.add_matrix_arguments(p)
    p.set_defaults(handler=catalogue_command.matrix)

    from dcpsim import fuzz_command

    p = sub.add_parser("fuzz", help="search random schedules for a failure, shrink it and save it")
    fuzz_command.add_arguments(p)
    p.set_defaults(handler=fuzz_command.fuzz)

    p = sub.add_parser("replay", help="rerun exactly the configuration and schedule of a JSON report")
    p.add_argument("report", help="a report written by run/worker --json (or by matrix/fuzz)")
    p.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="process-group timeout in seconds")
    p.add_argument("--deadline", type=float, metavar="S", help="kill the world after S seconds")
    p.add_argument("--in-process", action="store_true", help="run the ranks as threads of this process")
    p.set_defaults(handler=run_command.replay)

    from dcpsim import selftest

    p = sub.add_parser("selftest", help="inject every known DCP bug where it applies; each must be caught, baselines must pass")
    selftest.add_arguments(p)
    p.set_defaults(handler=selftest.run)

    p = sub.add_parser("worker", help="one rank of a world started by torchrun (env://)")
    run_command.add_scenario_arguments(p)
    p.set_defaults(handler=run_command.worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except DcpsimError as exc:
        print(f"dcpsim: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("dcpsim: interrupted", file=sys.stderr)
        return 130
