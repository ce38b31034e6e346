"""A world whose gloo mesh connect fails at rendezvous is started once more, unless the
caller heard from it; any other failure, or a second connect failure, is raised as before."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest

from dcpsim.harness import world
from dcpsim.harness.world_failure import RankFailure, RankFailureError

CONNECT = "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:3227."


def failure(*ranks: tuple[int, int | None, str, str]) -> RankFailureError:
    return RankFailureError("world failed", [RankFailure(r, step, what, "RuntimeError", msg, "") for r, step, what, msg in ranks])


def test_only_a_connect_failure_at_rendezvous_is_transient():
    assert world.transient_rendezvous(failure((0, None, "rendezvous", CONNECT)))
    killed = RankFailure(1, None, "rendezvous", "Killed", "still running 5 s after the first failure", "")
    assert world.transient_rendezvous(RankFailureError("x", [RankFailure(0, None, "rendezvous", "RuntimeError", CONNECT, ""), killed]))
    assert not world.transient_rendezvous(failure((0, None, "rendezvous", "Timed out initializing process group")))
    assert not world.transient_rendezvous(failure((0, None, "started", CONNECT)))  # the rank function had begun
    assert not world.transient_rendezvous(failure((0, None, "rendezvous", CONNECT), (1, 3, "write", "boom")))
    assert not world.transient_rendezvous(RankFailureError("x", []))


def test_a_peer_that_lost_the_failed_rank_is_transient_unless_the_caller_heard_from_the_world():
    # rank 1 got through rendezvous and its first collective gave up on rank 0: retried
    lost = failure((0, None, "rendezvous", CONNECT), (1, None, "started", "Connection closed by peer [127.0.0.1]:4242"))
    assert world.transient_rendezvous(lost)
    # ... but not once the caller got an event or a result: a second world would send them again
    lost.caller_heard = True
    assert not world.transient_rendezvous(lost)
    heard = failure((0, None, "rendezvous", CONNECT))
    heard.caller_heard = True
    assert not world.transient_rendezvous(heard)


def test_run_world_starts_a_fresh_world_once_after_a_connect_failure(monkeypatch):
    calls = []

    def once(job, world_size, *args):
        calls.append(job)
        if len(calls) == 1:
            raise failure((0, None, "rendezvous", CONNECT))
        return ["ok"] * world_size

    monkeypatch.setattr(world, "_run_once", once)
    assert world.run_world(len, None, world_size=2) == ["ok", "ok"]
    assert len(calls) == 2 and calls[0] == calls[1]


@pytest.mark.parametrize("first", [(0, None, "rendezvous", CONNECT), (1, 2, "verify", "AssertionError")])
def test_run_world_raises_what_it_does_not_retry(monkeypatch, first):
    calls = []

    def once(*args):
        calls.append(1)
        raise failure(first)

    monkeypatch.setattr(world, "_run_once", once)
    with pytest.raises(RankFailureError):
        world.run_world(len, None, world_size=2)
    # a connect failure is retried once (RENDEZVOUS_ATTEMPTS), any other failure never
    assert len(calls) == (world.RENDEZVOUS_ATTEMPTS if first[3] == CONNECT else 1)


def scripted_rank(conn, messages):
    """A stand-in for a rank's process: it sends ``messages`` over its pipe as a rank does."""
    for msg in messages:
        conn.send_bytes(pickle.dumps(msg))
    conn.close()


def supervised(*scripts) -> RankFailureError:
    """The error ``world._Supervisor`` raises over processes that send ``scripts``."""
    ctx = mp.get_context("fork")
    procs, conns = [], []
    for script in scripts:
        recv_end, send_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=scripted_rank, args=(send_end, script), daemon=True)
        proc.start()
        send_end.close()
        procs.append(proc)
        conns.append(recv_end)
    try:
        with pytest.raises(RankFailureError) as info:
            world._Supervisor(procs, conns, deadline_s=30, grace_s=2, on_event=lambda r, e: None).run()
    finally:
        world._kill(procs)
    return info.value


def test_the_supervisor_says_whether_the_caller_heard_from_the_world():
    connect = ("fail", RankFailure(1, None, "rendezvous", "RuntimeError", CONNECT, ""))
    # rank 0 needed no peer: its event reached the caller (then it died in its teardown), so
    # the world is not started again
    heard = supervised([("event", "tick")], [connect])
    assert heard.caller_heard and not world.transient_rendezvous(heard)
    finished = supervised([("ok", 0)], [connect])  # a result alone counts too
    assert finished.caller_heard and not world.transient_rendezvous(finished)
    # rank 0's first collective gave up on rank 1: nothing reached the caller
    lost = supervised(
        [("progress", None, "started"), ("fail", RankFailure(0, None, "started", "RuntimeError", "Connection closed by peer", ""))],
        [connect],
    )
    assert not lost.caller_heard and world.transient_rendezvous(lost)


def test_run_world_does_not_start_a_world_the_caller_heard_from_again(monkeypatch):
    calls = []

    def once(*args):
        calls.append(1)
        error = failure((0, None, "rendezvous", CONNECT))
        error.caller_heard = True
        raise error

    monkeypatch.setattr(world, "_run_once", once)
    with pytest.raises(RankFailureError):
        world.run_world(len, None, world_size=2)
    assert len(calls) == 1
