"""Shared fixtures: the helpers of ``tests/support/helpers.py`` (import them directly where a
module-level use, such as ``parametrize``, needs them)."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from support import durations, helpers

VLLM_REQUIREMENT = "vllm==0.33.0"
SGLANG_REQUIREMENT = "sglang==0.5.23"

# The suite starts hundreds of Python processes (xdist workers, forkservers, the CLI's and the
# scripts' subprocesses). Where PYTHONDONTWRITEBYTECODE is set (it is on this project's machines)
# each compiled the modules it imports anew, and pytest rewrote every test module in each
# worker: the suite keeps bytecode for itself and its children (docs/testing.md).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Hypothesis's default 200 ms deadline per example is a timed test: under pytest -n 2 beside
# the gloo worlds of other tests, an example of a pure function can take longer and fail as
# flaky. Property tests judge results, never time (a test's own @settings still applies).
settings.register_profile("dcpsim", deadline=None)
settings.load_profile("dcpsim")


def pytest_addoption(parser):
    group = parser.getgroup("dcpsim")
    group.addoption(
        "--dcpsim-skip-full-matrix",
        action="store_true",
        help="leave out the full correctness matrix (tests/matrix/test_matrix_full.py, ~4 min on 2 cores)",
    )
    group.addoption(
        "--dcpsim-durations-json",
        default=None,
        metavar="PATH",
        help="also write every test's duration to PATH as JSON (benchmarks/bench_suite.py reads it)",
    )
    # --dcpsim-shard K/N (the full matrix's shard) is the pytest plugin's (dcpsim.pytest_plugin)


def pytest_configure(config):
    """The suite's time per directory, printed after every run (``support/durations.py``)."""
    durations.register(config)


NETWORK_FIXTURES = frozenset({"vllm_source", "vllm_source_or_skip", "sglang_source", "release_source"})
"""Fixtures that fetch an engine's wheel from the package index (once per machine)."""


def pytest_collection_modifyitems(config, items):
    """A test that needs a fetched wheel is ``network``, and ``slow`` too: the fast loop
    (``pytest -m "not slow"``) runs offline, and these run an engine's kernels under Triton's
    interpreter."""
    for item in items:
        if NETWORK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.network)
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def builtin():
    return helpers.builtin


@pytest.fixture
def run():
    return helpers.run


@pytest.fixture
def run_json(capsys):
    return lambda *argv: helpers.run_json(capsys, *argv)


@pytest.fixture(scope="session")
def vllm_source() -> Path:
    """vLLM 0.33.0's source (the wheel, without dependencies, unpacked), fetched once per
    machine into ``$DCPSIM_CACHE`` (default ``~/.cache/dcpsim``). Never skipped: without
    the package index this fails, and so do the tests that need it."""
    from dcpsim.engine.vllm.fetch import default_dest, fetch

    dest = default_dest(VLLM_REQUIREMENT)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".fetch.lock", "w") as lock:  # xdist workers fetch once
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = fetch(VLLM_REQUIREMENT, dest)
    os.environ.pop("DCPSIM_VLLM_SOURCE", None)
    return path


@pytest.fixture(scope="session")
def sglang_source() -> Path:
    """SGLang 0.5.23's source, as ``vllm_source`` (``fetch`` holds a file lock: xdist workers
    fetch once). Never skipped."""
    from dcpsim.engine.loading.fetch import fetch

    path = fetch(SGLANG_REQUIREMENT)
    os.environ.pop("DCPSIM_SGLANG_SOURCE", None)
    return path


@pytest.fixture(scope="session")
def release_source():
    """``release_source(engine, release)``: that release's source (``engine fetch ENGINE==RELEASE``:
    cached in ``$DCPSIM_CACHE``, file-locked, so xdist workers fetch each once). Never skipped."""
    from dcpsim.engine.loading.fetch import fetch

    for var in ("DCPSIM_VLLM_SOURCE", "DCPSIM_SGLANG_SOURCE"):
        os.environ.pop(var, None)
    return lambda engine, release: fetch(f"{engine}=={release}")


@pytest.fixture(scope="session")
def vllm_source_or_skip(request) -> Path:
    """``vllm_source``, or a skip when vLLM's wheel cannot be fetched (no package index):
    for tests that compare with vLLM beside a figure dcpsim computes on its own. In CI,
    where the index is reachable, they run."""
    from dcpsim.errors import DcpsimError

    try:
        return request.getfixturevalue("vllm_source")
    except DcpsimError as exc:
        pytest.skip(f"vLLM's source cannot be fetched: {exc}")
