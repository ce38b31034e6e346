"""dcpsim's pytest plugin, registered by the package (the ``pytest11`` entry point ``dcpsim``):
an engine's repository with dcpsim installed needs no conftest (docs/api.md).

- fixture ``dcpsim_run``: ``dcpsim.run`` with the session's engine options applied
  (``--dcpsim-engine NAME``, ``--dcpsim-vllm-source DIR``, ``--dcpsim-sglang-source DIR``,
  ``--dcpsim-vllm-ascend-source DIR``, ``--dcpsim-in-process``);
- ``--dcpsim-matrix [SCENARIO,...]``: the session is the correctness matrix, one test item per
  cell (its id as ``dcpsim matrix`` prints it; default every built-in), the other tests
  deselected; ``--dcpsim-shard K/N`` keeps shard K of N (the cells of ``dcpsim matrix --shard
  K/N``); each item's JUnit properties carry the shard record, so ``dcpsim merge`` joins the
  ``--junitxml`` files of the shards.

A failing engine fails the item, with the text report as its message (``dcpsim.CheckFailed``
anywhere in a test is shown that way); a bad option is a ``pytest.UsageError``.

pytest loads the plugin into every session of an environment where dcpsim is installed, so
it imports the API (and torch) only once a session uses it: an option of its own, the
fixture, a ``CheckFailed``.
"""

from __future__ import annotations

import json
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
    items[:] = [
        MatrixCellItem.from_parent(session, name=c.cell.id, nodeid=c.cell.id, cell=c, index=i, record=record)
        for i, c in zip(indices, cells)
    ]


class MatrixCellItem(pytest.Item):
    """One cell of the matrix: it runs in a world of its own (threads with ``--dcpsim-in-process``)."""

    def __init__(self, *, cell, index: int, record: str, **kwargs):
        super().__init__(**kwargs)
        self.cell = cell
        self.user_properties += [("dcpsim.index", index), ("dcpsim.matrix", record)]

    def runtest(self) -> None:
        from dcpsim.api.matrix import run_cell
        from dcpsim.harness.dry_run import dry_run

        if self.cell.status == "skipped":
            pytest.skip(self.cell.reason)
        try:
            dry_run(self.cell.scenario)
        except ConfigError as exc:
            pytest.skip(f"invalid config: {exc}")
        result = run_cell(self.cell, self.config._dcpsim_options)
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A ``dcpsim.CheckFailed`` raised by a test: its text report is the failure's message."""
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, CheckFailed) and report.failed:
        report.longrepr = f"{item.nodeid}: the engine under test failed dcpsim's check\n{call.excinfo.value}"
    return report
