"""``CheckOptions``: what the checker re-reads at each verification and how often the ranks
exchange their rows (``--verify``, ``--paranoid``)."""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.validate import is_int
from dcpsim.options import option

VERIFY_MODES = ("incremental", "full")
"""``--verify``: what each check re-reads (``verify.check.Checker``)."""


@dataclass(frozen=True)
class CheckOptions:
    mode: str = option(
        "incremental",
        "incremental (default): each check re-reads what the KV stores' and block tables' change records say "
        "can have changed, with a full sweep as each request finishes and at the end; full: every check "
        "re-reads every live index",
        key="verify",
        choices=VERIFY_MODES,
    )
    paranoid: bool = option(False, "also gather raw read views and reassemble them explicitly")
    exchange_every: int = option(
        16,
        "verified steps whose rows the ranks exchange in one collective (Checker.exchange): each step is still "
        "read and judged as of that step; a failing step found in a later exchange has the run redone in "
        "lockstep for its report. 1: one exchange a step (also whenever the attention check, --paranoid, "
        "several DCP groups, PCP or a disaggregated instance are on, since their ranks meet in collectives "
        "every step anyway, and under --trace)",
        cli=False,
    )

    def __post_init__(self) -> None:
        if self.mode not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.mode!r}")
        if not is_int(self.exchange_every) or self.exchange_every < 1:
            raise ConfigError(f"exchange_every must be an integer >= 1, got {self.exchange_every!r}")

    @property
    def incremental(self) -> bool:
        return self.mode == "incremental"
