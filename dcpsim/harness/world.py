"""Start and supervise a world of W rank processes joined by a gloo process group.

``run_world(rank_fn, payload, world_size=W)`` runs ``rank_fn(payload, rank, W)`` in W
processes and returns the per-rank results in rank order. The parent only supervises:

* Ranks are forked by a ``forkserver`` that has already imported torch, so a world
  starts in ~0.1 s instead of seconds with ``spawn``. The preload list is fixed when
  the forkserver first starts (the first ``run_world`` call of the process).
* Neither the forkserver nor a rank re-creates the caller's ``__main__``
  (``caller_main``): a script that calls the API unguarded, or one read from standard
  input, works as ``python -m dcpsim`` does. A payload that holds an object defined in
  ``__main__`` is a ``ConfigError`` that names it.
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
* A rank runs as batch work (``rank_sched``: ``SCHED_BATCH``, a 20 ms slice where the
  kernel takes one; ``DCPSIM_RANK_SLICE_MS``), so ranks that outnumber the cores take
  turns less often.
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
from dcpsim.harness.caller_main import check_payload, starting_ranks
from dcpsim.harness.rank_process import rank_main
from dcpsim.harness.rank_sched import rank_slice_ms
from dcpsim.harness.world_failure import (
    RankFailure,
    RankFailureError,
    exit_failure,
    failure_error,
    is_collective_error,
    waiting_message,
    where_text,
)
from dcpsim.model.validate import check_int
from dcpsim.plural import plural

START_METHOD = "forkserver"
RANK_PRELOAD = "dcpsim.harness.runner"
"""What the forkserver of a world of jobs imports before it forks the ranks (the rank code:
the engine, the checker and torch); named, not imported, so this module stays light for
``python -m dcpsim``, which starts the forkserver before it imports torch itself."""
BASE_PRELOAD = ("torch", "torch.distributed", "numpy.ma", "dcpsim.harness.rank_process")
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
        with starting_ranks():
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
    A world whose gloo mesh connect fails at rendezvous is started once more
    (``RENDEZVOUS_ATTEMPTS``) if the caller has heard nothing of it yet. Raises
    RankFailureError if a rank fails (or rendezvous fails), HarnessError if the world is
    still running after deadline_s (default pg_timeout_s * 2 + 30).
    ``on_event(rank, payload)`` gets each ``send_event`` of a rank as it arrives;
    ``on_wait(message)`` says which ranks are still running and where, after every
    ``wait_report_s`` seconds without an event.
    """
    check_int("world_size", world_size)
    if deadline_s is None:
        deadline_s = pg_timeout_s * 2 + 30
    slice_ms = rank_slice_ms()
    job = pickle.dumps((rank_fn, payload), protocol=pickle.HIGHEST_PROTOCOL)
    check_payload(payload, job)
    supervise = dict(on_event=on_event, on_wait=on_wait, wait_report_s=wait_report_s, phase_order=phase_order)
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _run_once(job, world_size, pg_timeout_s, deadline_s, tuple(preload), supervise, slice_ms)
        except RankFailureError as exc:
            if attempt == RENDEZVOUS_ATTEMPTS or not transient_rendezvous(exc):
                raise
    raise AssertionError("unreachable")  # the last attempt returns or raises


RENDEZVOUS_ATTEMPTS = 2
"""Worlds started for one ``run_world`` when gloo's mesh connect fails at rendezvous
(``transient_rendezvous``): on a loaded machine a pair's TCP handshake can be closed by
the peer (``Gloo connectFullMesh failed ... Connection closed by peer``; about 2% of
W = 8 worlds started back to back by two processes on 2 cores), so a fresh world (new
store, new ports) is started once more, if the caller has heard nothing of the first."""

_TRANSIENT = ("Gloo connectFullMesh failed",)


def transient_rendezvous(exc: RankFailureError) -> bool:
    """Whether a world failed only because gloo's mesh connect failed, unseen by the caller:
    a rank failed at ``rendezvous`` with gloo's connect error, every other failure is at
    rendezvous too or a collective that gave up on its lost peer, and no rank sent an event
    or its result (``caller_heard``: a rank that needs no peer can finish its function while
    another's connect fails, and a second world would send its events again)."""
    connect = any(_at_rendezvous(f) and any(t in f.message for t in _TRANSIENT) for f in exc.failures)
    nothing_else = all(_at_rendezvous(f) or is_collective_error(f) for f in exc.failures)
    return connect and nothing_else and not exc.caller_heard


def _at_rendezvous(f: RankFailure) -> bool:
    """Whether a rank failed before its function began (still joining the gloo world)."""
    return f.step is None and f.what == "rendezvous"


def _run_once(
    job: bytes, world_size: int, pg_timeout_s: float, deadline_s: float, preload: tuple[str, ...], supervise: dict, slice_ms: float
) -> list:
    """One world: start the ranks over a fresh ``FileStore``, supervise them, clean up."""
    ctx = _context(preload)
    store_dir = _new_store_dir()
    procs, conns = [], []
    try:
        with starting_ranks():
            _start_ranks(ctx, job, world_size, store_dir, pg_timeout_s, slice_ms, procs, conns)
        return _Supervisor(procs, conns, deadline_s, min(MAX_GRACE_S, pg_timeout_s), **supervise).run()
    finally:
        _kill(procs)
        for conn in conns:
            conn.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _start_ranks(ctx, job: bytes, world_size: int, store_dir: str, pg_timeout_s: float, slice_ms: float, procs: list, conns: list) -> None:
    """Start the world's rank processes, each with the read end of its pipe in ``conns``."""
    for rank in range(world_size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        conns.append(recv_end)
        proc = ctx.Process(
            target=rank_main,
            name=f"dcpsim-rank{rank}",
            daemon=True,
            args=(send_end, job, rank, world_size, os.path.join(store_dir, "store"), pg_timeout_s, slice_ms),
        )
        proc.start()
        procs.append(proc)
        send_end.close()


class _Supervisor:
    """The parent's side of a running world: it reads every rank's pipe as messages arrive
    and watches every rank's process, until each rank has reported or exited, the first
    failure's grace period is over, or the deadline has passed."""

    def __init__(
        self,
        procs,
        conns,
        deadline_s,
        grace_s,
        *,
        on_event=None,
        on_wait=None,
        wait_report_s: float = WAIT_REPORT_S,
        phase_order: tuple[str, ...] = (),
    ) -> None:
        self.procs, self.world_size = procs, len(procs)
        self.deadline_s, self.grace_s = deadline_s, grace_s
        self.on_event, self.on_wait, self.wait_report_s, self.phase_order = on_event, on_wait, wait_report_s, phase_order
        self.progress: list[tuple[int | None, str]] = [(None, "")] * self.world_size
        self.results: dict[int, object] = {}
        self.failures: dict[int, RankFailure] = {}  # in order of arrival
        self.running = set(range(self.world_size))  # neither reported nor exited
        self.reading = dict(enumerate(conns))
        self.quiet_since = self.reported = time.monotonic()  # the last event, the last wait report
        self.heard = False  # an event reached the caller (a result is in ``results``)

    def run(self) -> list:
        """The per-rank results, in rank order. Raises ``RankFailureError`` if a rank failed
        (the ranks still running after the grace period are named as killed), and
        ``HarnessError`` if ranks were still running at the deadline."""
        self._watch()
        if self.running and not self.failures:
            raise self._deadline_error()
        if self.failures:
            raise self._failure_error()
        self._let_ranks_exit()
        return [self.results[r] for r in range(self.world_size)]

    def _watch(self) -> None:
        """Handle whatever the ranks send or do until none is running or time is up (the
        deadline, or the grace period the first failure gives the others)."""
        deadline = time.monotonic() + self.deadline_s
        stop_at = deadline
        while self.running:
            now = time.monotonic()
            if stop_at - now <= 0:
                break
            self._report_wait(now)
            by_handle = self._handles()
            for handle in wait(list(by_handle), self._wait_timeout(now, stop_at)):
                self._handle_ready(by_handle[handle], handle)
            if self.failures and stop_at == deadline:
                stop_at = min(deadline, time.monotonic() + self.grace_s)

    def _report_wait(self, now: float) -> None:
        """Tell ``on_wait`` which ranks are still running and where, once ``wait_report_s``
        has passed without an event or a report."""
        if self.on_wait is not None and now - max(self.quiet_since, self.reported) >= self.wait_report_s:
            self.reported = now
            self.on_wait(waiting_message(now - self.quiet_since, sorted(self.running), self.progress, self.world_size))

    def _wait_timeout(self, now: float, stop_at: float) -> float:
        """How long the next wait may last: until ``stop_at``, or the next wait report if sooner."""
        if self.on_wait:
            return min(stop_at - now, max(self.quiet_since, self.reported) + self.wait_report_s - now)
        return stop_at - now

    def _handles(self) -> dict:
        """What to wait on, each mapped to its rank: the pipe of every rank that may still
        send, the process sentinel of every rank still running."""
        by_handle = {conn: r for r, conn in self.reading.items()}
        by_handle.update((self.procs[r].sentinel, r) for r in self.running)
        return by_handle

    def _handle_ready(self, rank: int, handle) -> None:
        """A rank's process exited, or its pipe has a message."""
        if handle is self.procs[rank].sentinel:
            self._exited(rank)
        elif rank in self.reading:
            self._receive(rank)

    def _exited(self, rank: int) -> None:
        """A rank's process exited: read what it sent first; if it never reported, its exit
        is its failure."""
        while rank in self.reading and self.reading[rank].poll():
            self._receive(rank)
        if rank in self.running:
            self.running.discard(rank)
            self.procs[rank].join()
            self.failures[rank] = exit_failure(rank, self.procs[rank].exitcode, self.progress[rank])

    def _receive(self, rank: int) -> None:
        """Take one message of a rank: its progress, an event for the caller, or its outcome
        (a result or a failure: the rank is then done). A closed pipe is read no more."""
        try:
            msg = pickle.loads(self.reading[rank].recv_bytes())
        except (EOFError, OSError):
            del self.reading[rank]
            return
        if msg[0] == "progress":
            self.progress[rank] = msg[1:]
        elif msg[0] == "event":
            self._event(rank, msg[1])
        else:
            (self.results if msg[0] == "ok" else self.failures)[rank] = msg[1]
            self.running.discard(rank)  # reported: done, whether or not it has exited yet
            del self.reading[rank]

    def _event(self, rank: int, payload) -> None:
        """A rank's ``send_event``: news, so the wait reports start over; the caller hears it."""
        self.quiet_since = time.monotonic()
        self.heard = True
        if self.on_event is not None:
            self.on_event(rank, payload)

    def _deadline_error(self) -> HarnessError:
        """The error of a world still running at the deadline, naming where each rank was."""
        return HarnessError(
            f"world of {plural(self.world_size, 'rank')} did not finish within deadline_s={self.deadline_s:g} s; "
            "killed the ranks still running:\n"
            + "\n".join(f"  rank {r}, last progress: {where_text(self.progress[r])}" for r in sorted(self.running))
            + "\n  (ranks still making progress: a run that needs longer takes --deadline SECONDS)"
        )

    def _failure_error(self) -> RankFailureError:
        """The ``RankFailureError`` of the failed ranks, with those still running named as killed."""
        killed = [
            RankFailure(r, *self.progress[r], "Killed", f"still running {self.grace_s:g} s after the first failure", "")
            for r in sorted(self.running)
        ]
        error = failure_error(list(self.failures.values()), killed, self.world_size, self.phase_order)
        error.caller_heard = self.heard or bool(self.results)
        return error

    def _let_ranks_exit(self) -> None:
        """Give the ranks, which exit right after reporting, a second to do so; ``_kill`` does the rest."""
        exit_by = time.monotonic() + 1.0
        for proc in self.procs:
            proc.join(max(0.0, exit_by - time.monotonic()))


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
