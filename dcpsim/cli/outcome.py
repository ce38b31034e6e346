"""How a command ends: the report on stdout and the verdict's exit code, and the one JSON
error document ``--json`` promises on every exit path.

Exit codes: 0 every check passed, 1 a check failed, 2 usage or scenario error,
3 harness failure (rank crash, timeout, rendezvous).
"""

from __future__ import annotations

import contextlib
import json

from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, DcpsimError


def finish(report, as_json: bool) -> int:
    print(report.to_json() if as_json else report.text())
    return EXIT_OK if report.passed else EXIT_CHECK_FAILED


def error_json(exc: DcpsimError) -> str:
    return json.dumps({"error": {"kind": type(exc).__name__, "message": str(exc)}, "exit_code": exc.exit_code})


@contextlib.contextmanager
def json_errors(as_json: bool):
    """``with json_errors(args.json): ...``: a ``DcpsimError`` inside also prints one JSON
    error document on stdout under ``--json`` (then propagates to the exit code)."""
    try:
        yield
    except DcpsimError as exc:
        if as_json and not getattr(exc, "json_printed", False):
            print(error_json(exc))
            exc.json_printed = True  # main() prints none of its own
        raise
