"""Errors a user can cause, each mapped to one exit code.

Exit codes (stable, documented in the README):
  0  every check passed
  1  a correctness check failed (the simulated engine wrote something wrong)
  2  usage, scenario or configuration error (nothing was run)
  3  harness failure (a rank crashed, hung, or the rendezvous failed)
  128 + N  interrupted by signal N: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (``dcpsim.cli.signals``)
"""

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_HARNESS = 3


class DcpsimError(Exception):
    """Base class: carries the exit code the CLI ends with."""

    exit_code = EXIT_HARNESS


class ConfigError(DcpsimError, ValueError):
    """An invalid configuration or spec; the message names the field and value."""

    exit_code = EXIT_USAGE


class ScenarioError(ConfigError):
    """A scenario that cannot be loaded; the message names the file and field."""


class HarnessError(DcpsimError):
    """The simulation could not run to completion (crash, timeout, rendezvous)."""

    exit_code = EXIT_HARNESS


class CheckFailed(DcpsimError):
    """A correctness check failed (``dcpsim.Report.raise_for_failure``); the message is the
    run's text report, ``report`` the ``dcpsim.Report``."""

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
