"""dcpsim.harness.world with real worlds of gloo ranks: results, failures, hangs, no orphans.

Rank functions live at module level so the rank processes can unpickle them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import forkserver, resource_tracker

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcpsim.errors import EXIT_HARNESS, ConfigError, HarnessError
from dcpsim.harness import rank_process
from dcpsim.harness import world as launch
from dcpsim.harness.rank_process import set_progress
from dcpsim.harness.world import run_world
from dcpsim.harness.world_failure import RankFailureError

pytestmark = [pytest.mark.dist, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------ rank functions


def all_reduce_sum(payload, rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def finish_in_reverse(payload, rank, world_size):
    time.sleep(0.05 * (world_size - rank))  # the highest rank reports first
    return (rank, world_size, payload)


def return_but_linger(payload, rank, world_size):
    threading.Thread(target=time.sleep, args=(1000,)).start()  # blocks the exit
    return rank


def big_array(payload, rank, world_size):
    return np.arange(payload, dtype=np.float64) + rank


def raise_in_rank1(payload, rank, world_size):
    set_progress(7, "decode")
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))


def hang_in_rank1(payload, rank, world_size):
    if rank == 1:
        set_progress(4, "stuck in sleep")
        time.sleep(1000)
    set_progress(4, "barrier")
    dist.barrier()


def events_then_rank1_lingers(payload, rank, world_size):
    # every rank is past rendezvous before any event: a world whose gloo connect fails is
    # started once more only while the caller has heard nothing of it (world.transient_rendezvous)
    dist.barrier()
    for k in range(3):
        rank_process.send_event(("tick", k))
    if rank == 1:
        set_progress(9, "lingering")
        time.sleep(payload)
    return rank


def sleep_forever(payload, rank, world_size):
    set_progress(rank * 10, "sleeping")
    if payload:  # tell the test this rank is up
        with open(os.path.join(payload, f".rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(payload, f".rank{rank}"), os.path.join(payload, f"rank{rank}"))
    time.sleep(1000)


def exit7_in_rank1(payload, rank, world_size):
    if rank == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def sigkill_rank1(payload, rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _unpickle_payload():
    if multiprocessing.current_process().name == "dcpsim-rank1":
        raise ModuleNotFoundError("No module named 'missing_in_rank1'")
    return "fine"


class BreaksInRank1:
    """A payload that unpickles everywhere but in rank 1: rank 1 never joins."""

    def __reduce__(self):
        return (_unpickle_payload, ())


# ---------------------------------------------------------------------------- helpers


def _stat(pid) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _rank_processes() -> list[str]:
    """Processes left behind by run_world: children of this process or of the
    forkserver, other than the forkserver and the resource tracker themselves."""
    helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    parents = {os.getpid()} | helpers
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(pid)
        if fields and int(fields[1]) in parents and int(pid) not in helpers:
            found.append(f"pid {pid} state {fields[0]}")
    return found


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    assert multiprocessing.active_children() == []
    assert _rank_processes() == []


def _expect_failure(fn, world_size, *, payload=None, within_s=5.0, **kw):
    start = time.monotonic()
    with pytest.raises(RankFailureError) as info:
        run_world(fn, payload, world_size=world_size, **kw)
    assert time.monotonic() - start < within_s
    return info.value


def _by_rank(err: RankFailureError):
    return {f.rank: f for f in err.failures}


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_sum(world_size):
    expected = world_size * (world_size + 1) / 2
    assert run_world(all_reduce_sum, None, world_size=world_size) == [expected] * world_size


def test_results_come_back_in_rank_order():
    assert run_world(finish_in_reverse, "p", world_size=4) == [(r, 4, "p") for r in range(4)]


def test_large_results_do_not_deadlock():
    n = 650_000  # ~5 MB of float64 per rank
    out = run_world(big_array, n, world_size=2)
    for rank, arr in enumerate(out):
        assert arr.shape == (n,) and arr[0] == rank and arr[-1] == n - 1 + rank


def test_a_rank_that_reported_its_result_is_done_even_if_it_lingers():
    """Its thread would hold the exit for 1000 s: a supervisor that waited for it would reach
    the deadline and raise instead of returning the results (no wall-clock bound to flake
    on a loaded machine: the deadline is the bound)."""
    assert run_world(return_but_linger, None, world_size=2, deadline_s=60) == [0, 1]


def test_raising_rank_is_primary_and_blocked_peers_secondary():
    err = _expect_failure(raise_in_rank1, 3)
    assert isinstance(err, HarnessError) and err.exit_code == EXIT_HARNESS
    msg = str(err)
    first_line = msg.splitlines()[0]
    assert "rank 1" in first_line and "ValueError: boom from rank 1" in first_line
    assert "Traceback (most recent call last)" in msg
    assert 'raise ValueError("boom from rank 1")' in msg  # the source line, from the traceback
    assert "step 7 (decode)" in msg  # set_progress information
    failures = _by_rank(err)
    assert failures[1].primary and failures[1].exc_type == "ValueError"
    assert (failures[1].step, failures[1].what) == (7, "decode")
    for rank in (0, 2):  # they lost their peer in all_reduce
        assert not failures[rank].primary
        assert f"secondary: rank {rank}" in msg
    assert [f.rank for f in err.failures][0] == 1  # primary listed first
    assert msg.index("primary: rank 1") < msg.index("secondary:")


def test_hanging_rank_is_killed_and_named():
    err = _expect_failure(hang_in_rank1, 3, pg_timeout_s=3, deadline_s=6, within_s=6.5)
    failures = _by_rank(err)
    assert failures[1].primary and failures[1].exc_type == "Killed"
    assert "rank 1 at step 4 (stuck in sleep)" in str(err)
    assert all(not failures[r].primary for r in (0, 2))  # timed out in the barrier


def test_deadline_kills_everything_and_names_progress():
    start = time.monotonic()
    with pytest.raises(HarnessError) as info:
        # 4 s: room for both ranks to start and report progress on a loaded machine
        run_world(sleep_forever, None, world_size=2, pg_timeout_s=10, deadline_s=4)
    assert time.monotonic() - start < 8
    assert not isinstance(info.value, RankFailureError)
    msg = str(info.value)
    assert "deadline_s=4" in msg
    assert "rank 0, last progress: step 0 (sleeping)" in msg
    assert "rank 1, last progress: step 10 (sleeping)" in msg


def test_events_arrive_as_sent_and_a_wait_names_the_ranks_still_running():
    events, waits = [], []
    out = run_world(
        events_then_rank1_lingers, 1.5, world_size=2, on_event=lambda r, e: events.append((r, e)), on_wait=waits.append, wait_report_s=0.3
    )
    assert out == [0, 1]
    assert sorted(events) == [(r, ("tick", k)) for r in range(2) for k in range(3)]
    assert [e for r, e in events if r == 1] == [("tick", 0), ("tick", 1), ("tick", 2)]  # in order
    lingering = [k for k, w in enumerate(waits) if w.endswith("for 1 of 2 ranks: rank 1 at step 9 (lingering)")]
    assert lingering, f"a 1.5 s wait with reports every 0.3 s says what it waits for: {waits}"
    assert lingering == list(range(lingering[0], len(waits))), waits
    assert all(w.startswith("waiting ") for w in waits)


def test_rank_exiting_without_report_names_exit_code():
    err = _expect_failure(exit7_in_rank1, 3)
    failures = _by_rank(err)
    assert failures[1].primary and failures[1].exc_type == "ProcessExit"
    assert "rank 1" in str(err).splitlines()[0] and "exited with code 7" in str(err)
    assert not failures[0].primary and not failures[2].primary


def test_rank_killed_by_signal_is_reported():
    err = _expect_failure(sigkill_rank1, 2)
    assert "primary: rank 1 at 'started' (no step): ProcessExit: killed by signal SIGKILL" in str(err)
    assert [f.rank for f in err.failures if f.primary] == [1]


def test_rank_that_never_joins_is_a_rendezvous_failure():
    err = _expect_failure(all_reduce_sum, 3, payload=BreaksInRank1(), pg_timeout_s=1)
    msg = str(err)
    assert msg.startswith("rendezvous failed") and "rank 1 ModuleNotFoundError" in msg
    assert [f.rank for f in err.failures if f.primary] == [1]
    assert "missing_in_rank1" in err.failures[0].traceback


def test_worlds_back_to_back_and_concurrently_do_not_collide(monkeypatch):
    store_dirs = []
    new_dir = launch._new_store_dir
    monkeypatch.setattr(launch, "_new_store_dir", lambda: store_dirs.append(new_dir()) or store_dirs[-1])
    for world_size in (2, 3):
        assert run_world(all_reduce_sum, None, world_size=world_size)[0] == world_size * (world_size + 1) / 2
    results, errors = {}, []

    def one(key, world_size):
        try:
            results[key] = run_world(all_reduce_sum, None, world_size=world_size)
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k, w)) for k, w in enumerate((2, 2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == {0: [3.0] * 2, 1: [3.0] * 2, 2: [6.0] * 3}
    assert len(set(store_dirs)) == 5 and not any(os.path.exists(d) for d in store_dirs)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_ranks_die_with_their_parent(tmp_path, sig):
    """SIGKILL: no cleanup runs in the parent; SIGINT: KeyboardInterrupt unwinds run_world. The
    parent takes Python's own SIGINT handler first: a suite started in the background by a shell
    without job control (``pytest ... &``) hands its children SIGINT ignored, and Python then
    installs none."""
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"import sys; sys.path.insert(0, {HERE!r}); import test_launch; "
        f"test_launch.run_world(test_launch.sleep_forever, {str(tmp_path)!r}, world_size=2)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 180  # generous: torch's import alone takes a minute at a load average of 40
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and parent.poll() is None, "ranks never started"
            time.sleep(0.05)
        ranks = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
        helpers = [
            int(p) for p in filter(str.isdigit, os.listdir("/proc")) if (_stat(p) or [0, 0])[1] == str(parent.pid)
        ]  # forkserver, tracker
        assert len(helpers) >= 1
    finally:
        parent.send_signal(sig)
        try:
            returncode = parent.wait(120)
        finally:
            parent.kill()
    assert returncode == -sig  # an uncaught KeyboardInterrupt re-raises SIGINT

    def alive(pid):
        fields = _stat(pid)
        return fields is not None and fields[0] != "Z"  # zombies are dead, just unreaped

    deadline = time.monotonic() + 60
    while any(map(alive, ranks + helpers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, ranks + helpers)), "processes outlived their parent"


def test_init_env_process_group_needs_torchrun_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):  # usage: exit 2
        rank_process.init_env_process_group(5)


def scheduling_of(payload, rank, world_size):
    from dcpsim.harness.rank_sched import current

    return current()


def test_ranks_run_as_batch_work_with_the_slice_asked_for(monkeypatch):
    # the default: SCHED_BATCH with a 20 ms slice where the kernel keeps one (Linux 6.12 on)
    got = run_world(scheduling_of, None, world_size=2)
    assert [policy for policy, _ in got] == [os.SCHED_BATCH] * 2
    assert all(slice_ns in (0, 20_000_000) for _, slice_ns in got)
    # the environment read as each world starts (the forkserver started before)
    monkeypatch.setenv("DCPSIM_RANK_SLICE_MS", "50")
    assert all(slice_ns in (0, 50_000_000) for _, slice_ns in run_world(scheduling_of, None, world_size=2))
    monkeypatch.setenv("DCPSIM_RANK_SLICE_MS", "0")  # off: the ranks keep the caller's policy
    assert [policy for policy, _ in run_world(scheduling_of, None, world_size=2)] == [os.sched_getscheduler(0)] * 2
    monkeypatch.setenv("DCPSIM_RANK_SLICE_MS", "fast")  # a usage error, before any rank starts
    with pytest.raises(ConfigError, match="DCPSIM_RANK_SLICE_MS must be 0 .* got 'fast'"):
        run_world(scheduling_of, None, world_size=2)
