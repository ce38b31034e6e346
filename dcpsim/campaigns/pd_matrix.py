"""``dcpsim matrix --pd P:D,...``: P/D cells, one per scenario with a ``[disaggregated]`` table and
(prefill W, decode W) pair, all run in one world of the largest ``P + D``
(``harness.pd.run_pd_batch``). A pair the scenario's connector cannot take (NIXL:
sizes that do not divide one another) is skipped with the reason."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.harness.pd import run_pd_batch
from dcpsim.harness.pd_job import PDJob, prepare_pd
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.pd import check_disaggregation


@dataclass
class PDCell:
    scenario: str
    prefill: int
    decode: int
    status: str = "pending"
    """pending, pass, FAIL, skipped, error."""
    reason: str = ""
    seconds: float = 0.0
    report: object = None

    @property
    def id(self) -> str:
        return f"{self.scenario}-pd{self.prefill}:{self.decode}"


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        try:
            p, d = (int(x) for x in token.split(":"))
        except ValueError:
            raise ConfigError(f"--pd: expected pairs like 1:2,2:4 (prefill W:decode W), got {token!r}") from None
        if p < 1 or d < 1:
            raise ConfigError(f"--pd: sizes must be >= 1, got {token!r}")
        pairs.append((p, d))
    return pairs


def pair_scenario(scenario, prefill: int, decode: int):
    """The scenario with its instances at ``prefill`` and ``decode`` ranks (checked)."""
    pd = scenario.disaggregated
    pd = dataclasses.replace(
        pd,
        prefill=dataclasses.replace(pd.prefill, decode_context_parallel_size=prefill),
        decode=dataclasses.replace(pd.decode, decode_context_parallel_size=decode),
    )
    out = dataclasses.replace(scenario, disaggregated=pd)
    check_disaggregation(out)
    return out


def run_pd_matrix(names: list[str], pairs: list[tuple[int, int]], *, world: WorldOptions | None = None, on_wait=None) -> list[PDCell]:
    cells, jobs = [], []
    for name in names:
        scenario = load_scenario(name)
        for p, d in pairs:
            cell = PDCell(scenario.name, p, d)
            cells.append(cell)
            if scenario.disaggregated is None:
                cell.status, cell.reason = "skipped", "no [disaggregated] table"
                continue
            try:
                job = PDJob(pair_scenario(scenario, p, d))
                prepare_pd(job)
            except ConfigError as exc:
                cell.status, cell.reason = "skipped", str(exc).splitlines()[0]
                continue
            jobs.append((cell, job))
    if jobs:
        reports = run_pd_batch([j for _, j in jobs], world=world or WorldOptions(), on_wait=on_wait)
        for (cell, _), report in zip(jobs, reports):
            cell.report, cell.seconds = report, report.wall_time_s
            cell.status = "pass" if report.passed else "FAIL"
            if not report.passed:
                cell.reason = f"{'prefill' if report.prefill.failure else 'decode'}: {report.failure.lines()[0]}"
    return cells


def pd_table(cells: list[PDCell]) -> str:
    width = max((len(c.id) for c in cells), default=4)
    lines = [f"{'cell':<{width}}  result   note", f"{'-' * width}  -------  ----"]
    lines += [f"{c.id:<{width}}  {c.status:<7}  {c.reason}".rstrip() for c in cells]
    ran = [c for c in cells if c.status in ("pass", "FAIL")]
    lines.append(
        f"{len(ran)} P/D cells run: {sum(c.status == 'pass' for c in ran)} passed, "
        f"{sum(c.status == 'FAIL' for c in ran)} failed; {len(cells) - len(ran)} skipped"
    )
    return "\n".join(lines)
