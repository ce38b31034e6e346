"""``dcpsim.selftest``: inject every known DCP bug where it applies; each must be caught and
every baseline must pass (``campaigns.selftest_run``, as ``python -m dcpsim selftest``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dcpsim.api.matrix import MatrixOptions
from dcpsim.campaigns.selftest import format_table
from dcpsim.campaigns.selftest_run import SelftestResult, plan_of, run_selftest


@dataclass(frozen=True)
class SelftestReport:
    passed: bool
    faults: dict
    """Fault name -> ``detected``, ``missed``, ``error`` or ``not applicable``."""
    summary: tuple[str, ...]
    result: SelftestResult = field(repr=False, compare=False, default=None)

    def to_dict(self) -> dict:
        """The ``selftest --json`` document."""
        return self.result.document()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def text(self) -> str:
        return format_table(self.result.rows) + "\n\n" + "\n".join(self.summary)


def selftest(
    faults: list[str] | None = None, scenarios: list[str] | None = None, *, engine: str = "reference", in_process: bool = False,
    progress=None, on_wait=None, **config,
) -> SelftestReport:  # fmt: skip
    """Run the selftest of ``faults`` (default every one) on ``scenarios`` (default every
    built-in); the baselines run ``engine``. ``progress(row)`` as each run ends."""
    options = MatrixOptions.of(engine=engine, in_process=in_process, **config)
    plan, pd_chosen = plan_of(faults, scenarios)
    result = run_selftest(plan, pd_chosen, engine=options.engine, world=options.world, progress=progress, on_wait=on_wait)
    doc = result.document()
    return SelftestReport(result.passed, doc["faults"], tuple(result.summary), result)
