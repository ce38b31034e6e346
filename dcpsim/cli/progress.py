"""Live progress of a long command (``matrix``, ``selftest``, ``fuzz``), always on stderr so
that stdout keeps only the result (one JSON document under ``--json``).

On a terminal (stdout and stderr both), with ``rich`` installed (``pip install
'dcpsim[progress]'``), a live bar counts the runs while each finished run is printed above
it. Otherwise (pipes, files, CI logs, no rich) one plain line per event:

    [3/40] dsv3-dcp2-il16-bs64 PASS (0.41 s)
    dcpsim: waiting 5 s for 2 of 2 ranks: ranks 0, 1 at step 12 (verify)
"""

from __future__ import annotations

import sys


def live_console(stdout=None, stderr=None):
    """A rich ``Console`` on stderr if both streams are terminals and rich is installed, else
    None (plain lines)."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    if not all(getattr(s, "isatty", lambda: False)() for s in (stdout, stderr)):
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=stderr)


class ProgressView:
    """Counts finished runs out of ``total`` (None: unknown), says what a waiting world waits
    for, and prints notes. ``console``: a rich Console for the live display; None: plain
    lines on ``stream`` (default: ``sys.stderr`` at each write). Use as a context manager."""

    def __init__(self, title: str, total: int | None, *, console=None, stream=None):
        self.title, self.total, self.count = title, total, 0
        self.console, self.stream = console, stream
        self._bar = self._task = None

    def __enter__(self) -> ProgressView:
        if self.console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[status]}", markup=False),
                console=self.console,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.title, total=self.total, status="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def done(self, text: str, ok: bool = True) -> None:
        """One run finished: ``[n/total] text`` (red on the live display unless ``ok``)."""
        self.count += 1
        line = f"[{self.count}/{self.total}] {text}" if self.total else text
        if self._bar is None:
            self._write(line)
            return
        from rich.text import Text

        self._bar.console.print(Text(line, style="" if ok else "bold red"), highlight=False)
        self._bar.update(self._task, advance=1, status="", refresh=True)

    def waiting(self, message: str) -> None:
        """A world keeps us waiting: the bar's status on the live display, else a line."""
        if self._bar is None:
            self._write(f"dcpsim: {message}")
        else:
            self._bar.update(self._task, status=message, refresh=True)

    def status(self, text: str) -> None:
        """Passing news shown on the live display only (not an event: no plain line)."""
        if self._bar is not None:
            self._bar.update(self._task, status=text, refresh=True)

    def note(self, text: str) -> None:
        """A line of its own, in both modes."""
        if self._bar is None:
            self._write(text)
        else:
            from rich.text import Text

            self._bar.console.print(Text(text), highlight=False)

    def restart(self, title: str, total: int | None) -> None:
        """A new phase (fuzz: searching, then shrinking): the count starts again."""
        self.title, self.total, self.count = title, total, 0
        if self._bar is not None:
            self._bar.update(self._task, description=title, total=total, completed=0, status="", refresh=True)

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stderr
        print(line, file=stream, flush=True)


def progress_view(title: str, total: int | None) -> ProgressView:
    """The view a command uses: live on a terminal with rich, plain lines otherwise."""
    return ProgressView(title, total, console=live_console())


def print_waiting(message: str) -> None:
    """``on_wait`` of a single run (``run``, ``replay``, the rerun of ``fuzz``): a line on stderr."""
    print(f"dcpsim: {message}", file=sys.stderr, flush=True)
