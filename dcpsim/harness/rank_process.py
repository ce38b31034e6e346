"""What runs in a rank's own process: its entry point in a world started here
(``rank_main``: rendezvous over the world's ``FileStore``, the rank function, its result or
failure), its pipe to the parent (``set_progress``, ``send_event``, ``PIPE_PROGRESS``), and
the torchrun entry (``init_env_process_group``).

Kept light: ``python -m dcpsim`` imports the launcher (``harness.world``, which names this
module's entry point) before torch, so torch is imported inside the functions that run
in a rank.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import signal
import threading
import time
import traceback
from datetime import timedelta

from dcpsim.errors import ConfigError, HarnessError
from dcpsim.harness.progress import Progress
from dcpsim.harness.rank_sched import schedule_as_batch
from dcpsim.harness.world_failure import RankFailure, first_line

_PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 75
"""A rank's exit code when its parent went away (its pipe is broken): it ends at once, silently."""

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
    if not _progress_wake.is_set():  # already set: the flusher has yet to clear it, then sends the latest
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


def rank_main(conn, job: bytes, rank, world_size, store_path, pg_timeout_s, slice_ms: float):
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
        # after the rendezvous, whose TCP handshakes wait on each peer's turn: ranks that
        # outnumber the cores then take turns less often
        schedule_as_batch(slice_ms)
        result = rank_fn(payload, rank, world_size)
        dist.destroy_process_group()
        _send(("ok", result))
    except BaseException as exc:  # everything is reported to the parent
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
            f"{type(exc).__name__}: {first_line(str(exc))}"
        ) from exc
    return rank, world_size
