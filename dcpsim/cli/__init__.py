"""Command line: ``python -m dcpsim <command>``. Flags follow vLLM's names.

Exit codes: 0 every check passed; 1 a correctness check failed; 2 usage, scenario or
configuration error (reported before any rank starts); 3 harness failure (a rank crashed
or hung, a timeout, or the rendezvous failed).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dcpsim.errors import EXIT_USAGE, DcpsimError


class _Parser(argparse.ArgumentParser):
    """argparse that exits with our usage code (2) and one clear line."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        print(f"dcpsim: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


# name, help, module (with add_arguments(parser) and run(args)): one entry a command.
COMMANDS = (
    ("run", "simulate a scenario on W gloo ranks and verify every write", "dcpsim.cli.run"),
    ("worker", "one rank of a world started by torchrun (env://)", "dcpsim.cli.worker"),
    ("replay", "rerun exactly the configuration and schedule of a JSON report", "dcpsim.cli.replay"),
    ("layout", "show which rank stores each position, and its slots", "dcpsim.cli.layout"),
    ("list", "the built-in scenarios, one line each", "dcpsim.cli.listing"),
    ("matrix", "run every valid scenario x W x I x B cell and print a table", "dcpsim.cli.matrix"),
    ("merge", "join the JSON or JUnit reports of matrix --shard K/N runs; exit 1 if a cell failed",
     "dcpsim.cli.merge"),
    ("fuzz", "search random schedules for a failure, shrink it and save it", "dcpsim.cli.fuzz"),
    ("selftest", "inject every known DCP bug where it applies; each must be caught, baselines must pass",
     "dcpsim.cli.selftest"),
    ("engine", "fetch vLLM's source, or show what an engine under test runs", "dcpsim.cli.engine"),
    ("capacity", "per KV-cache group and rank: page bytes, pool tokens and concurrency for each DCP size",
     "dcpsim.cli.capacity"),
    ("interleave", "run a scenario's schedule at several interleave sizes and compare the ranks' loads",
     "dcpsim.cli.interleave"),
)


DESCRIPTION = """Simulate DCP (Decode Context Parallel) KV-cache layouts on CPU ranks joined by gloo,
and verify every write. Flags follow vLLM's names."""
EPILOG = """exit codes:
  0  every check passed
  1  a correctness check failed
  2  usage, scenario or configuration error (reported before any rank starts)
  3  harness failure (a rank crashed or hung, a timeout, or the rendezvous failed)

Run 'python -m dcpsim COMMAND --help' for the flags of one command."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dcpsim", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
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
