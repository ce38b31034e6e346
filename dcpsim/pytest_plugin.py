"""dcpsim's pytest plugin, registered by the package (the ``pytest11`` entry point ``dcpsim``):
an engine's repository with dcpsim installed needs no conftest (docs/api.md).

- fixture ``dcpsim_run``: ``dcpsim.run`` with the session's engine options applied
  (``--dcpsim-engine NAME``, ``--dcpsim-vllm-source DIR``, ``--dcpsim-sglang-source DIR``,
  ``--dcpsim-vllm-ascend-source DIR``, ``--dcpsim-in-process``);
- ``--dcpsim-matrix [SCENARIO,...]``: the session is the correctness matrix, one test item per
  cell (its id as ``dcpsim matrix`` prints it; default every built-in), the other tests
  deselected; the cells of one (scenario, W) share one world (``Worlds``; under pytest-xdist's
  ``--dist load`` each world's items go to one worker, ``pytest_xdist_make_scheduler``);
  ``--dcpsim-shard K/N`` keeps shard K of N (the cells of ``dcpsim matrix --shard K/N``); each
  item's JUnit properties carry the shard record, so ``dcpsim merge`` joins the
  ``--junitxml`` files of the shards.

A failing engine fails the item, with the text report as its message (``dcpsim.CheckFailed``
anywhere in a test is shown that way); a bad option is a ``pytest.UsageError``.

pytest loads the plugin into every session of an environment where dcpsim is installed, so
it imports the API (and torch) only once a session uses it: an option of its own, the
fixture, a ``CheckFailed``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dcpsim.campaigns.shard import parse_shard
from dcpsim.errors import CheckFailed, ConfigError, HarnessError

SOURCES = ("vllm_source", "sglang_source", "vllm_ascend_source")
"""The engines' source-tree options, ``--dcpsim-vllm-source``, ``--dcpsim-sglang-source`` and
``--dcpsim-vllm-ascend-source``."""


def pytest_addoption(parser) -> None:
    group = parser.getgroup("dcpsim", "dcpsim: DCP KV-cache layouts of the engine under test")
    group.addoption(
        "--dcpsim-engine",
        metavar="NAME",
        default="reference",
        help="the engine under test of dcpsim_run and --dcpsim-matrix: reference (default), vllm, sglang, vllm-ascend, or MODULE:ATTR",
    )
    group.addoption("--dcpsim-vllm-source", metavar="DIR", help="--dcpsim-engine vllm: a directory holding vllm/ (a checkout, a wheel)")
    group.addoption(
        "--dcpsim-sglang-source", metavar="DIR", help="--dcpsim-engine sglang: a directory holding sglang/ (a checkout's python/, a wheel)"
    )
    group.addoption(
        "--dcpsim-vllm-ascend-source",
        metavar="DIR",
        help="--dcpsim-engine vllm-ascend: a directory holding vllm_ascend/ (with --dcpsim-vllm-source, the vLLM it runs on)",
    )
    group.addoption(
        "--dcpsim-engine-partial",
        action="store_true",
        help="--dcpsim-engine vllm or sglang: where the tree holds a decision's code in no known shape (an engine's main "
        "branch newer than the releases dcpsim knows), the reference makes exactly those decisions, named in each report",
    )
    group.addoption("--dcpsim-in-process", action="store_true", help="run the ranks as threads of the test process (no gloo)")
    group.addoption(
        "--dcpsim-matrix",
        nargs="?",
        const="",
        default=None,
        metavar="SCENARIO,...",
        help="run the correctness matrix instead of the collected tests: one item per cell of dcpsim matrix "
        "[SCENARIO...] (default every built-in); write --dcpsim-matrix=a,b (or put it last) so that a path is not "
        "taken for the scenario list",
    )
    group.addoption(
        "--dcpsim-shard",
        metavar="K/N",
        help="run shard K of N (1-based) of the matrix: of --dcpsim-matrix's cells, else (dcpsim's own tests) of dcpsim matrix --full's",
    )


def pytest_configure(config) -> None:
    config._dcpsim_options = None  # built on first use (the fixture), or here for an option of ours
    config._dcpsim_scenarios = None
    config._dcpsim_shard = None
    options = ("dcpsim_in_process", "dcpsim_engine_partial", "dcpsim_matrix", "dcpsim_shard", *(f"dcpsim_{s}" for s in SOURCES))
    given = [config.getoption(o) for o in options]
    if config.getoption("dcpsim_engine") == "reference" and all(v in (None, False) for v in given):
        return
    try:
        config._dcpsim_options = _options(config)
        shard = config.getoption("dcpsim_shard")
        config._dcpsim_shard = parse_shard(shard, "--dcpsim-shard") if shard is not None else None
        config._dcpsim_scenarios = _scenarios(config.getoption("dcpsim_matrix"))
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None


def _options(config):
    """The session's ``MatrixOptions``: its engine (built once here) and worlds."""
    from dcpsim.api.matrix import MatrixOptions

    given = dict(engine=config.getoption("dcpsim_engine"), in_process=config.getoption("dcpsim_in_process"))
    given.update({source: config.getoption(f"dcpsim_{source}") for source in SOURCES if config.getoption(f"dcpsim_{source}")})
    if config.getoption("dcpsim_engine_partial"):
        given["engine_partial"] = True
    try:
        return MatrixOptions.of(**given)
    except ConfigError as exc:
        raise ConfigError(f"--dcpsim-engine {given['engine']}: {exc}") from None


def _scenarios(text: str | None) -> list[str] | None:
    """``--dcpsim-matrix``'s scenarios (every built-in for a bare flag; None without it)."""
    if text is None:
        return None
    from dcpsim.scenarios.registry import builtin_scenario_names

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = builtin_scenario_names()
    for name in names:
        if name not in known and not (name.endswith(".toml") and Path(name).is_file()):
            raise ConfigError(
                f"--dcpsim-matrix: {name!r} is neither a built-in scenario ({', '.join(known)}) nor a .toml file "
                "(a path after a bare --dcpsim-matrix is taken as its list: write --dcpsim-matrix= or put it last)"
            )
    return names or list(known)


@pytest.fixture
def dcpsim_run(request):
    """``dcpsim.run`` with the session's ``--dcpsim-engine``, its source options (``SOURCES``),
    ``--dcpsim-engine-partial`` and ``--dcpsim-in-process``; a keyword given in the call wins, and
    a call that names its own ``engine`` takes none of the session's engine options."""
    from dcpsim.api import run

    options = request.config._dcpsim_options or _options(request.config)
    engine = dict(engine=options.engine.name)
    engine.update({source: getattr(options.engine, source) for source in SOURCES if getattr(options.engine, source)})
    if options.engine.engine_partial:
        engine["engine_partial"] = True

    def session_run(scenario, **kwargs):
        defaults = dict(in_process=options.world.in_process, **({} if "engine" in kwargs else engine))
        return run(scenario, **{**defaults, **kwargs})

    return session_run


def pytest_collection_modifyitems(session, config, items) -> None:
    scenarios = getattr(config, "_dcpsim_scenarios", None)
    if scenarios is None:
        return
    from dcpsim.campaigns.matrix_plan import matrix_cells, matrix_digest, shard_indices

    shard = config._dcpsim_shard
    try:
        everything = matrix_cells(scenarios, dry_run=False)  # each item dry-runs its own cell
        indices = shard_indices(everything, shard)
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    options = config._dcpsim_options
    k, n = shard or (1, 1)
    digest = matrix_digest(everything, options.engine, options.check)
    record = json.dumps({"hash": digest, "cells": len(everything), "shard": f"{k}/{n}"}, sort_keys=True)
    if items:
        config.hook.pytest_deselected(items=list(items))
    cells = [everything[i] for i in indices]
    first = {}  # each world's place: its first cell's (the full list has a world's cells together already)
    order = sorted(range(len(cells)), key=lambda j: first.setdefault(cells[j].cell.group, j))
    items[:] = [
        MatrixCellItem.from_parent(session, name=cells[j].cell.id, nodeid=cells[j].cell.id, cell=cells[j], index=indices[j], record=record)
        for j in order
    ]
    config._dcpsim_worlds = Worlds(session, config._dcpsim_options, shared=_worlds_shared(config))


def _worlds_shared(config) -> bool:
    """Whether the cells of one world are all this process's to run: without pytest-xdist; on
    a worker, what the controller said (``pytest_configure_node``)."""
    if not hasattr(config, "workerinput"):
        return True
    return bool(config.workerinput.get("dcpsim_worlds_shared"))


def _scheduled_by_world(config) -> bool:
    """On the pytest-xdist controller of a ``--dcpsim-matrix`` session: whether every world's
    cells go to one worker: ``--dist load`` (``-n``'s default), scheduled by ``MatrixScheduling``,
    and ``--dist each``; any other ``--dist`` may split a world's cells between workers, and
    each item then starts a world of its own."""
    return getattr(config, "_dcpsim_scenarios", None) is not None and config.getvalue("dist") in ("load", "each")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist's controller, as it starts a worker: tell it whether it has whole worlds."""
    node.workerinput["dcpsim_worlds_shared"] = _scheduled_by_world(node.config)


class Worlds:
    """The outcomes of a session's matrix cells, run one world per (scenario, W): the first
    item of a world to run runs the cells of its world that this process runs (the items
    still to come, in order: ``api.matrix.run_cells``), and every later item takes its own
    cell's outcome. A cell is not run twice; if something outside the worlds breaks a batch
    (the worlds themselves are rerun cell by cell, so a failure or a hang is its own cell's),
    the cells it did not finish run each in a world of its own, as their items come."""

    def __init__(self, session, options, *, shared: bool):
        self.session, self.options, self.shared = session, options, shared
        self.outcomes: dict[str, object] = {}  # cell id -> a MatrixCell, or the reason its item skips
        self.alone: set[str] = set()  # worlds (groups) whose batch broke: their cells run one by one

    def outcome(self, item):
        """``item``'s cell: a ``MatrixCell``, or the reason to skip it (an invalid config)."""
        cell_id = item.cell.cell.id
        if cell_id not in self.outcomes:
            group = item.cell.cell.group
            batch = [item]
            if self.shared and group not in self.alone:
                batch += [
                    other
                    for other in self.session.items
                    if isinstance(other, MatrixCellItem) and other is not item and other.cell.cell.group == group
                    and other.cell.status == "pending" and other.cell.cell.id not in self.outcomes
                ]  # fmt: skip
            self._run(batch, group)
        return self.outcomes.pop(cell_id)  # taken once: a rerun item runs again

    def _run(self, batch, group) -> None:
        from dcpsim.api.matrix import run_cells
        from dcpsim.harness.dry_run import dry_run

        runnable = []
        for member in batch:
            try:
                dry_run(member.cell.scenario)
            except ConfigError as exc:
                self.outcomes[member.cell.cell.id] = f"invalid config: {exc}"
                continue
            runnable.append(member.cell)
        if not runnable:
            return
        try:
            for cell in run_cells(runnable, self.options, progress=lambda cell: self.outcomes.__setitem__(cell.id, cell)):
                self.outcomes.setdefault(cell.id, cell)
        except Exception as exc:
            if len(runnable) == 1:
                raise
            self.alone.add(group)  # the cells that ended keep their outcome; the others run alone
            message = f"dcpsim: the cells of world {group} broke off ({exc!r}); the rest run one world each"
            warnings.warn(pytest.PytestWarning(message), stacklevel=2)
            if batch[0].cell.cell.id not in self.outcomes:
                self._run(batch[:1], group)


class MatrixCellItem(pytest.Item):
    """One cell of the matrix. The cells of one (scenario, W) share a world (``Worlds``),
    threads with ``--dcpsim-in-process``; each item reports its own cell."""

    def __init__(self, *, cell, index: int, record: str, **kwargs):
        super().__init__(**kwargs)
        self.cell = cell
        self.user_properties += [("dcpsim.index", index), ("dcpsim.matrix", record)]

    def runtest(self) -> None:
        if self.cell.status == "skipped":
            pytest.skip(self.cell.reason)
        result = self.config._dcpsim_worlds.outcome(self)
        if isinstance(result, str):
            pytest.skip(result)
        if result.status == "fail":
            raise CheckFailed(result.report.text(), result.report)
        if result.status == "error":
            raise HarnessError(result.reason)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailed | HarnessError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"dcpsim matrix cell {self.name}"


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``--dist load`` (``-n``'s default) in a ``--dcpsim-matrix`` session: the
    cells of one world go to one worker together (``MatrixScheduling``); any other ``--dist``
    as xdist has it."""
    if getattr(config, "_dcpsim_scenarios", None) is None or config.getvalue("dist") != "load":
        return None
    return _matrix_scheduling(config, log)


def _matrix_scheduling(config, log):
    from xdist.scheduler import LoadScopeScheduling

    from dcpsim.campaigns.matrix_plan import matrix_cells

    class MatrixScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with a cell's world (``Cell.group``) as its scope: a worker
        is sent every item of a world at once, in order, the costliest worlds first (rank
        processes x cells, as ``campaigns.shard`` weighs them), each to the first worker free.
        (``--dist loadgroup`` would do it through ``xdist_group`` marks, but it appends the
        group to each item's id.)"""

        cells = {c.cell.id: c.cell for c in matrix_cells(config._dcpsim_scenarios, dry_run=False)}

        def _split_scope(self, nodeid: str) -> str:
            cell = self.cells.get(nodeid)
            return cell.group if cell is not None else nodeid

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_by_cost", False):  # the first assignment: the queue is complete
                self._by_cost = True
                units = sorted(self.workqueue.items(), key=lambda unit: -sum(self._cost(nodeid) for nodeid in unit[1]))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

        def _cost(self, nodeid: str) -> int:
            cell = self.cells.get(nodeid)
            return max(cell.dcp, 1) if cell is not None else 1

    return MatrixScheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A ``dcpsim.CheckFailed`` raised by a test: its text report is the failure's message."""
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, CheckFailed) and report.failed:
        report.longrepr = f"{item.nodeid}: the engine under test failed dcpsim's check\n{call.excinfo.value}"
    return report
