"""Benchmark: what the test suite costs, and which directories and files spend it.

Runs pytest (by default the README's test command, ``pytest -n 2``; any pytest arguments after
``--`` replace the default selection) with ``--dcpsim-durations-json``, then prints the wall time
against issue 29's goal (15 minutes for the whole suite), each directory's share of the summed
test time and the costliest files. ``--from-json FILE`` prints the figures of an earlier run's
JSON without running anything. Run from the repository's root:

    python benchmarks/bench_suite.py                      # the whole suite (about 35 min on 2 cores)
    python benchmarks/bench_suite.py -- -m "not slow"     # the fast loop
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.durations import directory_of, file_of, shares

SUITE_GOAL_S = 15 * 60
FAST_LOOP_GOAL_S = 60


def print_figures(per_test: dict[str, float], top: int) -> None:
    total = sum(per_test.values()) or 1.0
    print(f"\n{len(per_test):,} tests, {total:,.1f} s of test time summed over workers")
    print("per directory:")
    for name, s, n in shares(per_test, directory_of):
        print(f"  {s:9.1f} s {100 * s / total:5.1f}%  {n:5d} tests  {name}")
    print(f"the {top} costliest files:")
    for name, s, n in shares(per_test, file_of)[:top]:
        print(f"  {s:9.1f} s {100 * s / total:5.1f}%  {n:5d} tests  {name}")
    print(f"the {top} costliest tests:")
    for nodeid, s in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {s:9.1f} s  {nodeid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-json", metavar="FILE", help="print the figures of an earlier run's durations JSON")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: -n 2, the whole suite)")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            print_figures(json.load(f)["per_test"], args.top)
        return 0
    selection = args.pytest_args or ["-n", "2"]
    goal = FAST_LOOP_GOAL_S if "not slow" in selection else SUITE_GOAL_S
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "durations.json")
        command = [sys.executable, "-m", "pytest", "-q", *selection, "--dcpsim-durations-json", out]
        print(f"{' '.join(command[2:])}  ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start)")
        start = time.perf_counter()
        status = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
        wall = time.perf_counter() - start
        if not os.path.exists(out):
            print(f"pytest exited {status} without durations", file=sys.stderr)
            return 1
        with open(out) as f:
            per_test = json.load(f)["per_test"]
    print(f"wall time {wall:,.1f} s against a goal of {goal:,} s ({wall / goal:.2f}x); pytest exit {status}")
    print_figures(per_test, args.top)
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
