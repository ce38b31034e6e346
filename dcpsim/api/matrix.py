"""``dcpsim.matrix``: the correctness matrix, as ``python -m dcpsim matrix`` runs it.

``plan_matrix`` lists the cells (``campaigns.matrix_plan``: the same list, ids and shards as
the command); ``matrix`` runs the pending ones and returns a ``MatrixReport`` whose
``to_json()`` is ``matrix --json``'s list. ``run_cell`` runs one cell; ``run_cells`` runs several,
one world per (scenario, W) (the pytest plugin's items).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dcpsim.api.report import Report
from dcpsim.campaigns import matrix as mx
from dcpsim.campaigns import matrix_plan
from dcpsim.campaigns.shard import parse_shard
from dcpsim.engine.choice import EngineChoice
from dcpsim.errors import ConfigError
from dcpsim.harness.world_options import WorldOptions
from dcpsim.options import from_flat, keys
from dcpsim.plural import plural
from dcpsim.verify.options import CheckOptions

MATRIX_KEYS = {"engine": EngineChoice, "check": CheckOptions, "world": WorldOptions}
"""The run options a matrix takes, by branch of the option tree (``verify``, ``vllm_source``,
``timeout``, ...); a cell's scenario options come from its place in the grid."""


@dataclass(frozen=True)
class MatrixOptions:
    """The engine, checks and worlds of every cell of a matrix."""

    engine: EngineChoice = field(default_factory=EngineChoice)
    check: CheckOptions = field(default_factory=CheckOptions)
    world: WorldOptions = field(default_factory=WorldOptions)

    @classmethod
    def of(cls, **options) -> MatrixOptions:
        """From run-option keys (``engine="vllm"``, ``verify="full"``, ``in_process=True``);
        a ``ConfigError`` naming an unknown key. The engine is validated (built once) here."""
        known = {k for tree in MATRIX_KEYS.values() for k in keys(tree)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(map(repr, unknown))}; a matrix takes: {', '.join(sorted(known))}")
        parts = {name: from_flat(tree, {k: v for k, v in options.items() if k in keys(tree)}) for name, tree in MATRIX_KEYS.items()}
        parts["engine"].validate()
        return cls(**parts)


@dataclass(frozen=True)
class MatrixCell:
    """One cell: its id (as ``dcpsim matrix`` prints it), its status (``pass``, ``fail``,
    ``error``, ``skipped``), the reason, and its run's ``Report`` (None unless it ran)."""

    id: str
    status: str
    reason: str
    seconds: float
    report: Report | None


@dataclass(frozen=True)
class MatrixReport:
    cells: tuple[MatrixCell, ...]
    entries: list = field(repr=False, compare=False, default_factory=list)
    """The ``matrix --json`` list."""
    table: str = field(repr=False, compare=False, default="")
    """The table ``dcpsim matrix`` prints."""

    @property
    def passed(self) -> bool:
        """No cell failed or broke its world (skipped cells are not failures)."""
        return not any(c.status in ("fail", "error") for c in self.cells)

    def to_json(self) -> str:
        return json.dumps(self.entries, indent=2)

    def text(self) -> str:
        return self.table


def plan_matrix(
    scenarios=None, *, dcp=None, interleave=None, block_size=None, pcp=None, full: bool = False, shard: str | None = None,
    force: bool = False, dry_run: bool = True,
) -> tuple[list[mx.CellResult], list[int]]:  # fmt: skip
    """(the matrix's full cell list, the indices of shard ``"K/N"``, all without one);
    ``dcp``, ``interleave``, ``block_size``, ``pcp``: lists as ``matrix``'s comma lists."""
    cells = matrix_plan.matrix_cells(
        scenarios, dcps=dcp, interleaves=interleave, block_sizes=block_size, pcps=pcp, full=full, force=force, dry_run=dry_run
    )
    return cells, matrix_plan.shard_indices(cells, parse_shard(shard) if shard is not None else None)


def matrix(
    scenarios=None, *, dcp=None, interleave=None, block_size=None, pcp=None, full: bool = False, shard: str | None = None,
    engine: str = "reference", in_process: bool = False, force: bool = False, progress=None, on_wait=None, **config,
) -> MatrixReport:  # fmt: skip
    """Run the matrix (or shard ``"K/N"`` of it) with the engine under test; ``progress(cell)``
    as each cell ends (a ``MatrixCell``). ``ConfigError`` if no cell can run."""
    options = MatrixOptions.of(engine=engine, in_process=in_process, **config)
    everything, indices = plan_matrix(scenarios, dcp=dcp, interleave=interleave, block_size=block_size, pcp=pcp, full=full, shard=shard,
                                      force=force)  # fmt: skip
    results = [everything[i] for i in indices]
    if not any(r.status == mx.CellStatus.PENDING for r in results):
        raise ConfigError(f"no cell can run ({plural(len(results), 'cell')}, every one skipped)")
    mx.run_cells(
        results, engine=options.engine, check=options.check, world=options.world, on_wait=on_wait,
        progress=(lambda res: progress(_cell(res))) if progress else None,
    )  # fmt: skip
    shard_kn = parse_shard(shard) if shard is not None else None
    entries = matrix_plan.entries(results, everything, indices, shard=shard_kn, engine=options.engine, check=options.check)
    return MatrixReport(tuple(_cell(r) for r in results), entries, mx.table(results))


def run_cell(res: mx.CellResult, options: MatrixOptions) -> MatrixCell:
    """Run one pending cell of ``plan_matrix`` (a fresh copy: the plan's stays pending)."""
    return run_cells([res], options)[0]


def run_cells(results: list[mx.CellResult], options: MatrixOptions, progress=None) -> list[MatrixCell]:
    """Run the pending cells of ``plan_matrix`` (fresh copies: the plan's stay pending) as
    ``matrix`` does, the cells of one (scenario, W) in one world, in turn; one ``MatrixCell``
    each, in order (a cell that is not pending as it is). A world that breaks or hangs is rerun
    cell by cell (``harness.runner.run_each``), so the failure is its own cell's.
    ``progress(cell)`` as each cell ends (a ``MatrixCell``): the pytest plugin keeps the
    cells that ended if something outside the worlds breaks the batch."""
    fresh = [mx.CellResult(r.cell, r.status, r.reason, scenario=r.scenario) for r in results]
    pending = [f for f in fresh if f.status == mx.CellStatus.PENDING]
    if pending:
        mx.run_cells(
            pending, engine=options.engine, check=options.check, world=options.world,
            progress=(lambda res: progress(_cell(res))) if progress else None,
        )  # fmt: skip
    return [_cell(f) for f in fresh]


def _cell(res: mx.CellResult) -> MatrixCell:
    return MatrixCell(res.cell.id, str(res.status), res.reason, res.seconds, Report.of(res.report) if res.report else None)
