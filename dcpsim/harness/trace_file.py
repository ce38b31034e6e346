"""The ``--trace FILE`` file: checking the path, the parent's own track, merging the ranks'
events into one Trace Event Format document (``{"traceEvents": [...]}``, timestamps in
microseconds) that ui.perfetto.dev and chrome://tracing open.

Processes: ``rank R`` (pid ``R + 1``) for every rank, recorded by the rank itself
(``harness.trace``), and ``launcher`` (pid ``W + 1``), the parent, on the same clock: the
world (its start included) and the merge of the reports, where ranks that reached
different verdicts are a failure event of the parent's own.
"""

from __future__ import annotations

import json
import os
import time

from dcpsim.errors import ConfigError
from dcpsim.harness.trace import TraceRecorder, harness_tid, json_default, json_safe, rank_pid

CLOCK = (
    "ts: microseconds since the parent's reading of time.monotonic_ns just before the world started; "
    "every rank reads the same machine-wide monotonic clock"
)


def check_trace_path(path: str) -> str:
    """The absolute path of a file ``--trace`` can write, or a ``ConfigError`` (exit 2)
    naming the flag, before any rank starts. Leaves no file behind."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ConfigError(f"--trace {path}: is a directory; give a file name, such as {os.path.join(path, 'trace.json')}")
    existed = os.path.exists(full)
    try:
        with open(full, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError(f"--trace {path}: cannot write the trace there ({exc.strerror or exc})") from None
    if not existed:
        os.unlink(full)
    return full


def merge_traces(per_rank: list[list[dict]], other: dict | None = None, launcher: list[dict] = ()) -> dict:
    """One Trace Event Format document of the ranks' events (index = rank) and the
    parent's (``launcher``): a named process each, metadata first, then every event in
    time order (an enclosing slice before the slices it holds)."""
    meta, seen, events = [], set(), []
    names = [f"rank {rank}" for rank in range(len(per_rank))] + (["launcher"] if launcher else [])
    for rank, name in enumerate(names):
        pid, tid = rank_pid(rank), harness_tid(rank)
        meta.append(dict(name="process_name", ph="M", pid=pid, tid=tid, args={"name": name}))
        meta.append(dict(name="process_sort_index", ph="M", pid=pid, tid=tid, args={"sort_index": rank}))
    for rank_events in [*per_rank, launcher]:
        for e in rank_events:
            if e["ph"] == "M":
                key = (e["name"], e["pid"], e["tid"])
                if key not in seen:  # a thread named again by a later job of the batch
                    seen.add(key)
                    meta.append(e)
            else:
                events.append(e)
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0), e["pid"]))
    # no "displayTimeUnit": Perfetto reads "ms" there as the unit of every ts
    return {"traceEvents": meta + events, "otherData": json_safe(other or {})}


class Trace:
    """The parent's side of ``--trace``: the clock origin (taken when it is made, before
    the world starts), the parent's own track, the ranks' events, the file."""

    def __init__(self, path: str):
        self.path = path
        self.origin_ns = time.monotonic_ns()
        self.per_rank: list[list[dict]] = []
        self._launcher: TraceRecorder | None = None

    def launcher(self, world_size: int) -> TraceRecorder:
        """The parent's recorder, on the clock of the ranks: a process ``launcher`` after
        the ranks (pid ``world_size + 1``), for the world's start and the merge."""
        if self._launcher is None:
            self._launcher = TraceRecorder(world_size, self.origin_ns, thread="launcher")
        return self._launcher

    def add_ranks(self, per_rank: list[list[dict]]) -> None:
        self.per_rank = [list(events) for events in per_rank]

    def write(self, other: dict | None = None) -> int:
        """Write the merged document; returns its number of events."""
        launcher = self._launcher.events if self._launcher else []
        doc = merge_traces(self.per_rank, dict(other or {}, clock=CLOCK), launcher=launcher)
        with open(self.path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, allow_nan=False, separators=(",", ":"), default=json_default)
        return len(doc["traceEvents"])
