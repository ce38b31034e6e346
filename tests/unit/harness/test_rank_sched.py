"""harness.rank_sched: the ranks' scheduling asked for, parsed from the environment and applied
(in a child process, so this test's own process keeps its policy)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from dcpsim.errors import ConfigError
from dcpsim.harness import rank_sched
from dcpsim.harness.rank_sched import DEFAULT_SLICE_MS, ENV, current, rank_slice_ms, schedule_as_batch

CASES = [(None, DEFAULT_SLICE_MS), ("", DEFAULT_SLICE_MS), ("0", 0.0), ("50", 50.0), (" 0.1 ", 0.1), ("100", 100.0)]


@pytest.mark.parametrize(("text", "ms"), CASES)
def test_the_slice_comes_from_the_environment(text, ms):
    assert rank_slice_ms({} if text is None else {ENV: text}) == ms


@pytest.mark.parametrize("text", ["fast", "-1", "0.05", "101", "nan", "inf"])
def test_a_bad_slice_is_a_config_error_naming_the_variable(text):
    with pytest.raises(ConfigError, match=f"{ENV} must be 0 .* got {text!r}"):
        rank_slice_ms({ENV: text})


def _apply(slice_ms, queue):
    queue.put((schedule_as_batch(slice_ms), current()))


def _in_child(slice_ms):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_apply, args=(slice_ms, queue))
    child.start()
    out = queue.get(timeout=30)
    child.join(30)
    return out


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this system")
def test_a_process_asks_for_batch_scheduling_and_says_what_it_got():
    said, (policy, slice_ns) = _in_child(20.0)
    assert policy == os.SCHED_BATCH
    if slice_ns:  # a kernel that keeps a slice per task (Linux 6.12 on) kept ours
        assert (said, slice_ns) == ("batch, 20 ms slice", 20_000_000)
    else:
        assert said == "batch"
    said, (policy, _) = _in_child(0.0)
    assert (said, policy) == ("default", os.sched_getscheduler(0))


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this system")
def test_without_sched_setattr_a_process_still_asks_for_batch(monkeypatch):
    monkeypatch.setattr(rank_sched, "_SYSCALLS", {})  # a machine whose syscall numbers are not known
    said, (policy, _) = _in_child(20.0)
    assert (said, policy) == ("batch", os.SCHED_BATCH)
