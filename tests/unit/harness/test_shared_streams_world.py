"""A gloo world's long token streams are drawn and hashed once by the launcher and mapped by
every rank (``runner.shared_streams_of``, ``model.shared_streams``): a request reads the same
streams as it draws itself, and a world's verdict, passing or failing, is the same with them."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.scheduler.request import Request
from dcpsim.harness import streams, world_dir
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.streams import shared_streams_of
from dcpsim.model import shared_streams as shared
from support.helpers import builtin


@pytest.fixture
def share_all(monkeypatch):
    """Every request without a shared prefix is long enough to share; the directories written."""
    monkeypatch.setattr(shared, "SHARE_MIN_TOKENS", 1)
    written = []
    write = streams.write_streams
    monkeypatch.setattr(streams, "write_streams", lambda pairs, d: (written.append(write(pairs, d)), written[-1])[1])
    yield written
    shared.attach(None)


def test_a_request_reads_the_streams_it_would_draw(share_all):
    scenario = builtin("prefix-sharing", 2)
    with shared_streams_of([Job.from_options(scenario)]) as directory:
        shared.attach(directory)
        for i, spec in enumerate(scenario.requests):
            mapped, drawn = Request(i, spec, scenario.seed, None), Request(i, spec, scenario.seed, None)
            drawn._shared = None  # as without a shared directory
            if spec.shared_prefix_len:
                assert mapped._shared is None
                continue
            assert mapped._shared is not None
            for field in ("tokens", "raw_hash", "fingerprints"):
                assert np.array_equal(getattr(mapped, field), getattr(drawn, field))
    assert share_all[0] > 0


@pytest.mark.parametrize("inject", [None, "foreign-block"])
def test_a_world_judges_alike_with_shared_streams(monkeypatch, share_all, inject):
    options = {"inject": inject} if inject else {}
    job = Job.from_options(builtin("dsv3", 2), **options)
    (with_shared,) = run_jobs([job])
    assert share_all and share_all[0] > 0  # the ranks mapped every request's streams
    monkeypatch.setattr(shared, "SHARE_MIN_TOKENS", 1 << 62)
    (alone,) = run_jobs([job])
    assert len(share_all) == 1  # nothing to share: no directory written
    assert (with_shared.passed, with_shared.steps, with_shared.verified_indices) == (alone.passed, alone.steps, alone.verified_indices)
    assert with_shared.passed == (inject is None)
    if inject:
        assert (with_shared.failure.kind, with_shared.failure.step) == (alone.failure.kind, alone.failure.step)


def test_the_directory_goes_when_the_world_is_done_and_with_a_killed_launcher(tmp_path, share_all, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(world_dir, "SHARED_MEMORY", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    orphan = tmp_path / f"dcpsim-streams-{int(dead.stdout)}-abc"  # its launcher was killed
    orphan.mkdir()
    with shared_streams_of([Job.from_options(builtin("dsv3", 2))]) as directory:
        assert not orphan.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == [directory.rsplit("/", 1)[1]]  # this launcher's own
        assert any(p.name.endswith("fingerprints.npy") for p in (tmp_path / directory.rsplit("/", 1)[1]).iterdir())
    assert list(tmp_path.iterdir()) == []
