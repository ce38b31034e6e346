"""``--exit-codes``: how ``run`` reports its verdict to a caller that reads exit codes its own way.

``dcpsim`` (the default) keeps dcpsim's codes (0 pass, 1 a failed check, 2 a usage or
configuration error, 3 a broken harness). ``git-bisect`` speaks ``git bisect run``'s language:
0 good (passed), 1 bad (a check failed), and 125 skip for anything that could not judge (2, 3:
the commit is neither good nor bad, say a tree dcpsim cannot bind or that does not import);
interrupts keep their codes, so git stops the bisect.
"""

from __future__ import annotations

from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_HARNESS, EXIT_OK, EXIT_USAGE

STYLES = ("dcpsim", "git-bisect")
GIT_SKIP = 125
"""``git bisect run``'s "cannot test this commit"."""


def add_argument(p) -> None:
    p.add_argument(
        "--exit-codes",
        choices=STYLES,
        default="dcpsim",
        help="dcpsim (default): 0 pass, 1 failed check, 2 usage, 3 harness; git-bisect: 0 pass, 1 failed check, "
        "125 (skip) for anything that could not judge (2, 3), for git bisect run",
    )


def mapped(code: int, style: str | None) -> int:
    """``code`` in ``style`` (None: dcpsim's own)."""
    if style != "git-bisect":
        return code
    if code in (EXIT_OK, EXIT_CHECK_FAILED):
        return code
    if code in (EXIT_USAGE, EXIT_HARNESS):
        return GIT_SKIP
    return code


def usage_code(code, argv: list[str]) -> int:
    """The exit code of a command line argparse refused (``code``), in the style ``argv`` asks for."""
    style = "git-bisect" if "git-bisect" in argv and any(a.startswith("--exit-codes") for a in argv) else None
    return mapped(code if isinstance(code, int) else EXIT_USAGE, style) if code else 0
