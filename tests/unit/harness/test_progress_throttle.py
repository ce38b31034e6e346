"""``rank_process.set_progress`` in a rank: the first change is sent at once, a burst of changes
costs a few pipe messages instead of one each, and the latest progress always reaches the
parent (so hang reports and the waiting message name where the rank stopped)."""

from __future__ import annotations

import pickle
from multiprocessing import Pipe

import pytest

from dcpsim.harness import rank_process as world


@pytest.fixture
def pipe(monkeypatch):
    recv, send = Pipe(duplex=False)
    monkeypatch.setattr(world, "_conn", send)
    monkeypatch.setattr(world, "_progress_sent", None)
    monkeypatch.setattr(world, "_progress_sent_at", -world.PROGRESS_INTERVAL_S)
    yield recv
    world._conn = None
    send.close()
    recv.close()


def received(recv, timeout: float) -> list:
    out = []
    while recv.poll(timeout):
        out.append(pickle.loads(recv.recv_bytes()))
        timeout = 0.5  # the flusher's message follows within PROGRESS_INTERVAL_S
    return out


def test_a_burst_sends_the_first_and_the_last_progress_only(pipe):
    for step in range(2000):
        for phase in ("write", "verify", "metadata"):
            world.set_progress(step, phase)
    world.set_progress(2000, "hung here")
    msgs = received(pipe, 5.0)
    assert msgs[0] == ("progress", 0, "write")  # sent at once: nothing went before it
    assert msgs[-1] == ("progress", 2000, "hung here")  # the flusher delivers the latest
    assert len(msgs) < 200  # not one message per call (6,001 calls)
    assert all(m[0] == "progress" for m in msgs)
    steps = [m[1] for m in msgs]
    assert steps == sorted(steps)  # in order


def test_flush_sends_a_pending_change_now_and_never_twice(pipe):
    world.set_progress(3, "write")
    world.set_progress(3, "verify")  # within the interval: pending
    world.flush_progress()
    world.flush_progress()
    msgs = received(pipe, 5.0)
    assert msgs == [("progress", 3, "write"), ("progress", 3, "verify")]
