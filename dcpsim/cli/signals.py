"""SIGTERM and SIGHUP end a command the way Ctrl-C does: the exception unwinds through
the harness (which kills every rank on its way out), and ``main`` prints one line and
exits with ``128 + the signal's number`` (130 Ctrl-C, 129 SIGHUP, 143 SIGTERM). Only the
first signal counts: the ones after it are ignored while the command winds down."""

from __future__ import annotations

import os
import signal
import sys
import threading

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """The process got SIGTERM or SIGHUP (a ``BaseException``, like ``KeyboardInterrupt``,
    so no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_fired = False


def _raise(signum, frame) -> None:
    # The first signal starts the shutdown. Any later one (a supervisor and `timeout` both
    # sending SIGTERM, Ctrl-C pressed again) does nothing: raised inside the cleanup or
    # inside main's handler, it would cut the ranks' teardown short and end in a traceback.
    # (The handler stays installed: switching to SIG_IGN here makes Python raise "signal
    # ignored due to race condition" for a signal already pending.)
    global _fired
    if _fired:
        return
    _fired = True
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def install() -> None:
    """Raise ``Terminated`` on SIGTERM and SIGHUP, ``KeyboardInterrupt`` on SIGINT, for the
    first of them only (main thread only; elsewhere a no-op)."""
    global _fired
    if threading.current_thread() is not threading.main_thread():
        return
    _fired = False
    for sig in (*HANDLED, signal.SIGINT):
        signal.signal(sig, _raise)


def fired() -> bool:
    """Whether a signal has started the shutdown."""
    return _fired


def leave(code: int) -> None:
    """End the process now, with ``code``, after a signal decided the exit. The
    interpreter's finalization would put the default dispositions back, and one more
    signal arriving then would kill the process by that signal instead (exit -15, not
    143). Nothing is left to clean up: the harness killed the ranks while unwinding, and
    the forkserver ends when this process's end closes its pipe."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_code(exc: BaseException) -> int:
    """``128 + signal number``: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def describe(exc: BaseException) -> str:
    return f"interrupted by {exc.name}" if isinstance(exc, Terminated) else "interrupted"
