"""The directory of a world's shared token streams (``model.shared_streams``): written by the
launcher before the world starts, removed when it is done.

It goes to ``/dev/shm`` where the system has it (a RAM file system: the files are never
written back to a disk), named after the launcher's pid, so that a launcher killed before it
could remove its own leaves it to the next one to remove.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from dcpsim.harness.job import Job
from dcpsim.model.shared_streams import shareable, write_streams

_SHARED_MEMORY = "/dev/shm"
"""Where the shared streams go if the system has it: a RAM file system, never written back to a disk."""
_STREAMS_PREFIX = "dcpsim-streams-"


def _remove_orphaned_streams(parent: str) -> None:
    """Remove the stream directories of launchers that no longer run (killed before they
    could remove their own: each directory is named after its launcher's pid)."""
    for name in os.listdir(parent):
        pid = name[len(_STREAMS_PREFIX) :].split("-")[0] if name.startswith(_STREAMS_PREFIX) else ""
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
def shared_streams_of(jobs: list[Job]):
    """A temp directory holding the jobs' long token streams, drawn and hashed once for
    every rank (``model.shared_streams``), removed when the world is done; None if no request
    is long enough to share."""
    pairs = [(job.scenario.seed, spec) for job in jobs for spec in job.scenario.requests if shareable(spec)]
    if not pairs:
        yield None
        return
    parent = _SHARED_MEMORY if os.path.isdir(_SHARED_MEMORY) else tempfile.gettempdir()
    _remove_orphaned_streams(parent)
    directory = tempfile.mkdtemp(prefix=f"{_STREAMS_PREFIX}{os.getpid()}-", dir=parent)
    try:
        write_streams(pairs, directory)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
