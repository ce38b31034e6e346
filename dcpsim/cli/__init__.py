"""Command line: ``python -m dcpsim <command>``. Flags follow vLLM's names.

Exit codes: 0 every check passed; 1 a correctness check failed; 2 usage, scenario or
configuration error (reported before any rank starts); 3 harness failure (a rank crashed
or hung, a timeout, or the rendezvous failed); 128 + N interrupted by signal N (130 Ctrl-C,
143 SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dcpsim.cli import exit_codes, signals
from dcpsim.cli.outcome import error_json
from dcpsim.engine.loading import forkserver
from dcpsim.errors import EXIT_USAGE, ConfigError, DcpsimError, HarnessError
from dcpsim.harness.world import RANK_PRELOAD, start_forkserver


class _Parser(argparse.ArgumentParser):
    """argparse that exits with our usage code (2) and one clear line (and, when the
    command line asks for ``--json``, one JSON error document on stdout)."""

    wants_json = False
    """Set by ``main`` when ``--json`` is on the command line."""

    def error(self, message: str):  # argparse API
        self.print_usage(sys.stderr)
        print(f"dcpsim: error: {message}", file=sys.stderr)
        if _Parser.wants_json:
            print(error_json(ConfigError(message)))
        sys.exit(EXIT_USAGE)


# name, help, module (with add_arguments(parser) and run(args)): one entry a command.
COMMANDS = (
    ("run", "simulate a scenario on W gloo ranks and verify every write", "dcpsim.cli.run"),
    ("worker", "one rank of a world started by torchrun (env://)", "dcpsim.cli.worker"),
    ("replay", "rerun exactly the configuration and schedule of a JSON report", "dcpsim.cli.replay"),
    ("layout", "show which rank stores each position, and its slots", "dcpsim.cli.layout"),
    ("list", "the built-in scenarios, one line each", "dcpsim.cli.listing"),
    ("matrix", "run every valid scenario x W x I x B cell and print a table", "dcpsim.cli.matrix"),
    ("merge", "join the JSON or JUnit reports of matrix --shard K/N runs; exit 1 if a cell failed", "dcpsim.cli.merge"),
    ("fuzz", "search random schedules for a failure, shrink it and save it", "dcpsim.cli.fuzz"),
    ("selftest", "inject every known DCP bug where it applies; each must be caught, baselines must pass", "dcpsim.cli.selftest"),
    ("engine", "fetch vLLM's source, or show what an engine under test runs", "dcpsim.cli.engine"),
    ("capacity", "per KV-cache group and rank: page bytes, pool tokens and concurrency for each DCP size", "dcpsim.cli.capacity"),
    ("interleave", "run a scenario's schedule at several interleave sizes and compare the ranks' loads", "dcpsim.cli.interleave"),
)


DESCRIPTION = """Simulate DCP (Decode Context Parallel) KV-cache layouts on CPU ranks joined by gloo,
and verify every write. Flags follow vLLM's names."""
EPILOG = """exit codes:
  0  every check passed
  1  a correctness check failed
  2  usage, scenario or configuration error (reported before any rank starts)
  3  harness failure (a rank crashed or hung, a timeout, or the rendezvous failed)
  130, 143, 129  interrupted by Ctrl-C, SIGTERM or SIGHUP (128 + the signal; the ranks are killed)

Run 'python -m dcpsim COMMAND --help' for the flags of one command."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dcpsim", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own (python -m dcpsim)
        _start_forkserver_early(sys.argv[1:])
    parser = build_parser()
    _Parser.wants_json = "--json" in (sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a usage error: under --exit-codes git-bisect, a skip too
        raise SystemExit(exit_codes.usage_code(exc.code, sys.argv[1:] if argv is None else argv)) from None
    signals.install()
    code = _run(args)
    return exit_codes.mapped(code, getattr(args, "exit_codes", None))


def _run(args) -> int:
    """The command's exit code, or the one of the error it ended in (said on stderr)."""
    try:
        return int(args.handler(args) or 0)
    except DcpsimError as exc:
        print(f"dcpsim: error: {exc}", file=sys.stderr)
        _json_error(args, exc)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except MemoryError as exc:  # the estimate (harness.budget) let through a run that did not fit
        error = HarnessError(
            f"out of memory in the parent process{': ' + str(exc) if str(exc) else ''}; "
            "the run needs more memory than this machine (or its limits) can give"
        )
        print(f"dcpsim: error: {error}", file=sys.stderr)
        _json_error(args, error)
        return error.exit_code
    except (KeyboardInterrupt, signals.Terminated) as exc:
        code = signals.exit_code(exc)
        print(f"dcpsim: {signals.describe(exc)}", file=sys.stderr)
        _json_error(args, Interrupted(signals.describe(exc), code))
        return code
    except Exception as exc:  # a bug in dcpsim: its traceback follows, after the JSON document
        _json_error(args, InternalError(f"{type(exc).__name__}: {exc}"))
        raise


WORLD_COMMANDS = ("run", "matrix", "selftest", "fuzz", "replay", "interleave")
"""Commands that start gloo worlds (unless ``--in-process``)."""


def _start_forkserver_early(argv: list[str]) -> None:
    """Start the ranks' forkserver before this process imports torch (building the parser
    does), so the two imports overlap: ~2 s less before the first rank of a run starts."""
    if not argv or argv[0] not in WORLD_COMMANDS or {"--in-process", "-h", "--help"} & set(argv):
        return
    preload = (RANK_PRELOAD,)
    real = ("vllm", "sglang", "vllm-ascend")
    if {*real, *(f"--engine={e}" for e in real)} & set(argv):  # as harness.runner preloads for it
        preload += ("dcpsim.engine.loading.preload",)
        engine = engine_flags(argv)
        if engine.get("name") in real:  # its source tree loaded once, in the forkserver
            forkserver.ask([("dcpsim.engine.choice:build_choice", engine)])
    start_forkserver(preload)


def engine_flags(argv: list[str]) -> dict:
    """``--engine`` and the ``--vllm-*`` / ``--sglang-*`` flags of ``argv`` as ``EngineChoice``
    fields, read without the parser (building it imports torch): a guess for the forkserver's
    build, which a rank whose engine differs just does not use."""
    fields: dict = {}
    for k, token in enumerate(argv):
        flag, eq, value = token.partition("=")
        if flag != "--engine" and not flag.startswith(("--vllm-", "--sglang-")):
            continue
        if not eq:
            if k + 1 >= len(argv):
                continue
            value = argv[k + 1]
        key = "name" if flag == "--engine" else flag[2:].replace("-", "_")
        fields[key] = int(value) if value.isdigit() else value
    return fields


class InternalError(HarnessError):
    """An unexpected exception (a bug in dcpsim; for the ``--json`` error document)."""


class Interrupted(DcpsimError):
    """Ctrl-C, SIGTERM or SIGHUP (for the ``--json`` error document)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _json_error(args, exc: DcpsimError) -> None:
    """Under ``--json``, one JSON error document on stdout, unless the command printed it
    already (or it is a torchrun worker other than rank 0)."""
    if not getattr(args, "json", False) or getattr(exc, "json_printed", False):
        return
    if args.command == "worker" and os.environ.get("RANK", "0") != "0":
        return
    try:
        print(error_json(exc), flush=True)
    except BrokenPipeError:
        pass
