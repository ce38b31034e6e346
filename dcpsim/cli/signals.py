"""SIGTERM and SIGHUP end a command the way Ctrl-C does: the exception unwinds through
the harness (which kills every rank on its way out), and ``main`` prints one line and
exits with ``128 + the signal's number`` (130 Ctrl-C, 129 SIGHUP, 143 SIGTERM)."""

from __future__ import annotations

import signal
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


def _raise(signum, frame) -> None:
    raise Terminated(signum)


def install() -> None:
    """Raise ``Terminated`` on SIGTERM and SIGHUP (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        signal.signal(sig, _raise)


def exit_code(exc: BaseException) -> int:
    """``128 + signal number``: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def describe(exc: BaseException) -> str:
    return f"interrupted by {exc.name}" if isinstance(exc, Terminated) else "interrupted"
