"""Where the suite spends its time: every test's setup, call and teardown summed per directory
and per file, printed after the run and, with ``--dcpsim-durations-json PATH``, written as JSON
(``benchmarks/bench_suite.py`` reads it).

Under xdist the controller receives every worker's reports, so the sums are test time over all
workers (they add up to about ``-n`` times the wall time when the workers stay busy)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import PurePosixPath

import pytest

TOP_FILES = 12


def directory_of(nodeid: str) -> str:
    """``tests/unit/engine/test_x.py::test_y`` -> ``tests/unit/engine``."""
    return str(PurePosixPath(nodeid.split("::", 1)[0]).parent)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def shares(per_test: dict[str, float], key) -> list[tuple[str, float, int]]:
    """``(name, seconds, tests)`` per ``key(nodeid)``, the costliest first."""
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for nodeid, duration in per_test.items():
        seconds[key(nodeid)] += duration
        counts[key(nodeid)] += 1
    return sorted(((name, seconds[name], counts[name]) for name in seconds), key=lambda row: -row[1])


class SuiteDurations:
    """A pytest plugin: per-test durations, summed per directory and per file."""

    def __init__(self, json_path: str | None):
        self.json_path = json_path
        self.per_test: dict[str, float] = defaultdict(float)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report) -> None:
        self.per_test[report.nodeid] += float(getattr(report, "duration", 0.0) or 0.0)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.per_test:
            return
        total = sum(self.per_test.values())
        write = terminalreporter.write_line
        terminalreporter.section("dcpsim: test time per directory (summed over workers)")
        for name, seconds, count in shares(self.per_test, directory_of):
            write(f"{seconds:9.1f} s {100 * seconds / total:5.1f}%  {count:5d} tests  {name}")
        write(f"{total:9.1f} s in all, {len(self.per_test)} tests")
        terminalreporter.section(f"dcpsim: the {TOP_FILES} costliest files")
        for name, seconds, count in shares(self.per_test, file_of)[:TOP_FILES]:
            write(f"{seconds:9.1f} s {100 * seconds / total:5.1f}%  {count:5d} tests  {name}")
        if self.json_path:
            with open(self.json_path, "w") as out:
                json.dump({"per_test": dict(self.per_test)}, out, indent=0, sort_keys=True)


def register(config) -> None:
    """Register the plugin on the controller (or a run without xdist), never on a worker."""
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(SuiteDurations(config.getoption("dcpsim_durations_json")), "dcpsim-suite-durations")
