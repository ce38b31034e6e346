"""A directory the launcher writes for one world's ranks before the world starts, and removes
when it is done (the shared token streams, ``harness.streams``; the parent's schedules,
``harness.parent_schedule``).

It goes to ``/dev/shm`` where the system has it (a RAM file system: the files are never
written back to a disk), named after the launcher's pid, so that a launcher killed before it
could remove its own leaves it to the next one to remove.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

SHARED_MEMORY = "/dev/shm"
"""Where the directories go if the system has it: a RAM file system, never written back to a disk."""


def _remove_orphans(parent: str, prefix: str) -> None:
    """Remove the directories of launchers that no longer run (killed before they could remove
    their own: each directory is named ``{prefix}{pid}-...`` after its launcher)."""
    for name in os.listdir(parent):
        pid = name[len(prefix) :].split("-")[0] if name.startswith(prefix) else ""
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def world_directory(prefix: str):
    """A new directory ``{prefix}{pid}-...`` (in ``/dev/shm`` where there is one), removed on exit;
    the orphans of killed launchers with the same prefix are removed first."""
    parent = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else tempfile.gettempdir()
    _remove_orphans(parent, prefix)
    directory = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
