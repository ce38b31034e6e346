"""The correctness matrix: scenarios x DCP sizes x interleave sizes x block sizes (x PCP
sizes, with ``--pcp``: the world is then PCP x TP processes, TP the smallest that fits).

``expand`` lists every cell once with its verdict-to-be: valid (to run), or
skipped with the reason (an invalid DCP config, or a W = 1 cell that repeats
another's layout); a combination asked for twice (``B`` equal to a listed
interleave size, a scenario or block size given twice) is one cell. ``run_cells`` runs the valid cells, several per world (every cell of
one scenario and one W shares a world), so world start-up does not dominate;
a world that breaks is retried cell by cell so the failure is attributed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.harness.budget import check_budget
from dcpsim.harness.dry_run import dry_run as schedule_dry_run
from dcpsim.harness.job import Job
from dcpsim.harness.replay import replay_record
from dcpsim.harness.runner import run_each
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.attention_config import AttentionConfig
from dcpsim.model.kinds import Storage
from dcpsim.model.scenario import Scenario, ScenarioOverrides
from dcpsim.plural import plural
from dcpsim.scenarios.load import load_scenario
from dcpsim.verify.options import CheckOptions

DEFAULT_DCP = (1, 2, 3, 4, 8)
DEFAULT_INTERLEAVE = ("1", "2", "4", "8", "16", "B")


@dataclass(frozen=True)
class Cell:
    scenario: str
    dcp: int
    interleave: int
    block_size: int  # states per page of the paged groups, after overrides
    block_size_override: int | None = None
    kernel_block_size: int | None = None  # Bk (states); None: the kernel's block is the page
    pcp: int | None = None
    """``prefill_context_parallel_size`` (None: the scenario's own)."""
    attention: str | None = None
    """The LSE base (``e`` or ``2``) of a cell that also runs the attention check (``--attention``,
    the merge variants alternating step by step); None: the write path only."""

    @property
    def id(self) -> str:
        kbs = f"-kbs{self.kernel_block_size}" if self.kernel_block_size is not None else ""
        tail = "" if self.pcp is None else f"-pcp{self.pcp}"
        attn = "" if self.attention is None else f"-attn-lse{self.attention}"
        return f"{self.scenario}-dcp{self.dcp}-il{self.interleave}-bs{self.block_size}{kbs}{tail}{attn}"

    @property
    def attention_config(self) -> AttentionConfig:
        """The cell's attention check (off for a write-path cell)."""
        if self.attention is None:
            return AttentionConfig()
        return AttentionConfig(enabled=True, lse_base=self.attention, merge="alternate")

    @property
    def group(self) -> str:
        """Cells that share one world."""
        return f"{self.scenario}-dcp{self.dcp}" + ("" if self.pcp is None else f"-pcp{self.pcp}")


class CellStatus(enum.StrEnum):
    """A cell's verdict (a string in JSON): pending until it runs."""

    PENDING = "pending"
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    SKIPPED = "skipped"

    @property
    def bad(self) -> bool:
        return self in (CellStatus.FAIL, CellStatus.ERROR)


@dataclass
class CellResult:
    cell: Cell
    status: CellStatus
    reason: str = ""
    seconds: float = 0.0
    report: object = None
    scenario: Scenario | None = field(default=None, repr=False)


def page_states(scenario: Scenario) -> int:
    """The scenario's ``B`` for the matrix: the smallest page (in states) of its paged groups
    (rings and Mamba states excluded)."""
    geometries = ReferenceEngine().geometries(scenario.layers, scenario.config)  # validates too
    pages = [g.states_per_page for g in geometries if g.storage not in (Storage.RING, Storage.STATE)]
    return min(pages) if pages else 1


def _parse_interleave(token: str, b: int) -> int:
    if token == "B":
        return b
    try:
        value = int(token)
    except ValueError:
        raise ConfigError(f"--interleave: {token!r} is not an integer or B") from None
    return value


def expand(
    scenarios: list[str],
    dcps=DEFAULT_DCP,
    interleaves=DEFAULT_INTERLEAVE,
    block_sizes=(None,),
    dry_run: bool = True,
    kernel_block_size: int | None = None,
    pcps=(None,),
    force: bool = False,
    attention: str | None = None,
) -> list[CellResult]:
    """Every cell once, in order: valid ones with status 'pending', the rest 'skipped' with a reason.

    ``kernel_block_size`` (Bk, in states) applies to every cell when given; ``attention`` (an
    LSE base) makes every cell an attention cell (``Cell.attention``).

    ``dry_run`` also runs each valid cell's schedule in this process, which
    catches a workload that can never be admitted; without it only the layouts
    and pools are validated (cheap enough for test collection). A cell whose estimate
    (``harness.budget``) does not fit the machine is skipped, unless ``force``.
    """
    out: list[CellResult] = []
    listed: set[str] = set()  # cell ids: a combination asked for twice is one cell
    for name in scenarios:
        base = load_scenario(name)
        for bs in block_sizes:
            try:
                sized = base.with_overrides(ScenarioOverrides(block_size=bs)) if bs else base
                if kernel_block_size is not None:
                    sized = sized.with_overrides(ScenarioOverrides(kernel_block_size=kernel_block_size))
                b = page_states(sized)
            except ConfigError as exc:
                cell = Cell(base.name, 0, 0, bs or 0, bs, kernel_block_size, attention=attention)
                if cell.id not in listed:
                    listed.add(cell.id)
                    out.append(CellResult(cell, CellStatus.SKIPPED, f"invalid config: {exc}"))
                continue
            for w, p in [(w, p) for w in dcps for p in pcps]:
                seen: dict[int, str] = {}
                for token in interleaves:
                    i = _parse_interleave(str(token), b)
                    cell = Cell(base.name, w, i, b, bs, kernel_block_size, p, attention)
                    if cell.id in listed:
                        continue
                    listed.add(cell.id)
                    if w == 1 and seen:
                        first = next(iter(seen.values()))
                        out.append(CellResult(cell, CellStatus.SKIPPED, f"same layout as {first} (interleave has no effect when W = 1)"))
                        continue
                    seen[i] = cell.id
                    try:
                        scenario = sized.with_overrides(
                            ScenarioOverrides(
                                decode_context_parallel_size=w,
                                cp_kv_cache_interleave_size=i,
                                prefill_context_parallel_size=p,
                            )
                        )
                        engine = ReferenceEngine()
                        geometries = engine.geometries(scenario.layers, scenario.config)
                        check_budget(scenario, force=force, geometries=geometries)
                        if dry_run:
                            schedule_dry_run(scenario)
                        else:  # the pools and tables validate; no schedule runs
                            Scheduler(scenario, engine, geometries)
                    except ConfigError as exc:
                        out.append(CellResult(cell, CellStatus.SKIPPED, f"invalid config: {exc}"))
                        continue
                    out.append(CellResult(cell, CellStatus.PENDING, scenario=scenario))
    return out


def run_cells(
    results: list[CellResult], *, engine: EngineChoice | None = None, check: CheckOptions | None = None,
    world: WorldOptions | None = None, progress=None, on_wait=None,
) -> None:  # fmt: skip
    """Run every pending cell (in place), one world per (scenario, W) group, with the engine
    under test ``engine`` (default the reference), the checks ``check`` and the worlds
    ``world``. ``progress(res)`` is called as each cell ends (with the time its slowest rank
    took); ``on_wait(message)`` when a world keeps the parent waiting."""
    options = dict(engine=engine or EngineChoice(), check=check or CheckOptions(), world=world or WorldOptions())
    groups: dict[str, list[CellResult]] = {}
    for res in results:
        if res.status == CellStatus.PENDING:
            groups.setdefault(res.cell.group, []).append(res)
    for members in groups.values():
        members = _accepted_by_the_engine(members, options["engine"], progress)
        jobs = [Job(r.scenario, **options, attention=r.cell.attention_config) for r in members]

        def settle(k, outcome, members=members, jobs=jobs):
            res = members[k]
            res.seconds = outcome.seconds
            if outcome.error is not None:
                res.status, res.reason = CellStatus.ERROR, str(outcome.error).splitlines()[0]
            else:
                report = outcome.report
                report.replay = replay_record(jobs[k])
                res.report = report
                res.status = CellStatus.PASS if report.passed else CellStatus.FAIL
                res.reason = "" if report.passed else report.failure.lines()[0]
            if progress:
                progress(res)

        run_each(jobs, on_outcome=settle, on_wait=on_wait)


def _accepted_by_the_engine(members: list[CellResult], engine: EngineChoice, progress) -> list[CellResult]:
    """The cells the engine under test can run; a cell it refuses is skipped with the
    engine's reason (``EngineChoice.refusal``)."""
    kept = []
    for res in members:
        why = engine.refusal(res.scenario)
        if why is None:
            kept.append(res)
            continue
        res.status, res.reason = CellStatus.SKIPPED, f"the engine refuses it: {why}"
        if progress:
            progress(res)
    return kept


def cell_line(res: CellResult) -> str:
    """One finished cell for the progress display: ``dsv3-dcp2-il16-bs64 PASS (0.41 s)``,
    and the reason when it failed."""
    return f"{res.cell.id} {res.status.upper()} ({res.seconds:.2f} s)" + (f": {res.reason}" if res.reason else "")


def table(results: list[CellResult]) -> str:
    width = max([len(r.cell.id) for r in results] + [4])
    lines = [f"{'cell':<{width}}  {'result':<8} {'steps':>5} {'verified':>9} {'s':>6}  detail"]
    for r in results:
        steps = r.report.steps if r.report else ""
        verified = r.report.verified_indices if r.report else ""
        secs = f"{r.seconds:.2f}" if r.status not in (CellStatus.SKIPPED, CellStatus.PENDING) else ""
        lines.append(f"{r.cell.id:<{width}}  {r.status:<8} {steps!s:>5} {verified!s:>9} {secs:>6}  {r.reason}")
    counts = {s: sum(r.status == s for r in results) for s in (CellStatus.PASS, CellStatus.FAIL, CellStatus.ERROR, CellStatus.SKIPPED)}
    lines.append(
        f"{plural(len(results), 'cell')}: {counts[CellStatus.PASS]} passed, {counts[CellStatus.FAIL]} failed, "
        f"{plural(counts[CellStatus.ERROR], 'error')}, {counts[CellStatus.SKIPPED]} skipped"
    )
    return "\n".join(lines)
