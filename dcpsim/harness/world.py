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

import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

from dcpsim.errors import ConfigError, HarnessError
from dcpsim.harness.progress import Progress
from dcpsim.model.validate import check_int
from dcpsim.plural import plural

START_METHOD = "forkserver"
RANK_PRELOAD = "dcpsim.harness.runner"
"""What the forkserver of a world of jobs imports before it forks the ranks (the rank code:
the engine, the checker and torch); named, not imported, so this module stays light for
``python -m dcpsim``, which starts the forkserver before it imports torch itself."""
BASE_PRELOAD = ("__main__", "torch", "torch.distributed", "numpy.ma", __name__)
MAX_GRACE_S = 2.0
WAIT_REPORT_S = 5.0
"""How long the parent waits without news (an event) before saying what it waits for."""
_PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 75
"""A rank's exit code when its parent went away (its pipe is broken): it ends at once, silently."""


@dataclass
class RankFailure:
    """One rank that did not return a result. ``exc_type`` is the exception's class
    name, or ``ProcessExit`` (died without reporting) or ``Killed`` (by the harness)."""

    rank: int
    step: int | None
    what: str
    exc_type: str
    message: str
    traceback: str
    primary: bool = False

    def where(self) -> str:
        return _where((self.step, self.what))


class RankFailureError(HarnessError):
    """One or more ranks failed; ``.failures`` holds the details, primary ones first."""

    def __init__(self, message: str, failures: list[RankFailure]):
        super().__init__(message, failures)
        self.failures = failures

    def __str__(self) -> str:
        return self.args[0]


# ----------------------------------------------------------------------------- rank side

_conn = None  # this rank's pipe to the parent; None outside run_world ranks
_send_lock = threading.Lock()
_progress: tuple[int | None, str] = (None, "")
PROGRESS_INTERVAL_S = 0.05
"""At most one progress message per this many seconds: a later change within it is sent by
a flusher thread when it ends (so the parent learns where a rank stopped within ~50 ms)."""
_progress_lock = threading.Lock()  # orders progress messages: taken around each send
_progress_sent: tuple[int | None, str] | None = None
_progress_sent_at = -PROGRESS_INTERVAL_S
_progress_wake = threading.Event()
_flusher: threading.Thread | None = None


def set_progress(step: int | None, what: str = "") -> None:
    """Record where this rank is (step number, phase); shown in failure reports, hang
    reports and the parent's waiting message. Sent at once unless a message went less than
    ``PROGRESS_INTERVAL_S`` ago; then the flusher sends the latest one when that ends (a
    step's several phases cost a pipe message, not one each)."""
    global _progress, _flusher
    _progress = (step, what)
    if _conn is None:
        return
    # a phase outside the steps (rendezvous, started, ...) is rare and places a death before
    # the first step: always sent at once
    if step is None or time.monotonic() - _progress_sent_at >= PROGRESS_INTERVAL_S:
        flush_progress()
        return
    if _flusher is None:
        _flusher = threading.Thread(target=_flush_loop, name="dcpsim-progress", daemon=True)
        _flusher.start()
    _progress_wake.set()


def flush_progress() -> None:
    """Send the latest progress now if the parent does not have it (before a rank ends
    without a report, so its exit is placed right)."""
    global _progress_sent, _progress_sent_at
    if _conn is None:
        return
    with _progress_lock:
        progress = _progress
        if progress == _progress_sent:
            return
        _progress_sent, _progress_sent_at = progress, time.monotonic()
        _send(("progress", *progress))


def _flush_loop() -> None:
    while True:
        _progress_wake.wait()
        _progress_wake.clear()
        delay = _progress_sent_at + PROGRESS_INTERVAL_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        flush_progress()


class _PipeProgress(Progress):
    """``Progress`` over this rank's pipe to the parent (``set_progress``, ``flush_progress``)."""

    def set(self, step: int | None, phase: str = "") -> None:
        set_progress(step, phase)

    def flush(self) -> None:
        flush_progress()


PIPE_PROGRESS = _PipeProgress()


def send_event(payload) -> None:
    """Send a picklable ``payload`` to the parent's ``on_event(rank, payload)`` now (no-op
    outside ``run_world`` ranks)."""
    if _conn is not None:
        _send(("event", payload))


def _send(msg) -> None:
    # plain pickle: the parent gets bytes, never fds or shared memory of a dying rank
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with _send_lock:
        try:
            _conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError):
            os._exit(EXIT_ORPHANED)  # the parent is gone: nobody to tell, so end quietly


def _die_with_parent() -> None:
    """Best effort: never outlive the supervising process."""
    try:  # SIGKILL this rank when its parent (the forkserver) dies
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    # The forkserver exits once every holder of its "alive" pipe is gone, and each child
    # inherits a copy. Drop ours, so the forkserver (and so, via PDEATHSIG, every rank)
    # goes away with the main process.
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None
    os.setpgrp()  # own process group: no terminal ^C here, and killpg reaches helpers


def _rank_main(conn, job: bytes, rank, world_size, store_path, pg_timeout_s):
    global _conn
    _conn = conn
    _die_with_parent()
    # Everything the forkserver preloaded (torch: ~10^5 objects) is never garbage, yet every
    # full collection of the rank walked it: freeze it out of the collector's generations
    # (a quarter of a decode step's CPU at W = 8; benchmarks/bench_verify.py)
    gc.freeze()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        rank_fn, payload = pickle.loads(job)
        set_progress(None, "rendezvous")
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        set_progress(None, "started")
        result = rank_fn(payload, rank, world_size)
        dist.destroy_process_group()
        _send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        _send(("fail", RankFailure(rank, *_progress, type(exc).__name__, str(exc), traceback.format_exc())))


def init_env_process_group(pg_timeout_s: float) -> tuple[int, int]:
    """torchrun entry: join the gloo group described by RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT, with one intra-op thread. Returns (rank, world_size); the caller
    destroys the group when done."""
    need = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in need if not os.environ.get(k)]
    if missing:  # a usage error: nothing was started
        raise ConfigError(
            f"environment variable(s) {', '.join(missing)} not set: start this entry point with torchrun (or set {', '.join(need)})"
        )
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError as exc:
        raise ConfigError(f"RANK/WORLD_SIZE must be integers: {exc}") from None
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
    except Exception as exc:
        raise HarnessError(
            f"rendezvous failed for rank {rank} of {world_size} at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: "
            f"{type(exc).__name__}: {_first_line(str(exc))}"
        ) from exc
    return rank, world_size


# --------------------------------------------------------------------------- parent side

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
    except Exception:  # noqa: BLE001 - the first world reports it
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
                target=_rank_main,
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
                    failures[rank] = _exit_failure(rank, procs[rank].exitcode, progress[rank])
            elif rank in reading:
                receive(rank)
        if failures and stop_at == deadline:
            stop_at = min(deadline, time.monotonic() + grace_s)

    if running and not failures:
        raise HarnessError(
            f"world of {plural(world_size, 'rank')} did not finish within deadline_s={deadline_s:g} s; "
            "killed the ranks still running:\n" + "\n".join(f"  rank {r}, last progress: {_where(progress[r])}" for r in sorted(running))
        )
    if failures:
        killed = [
            RankFailure(r, *progress[r], "Killed", f"still running {grace_s:g} s after the first failure", "") for r in sorted(running)
        ]
        raise _failure_error(list(failures.values()), killed, world_size, phase_order)
    exit_by = time.monotonic() + 1.0  # ranks exit right after reporting; _kill does the rest
    for proc in procs:
        proc.join(max(0.0, exit_by - time.monotonic()))
    return [results[r] for r in range(world_size)]


def waiting_message(seconds: float, running: list[int], progress, world_size: int) -> str:
    """``waiting 5.0 s for 3 of 3 ranks: ranks 0, 1 at step 3 (verify); rank 2 at step 3 (write)``:
    how long since the last event (or the start), and where each rank still running is."""
    where: dict[str, list[int]] = {}
    for rank in running:
        where.setdefault(_where(progress[rank]), []).append(rank)
    parts = [f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} at {at}" for at, ranks in where.items()]
    took = f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"
    return f"waiting {took} s for {len(running)} of {plural(world_size, 'rank')}: " + "; ".join(parts)


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


def _exit_failure(rank, exitcode, progress) -> RankFailure:
    if exitcode is not None and exitcode < 0:
        how = f"killed by signal {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return RankFailure(rank, *progress, "ProcessExit", f"{how} without reporting a result", "")


_COLLECTIVE = re.compile(r"gloo|connection (closed|reset)|timed? ?out|socket", re.I)


def _is_collective_error(f: RankFailure) -> bool:
    """Did a collective (or the rendezvous) give up because of some other rank?"""
    return f.exc_type.startswith("Dist") or (f.exc_type == "RuntimeError" and bool(_COLLECTIVE.search(f.message)))


def _ran_ahead(failed: list[RankFailure], phase_order: tuple[str, ...]) -> list[RankFailure]:
    """Of ranks that all timed out in collectives at known phases, those furthest along
    when the others are behind them: they skipped a collective the others wait in."""
    if not phase_order or any(f.step is None or f.what not in phase_order for f in failed):
        return []
    at = {f.rank: (f.step, phase_order.index(f.what)) for f in failed}
    ahead = max(at.values())
    if all(v == ahead for v in at.values()):
        return []
    return [f for f in failed if at[f.rank] == ahead]


def _failure_error(
    failed: list[RankFailure], killed: list[RankFailure], world_size: int, phase_order: tuple[str, ...] = ()
) -> RankFailureError:
    """Primary: ranks that failed on their own; if there are none, the ranks that hung
    while the others timed out in a collective; then the ranks that ran ahead past a
    collective the others timed out in (``_ran_ahead``); failing that, the first failure."""
    own = [f for f in failed if not _is_collective_error(f)]
    ahead = [] if own or killed else _ran_ahead(failed, phase_order)
    primary = own or killed or ahead or failed[:1]
    for f in primary:
        f.primary = True
    secondary = [f for f in failed if not f.primary]
    killed = [f for f in killed if not f.primary]

    first = primary[0]
    rendezvous = any(f.step is None and f.what in ("", "rendezvous") for f in failed + killed)
    if ahead:
        behind = [f for f in failed if not f.primary]
        lines = [
            f"collective hang in a world of {plural(world_size, 'rank')}: "
            f"{'rank' if len(ahead) == 1 else 'ranks'} {', '.join(str(f.rank) for f in ahead)} skipped a "
            f"collective: ran ahead to {first.where()} while "
            + "; ".join(f"rank {f.rank} waited at {f.where()}" for f in behind)
            + "; every rank then timed out"
        ]
    else:
        lines = [
            f"{'rendezvous failed' if rendezvous else 'rank failure'} in a world of "
            f"{plural(world_size, 'rank')}: rank {first.rank} {first.exc_type}: "
            f"{_first_line(first.message)}"
        ]
    for f in primary:
        lines.append(f"primary: rank {f.rank} at {f.where()}: {f.exc_type}: {f.message}")
        lines += ["    " + line for line in f.traceback.rstrip().splitlines()]
    for f in secondary:
        lines.append(f"secondary: rank {f.rank} at {f.where()}: {f.exc_type}: {_first_line(f.message)}")
    for f in killed:
        lines.append(f"killed: rank {f.rank} at {f.where()}: {f.message}")
    return RankFailureError("\n".join(lines), primary + secondary + killed)


def _where(progress) -> str:
    step, what = progress
    if step is None:
        return f"'{what}' (no step)" if what else "start (no progress yet)"
    return f"step {step} ({what})" if what else f"step {step}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
