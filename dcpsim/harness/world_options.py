"""``WorldOptions``: where and how long a job's ranks run (``--in-process``, ``--timeout``,
``--deadline``, ``--trace``). They say how the parent runs a job, not what the job is, so a
replay record leaves them out and a replay takes its own."""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.options import option

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorldOptions:
    in_process: bool = option(False, "run the ranks as threads of this process (no gloo; for quick debugging)")
    timeout: float = option(DEFAULT_TIMEOUT_S, f"process-group timeout in seconds (default {DEFAULT_TIMEOUT_S:g})", metavar="S")
    deadline: float | None = option(None, "kill the world after S seconds (default: 2 * timeout + 30)", metavar="S")
    trace: str | None = option(
        None,
        "write a Chrome trace-event JSON timeline of every rank (steps, writes per group, verification, "
        "collectives and their bytes, the first failure) to FILE; open it in ui.perfetto.dev",
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        check_seconds("--timeout", self.timeout)
        check_seconds("--deadline", self.deadline)

    def deadline_for(self, jobs: int) -> float:
        """The deadline of a world of ``jobs`` jobs: the one given, else a backstop (a hang
        ends at the process-group timeout) of ``2 * timeout + 30`` s for one job and 10 s
        more per further job, so a long batch of healthy runs is never cut short."""
        if self.deadline is not None:
            return self.deadline
        return 2 * self.timeout + 30 + 10 * (jobs - 1)


def check_seconds(flag: str, value: float | None) -> None:
    """A time limit must be a positive number of seconds (exit 2 before any rank starts)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value!r}")
    if not (value > 0 and value != float("inf")):
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value:g}")
