"""The directory of a world's shared token streams (``model.shared_streams``): written by the
launcher before the world starts, removed when it is done (``harness.world_dir``)."""

from __future__ import annotations

import contextlib

from dcpsim.harness.job import Job
from dcpsim.harness.world_dir import world_directory
from dcpsim.model.shared_streams import shareable, write_streams

STREAMS_PREFIX = "dcpsim-streams-"


@contextlib.contextmanager
def shared_streams_of(jobs: list[Job]):
    """A temp directory holding the jobs' long token streams, drawn and hashed once for
    every rank (``model.shared_streams``), removed when the world is done; None if no request
    is long enough to share."""
    pairs = [(job.scenario.seed, spec) for job in jobs for spec in job.scenario.requests if shareable(spec)]
    if not pairs:
        yield None
        return
    with world_directory(STREAMS_PREFIX) as directory:
        write_streams(pairs, directory)
        yield directory
