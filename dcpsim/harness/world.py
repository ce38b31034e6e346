"""Start and supervise a world of W rank processes joined by a gloo process group.

``run_world(rank_fn, payload, world_size=W)`` runs ``rank_fn(payload, rank, W)`` in W
processes and returns the per-rank results in rank order. The parent only supervises:

* Ranks are forked by a ``forkserver`` that has already imported torch, so a world
  starts in ~0.1 s instead of seconds with ``spawn``. The preload list is fixed when
  the forkserver first starts (the first ``run_world`` call of the process).
* Rendezvous goes through a ``FileStore`` in a fresh temp dir: no ports, so worlds
  in parallel threads or pytest-xdist workers never collide.
* Every rank reports over its own pipe: progress (``set_progress``), events for the
  caller (``send_event``, e.g. a job of a batch done: ``on_event``), then either its
  result or its failure (exception type, message, traceback, last progress). The
  parent reads all pipes as messages arrive, so large results never deadlock.
* While it waits, the parent says which ranks it still waits for and where they are
  (``on_wait``), every ``wait_report_s`` seconds without an event.
* On the first failure the other ranks get a short grace period to report their own
  (typically secondary: a collective that lost its peer), then the rest are killed
  and ``RankFailureError`` tells the whole story. Past ``deadline_s`` everything is
  killed and ``HarnessError`` names the ranks still running and where they were.
* No orphans: the parent kills every rank on every exit path; a rank is SIGKILLed
  when its parent (the forkserver) dies, and the forkserver exits with the main process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing.connection import wait

from dcpsim.errors import HarnessError
from dcpsim.harness.rank_process import rank_main
from dcpsim.harness.world_failure import RankFailure, exit_failure, failure_error, waiting_message, where_text
from dcpsim.model.validate import check_int
from dcpsim.plural import plural

START_METHOD = "forkserver"
RANK_PRELOAD = "dcpsim.harness.runner"
"""What the forkserver of a world of jobs imports before it forks the ranks (the rank code:
the engine, the checker and torch); named, not imported, so this module stays light for
``python -m dcpsim``, which starts the forkserver before it imports torch itself."""
BASE_PRELOAD = ("__main__", "torch", "torch.distributed", "numpy.ma", "dcpsim.harness.rank_process")
MAX_GRACE_S = 2.0
WAIT_REPORT_S = 5.0
"""How long the parent waits without news (an event) before saying what it waits for."""


_preload_lock = threading.Lock()


def _context(preload: tuple[str, ...]):
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        with _preload_lock:  # only takes effect before the forkserver first starts
            ctx.set_forkserver_preload(list(dict.fromkeys(BASE_PRELOAD + preload)))
    return ctx


def start_forkserver(preload: tuple[str, ...] = ()) -> None:
    """Start the forkserver now, with ``preload`` (what the first world would preload), so
    that its imports (torch: ~2 s) run while the caller still imports and loads its own;
    the first world then forks ranks at once. Best effort: if it fails, the first world
    starts it again and reports what is wrong."""
    if START_METHOD != "forkserver":
        return
    _context(tuple(preload))
    from multiprocessing import forkserver

    try:
        forkserver.ensure_running()
    except Exception:  # the first world reports it
        pass


def _new_store_dir() -> str:
    return tempfile.mkdtemp(prefix="dcpsim-world-")


def run_world(
    rank_fn,
    payload,
    *,
    world_size: int,
    pg_timeout_s: float = 30.0,
    deadline_s: float | None = None,
    preload: tuple[str, ...] = (),
    on_event=None,
    on_wait=None,
    wait_report_s: float = WAIT_REPORT_S,
    phase_order: tuple[str, ...] = (),
) -> list:
    """Run rank_fn(payload, rank, world_size) in world_size processes joined by a gloo
    process group; return the per-rank return values (index = rank).

    ``phase_order`` lists the phases (``set_progress``'s ``what``) of one step in the
    order a rank passes them: when every failure is a collective timing out, the ranks
    furthest along (step, then phase) are named as the ones that skipped a collective
    the others wait in (a divergent collective plan, e.g. vllm#53573).

    rank_fn must be a module-level function; payload and results must be picklable.
    Raises RankFailureError if a rank fails (or rendezvous fails), HarnessError if
    the world is still running after deadline_s (default pg_timeout_s * 2 + 30).
    ``on_event(rank, payload)`` gets each ``send_event`` of a rank as it arrives;
    ``on_wait(message)`` says which ranks are still running and where, after every
    ``wait_report_s`` seconds without an event.
    """
    check_int("world_size", world_size)
    if deadline_s is None:
        deadline_s = pg_timeout_s * 2 + 30
    job = pickle.dumps((rank_fn, payload), protocol=pickle.HIGHEST_PROTOCOL)
    ctx = _context(tuple(preload))
    store_dir = _new_store_dir()
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            conns.append(recv_end)
            proc = ctx.Process(
                target=rank_main,
                name=f"dcpsim-rank{rank}",
                daemon=True,
                args=(send_end, job, rank, world_size, os.path.join(store_dir, "store"), pg_timeout_s),
            )
            proc.start()
            procs.append(proc)
            send_end.close()
        return _supervise(
            procs,
            conns,
            deadline_s,
            min(MAX_GRACE_S, pg_timeout_s),
            on_event=on_event,
            on_wait=on_wait,
            wait_report_s=wait_report_s,
            phase_order=phase_order,
        )
    finally:
        _kill(procs)
        for conn in conns:
            conn.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _supervise(
    procs,
    conns,
    deadline_s,
    grace_s,
    *,
    on_event=None,
    on_wait=None,
    wait_report_s: float = WAIT_REPORT_S,
    phase_order: tuple[str, ...] = (),
) -> list:
    world_size = len(procs)
    progress: list[tuple[int | None, str]] = [(None, "")] * world_size
    results: dict[int, object] = {}
    failures: dict[int, RankFailure] = {}  # in order of arrival
    running = set(range(world_size))  # neither reported nor exited
    reading = dict(enumerate(conns))

    def receive(rank):
        try:
            msg = pickle.loads(reading[rank].recv_bytes())
        except (EOFError, OSError):
            del reading[rank]
            return
        if msg[0] == "progress":
            progress[rank] = msg[1:]
            return
        if msg[0] == "event":
            nonlocal quiet_since
            quiet_since = time.monotonic()
            if on_event is not None:
                on_event(rank, msg[1])
            return
        (results if msg[0] == "ok" else failures)[rank] = msg[1]
        running.discard(rank)  # reported: done, whether or not it has exited yet
        del reading[rank]

    deadline = time.monotonic() + deadline_s
    stop_at = deadline
    quiet_since = reported = time.monotonic()  # the last event, the last wait report
    while running:
        now = time.monotonic()
        if stop_at - now <= 0:
            break
        if on_wait is not None and now - max(quiet_since, reported) >= wait_report_s:
            reported = now
            on_wait(waiting_message(now - quiet_since, sorted(running), progress, world_size))
        timeout = min(stop_at - now, max(quiet_since, reported) + wait_report_s - now) if on_wait else stop_at - now
        by_handle = {conn: r for r, conn in reading.items()}
        by_handle.update((procs[r].sentinel, r) for r in running)
        for handle in wait(list(by_handle), timeout):
            rank = by_handle[handle]
            if handle is procs[rank].sentinel:  # exited: drain what it sent first
                while rank in reading and reading[rank].poll():
                    receive(rank)
                if rank in running:
                    running.discard(rank)
                    procs[rank].join()
                    failures[rank] = exit_failure(rank, procs[rank].exitcode, progress[rank])
            elif rank in reading:
                receive(rank)
        if failures and stop_at == deadline:
            stop_at = min(deadline, time.monotonic() + grace_s)

    if running and not failures:
        raise HarnessError(
            f"world of {plural(world_size, 'rank')} did not finish within deadline_s={deadline_s:g} s; "
            "killed the ranks still running:\n"
            + "\n".join(f"  rank {r}, last progress: {where_text(progress[r])}" for r in sorted(running))
        )
    if failures:
        killed = [
            RankFailure(r, *progress[r], "Killed", f"still running {grace_s:g} s after the first failure", "") for r in sorted(running)
        ]
        raise failure_error(list(failures.values()), killed, world_size, phase_order)
    exit_by = time.monotonic() + 1.0  # ranks exit right after reporting; _kill does the rest
    for proc in procs:
        proc.join(max(0.0, exit_by - time.monotonic()))
    return [results[r] for r in range(world_size)]


def _kill(procs) -> None:
    """SIGKILL every rank still running (and its process group), then reap it."""
    for proc in procs:
        if proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # not (yet) its own group leader
            proc.kill()
    for proc in procs:
        proc.join()
