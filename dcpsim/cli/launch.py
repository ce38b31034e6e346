"""Running one job from the command line (``run``, ``replay``): ``dcpsim.harness.launch``
(the checks before any rank starts, the world, the report, the trace), with its warnings
and notes on stderr and the report on stdout."""

from __future__ import annotations

import sys

from dcpsim.cli.outcome import finish, json_errors
from dcpsim.cli.progress import print_waiting
from dcpsim.harness import launch
from dcpsim.harness.job import Job
from dcpsim.model.scenario import Scenario

attention_width = launch.attention_width


def _stderr(line: str) -> None:
    """A warning or note of the launch, on stderr."""
    print(line, file=sys.stderr)


def check_run_budget(
    scenario: Scenario, *, force: bool = False, in_process: bool = False, attention_width: int = 0,
    local_ranks: int | None = None, say: bool = True,
) -> None:  # fmt: skip
    """``harness.launch.check_run_budget``, its warning on stderr (if ``say``)."""
    launch.check_run_budget(
        scenario, force=force, in_process=in_process, attention_width=attention_width, local_ranks=local_ranks,
        say=_stderr if say else launch.silent,
    )  # fmt: skip


def check_dry_run(job: Job, say: bool = True) -> None:
    """``harness.launch.check_dry_run``, its notes on stderr (if ``say``)."""
    launch.check_dry_run(job, _stderr if say else launch.silent)


def run_job(job: Job, *, as_json: bool = False, force: bool = False) -> int:
    """Validate, start a world (or threads), verify, print; the exit code of the verdict."""
    with json_errors(as_json):
        report, trace = launch.launch_job(job, force=force, say=_stderr, on_wait=print_waiting)
    code = finish(report, as_json)
    if trace is not None:
        launch.write_trace(trace, report, _stderr)
    return code
