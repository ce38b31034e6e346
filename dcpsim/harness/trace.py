"""Recording a rank's timeline for ``--trace`` (Chrome trace events; ``trace_file`` writes them).

Tracks (``trace_file`` names the processes):

* one process per rank: pid ``R + 1``, since Perfetto's importer keeps pid and tid 0 for
  the idle task;
* in it, the thread ``harness`` (tid ``1000 * pid``): a ``job`` slice around the run,
  ``setup``, then per scheduler step a ``schedule`` slice (making the plan) and a
  ``step N`` slice holding ``write (all groups)`` (the worker's step, with
  ``attention compute`` inside),
  ``check writes``, ``verify``, ``attention merge`` and ``attention check``. Each
  collective is a slice inside them with its bytes (this rank's contribution, as
  ``Collectives`` counts it) and its phase; a counter follows the bytes sent. The first
  failure is an instant event on rank 0 (whose verdict the report gives), its details
  in the args;
* one thread per KV-cache group of the engine (tid ``1000 * pid + 1 + group_id``): one
  ``write`` slice per step, with the requests, the slots and the positions written.

Clocks: every timestamp is a reading of ``time.monotonic_ns()`` minus the origin, one
reading the parent takes before the world starts and hands to every rank. On Linux that
clock is ``CLOCK_MONOTONIC``, one counter for every process of the machine, so the ranks'
timelines line up exactly, with no per-rank shift to estimate (an earlier design moved
each rank's ``perf_counter_ns`` onto the wall clock by one reading of both; a rank
descheduled between the readings skewed its whole timeline by milliseconds). Threads
(``--in-process``) share the clock anyway.

Without ``--trace`` the harness gets ``NULL_RECORDER``, whose calls return at once, and
neither the collectives wrapper nor the write observer.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from dcpsim.collectives import Collectives
from dcpsim.model.plan import StepPlan, WriteRecord

TID_STRIDE = 1000
"""Thread ids of rank ``R``: ``TID_STRIDE * (R + 1) + k``, unique across ranks (Perfetto
names a thread by its tid alone)."""
MAX_RUNS = 6
"""Runs of consecutive positions a write slice lists before it elides the middle ones."""


def rank_pid(rank: int) -> int:
    return rank + 1


def harness_tid(rank: int) -> int:
    return TID_STRIDE * rank_pid(rank)


def group_tid(rank: int, group_id: int) -> int:
    return harness_tid(rank) + 1 + group_id


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def json_safe(value):
    """Plain JSON values: numpy numbers as numbers, arrays as lists, non-finite floats
    (an empty shard's lse) as strings."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_safe(v) for v in value]
    return value


def json_default(value):
    if isinstance(value, np.generic | np.ndarray):
        return json_safe(value)
    raise TypeError(f"{type(value).__name__} in a trace event is not JSON")


def describe_indices(index) -> str:
    """Written positions (or records) in short: ``0-63``, ``1-253 every 4``, or runs
    ``0-15, 32-47, ..., 480-495 (16 runs)``."""
    idx = np.asarray(index, dtype=np.int64)
    if len(idx) == 0:
        return "none"
    if len(idx) == 1:
        return str(idx[0])
    steps = np.diff(idx)
    if (steps == steps[0]).all() and steps[0] > 1:
        return f"{idx[0]}-{idx[-1]} every {steps[0]}"
    cut = np.flatnonzero(steps != 1) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(idx)]]) - 1
    runs = [str(idx[a]) if a == b else f"{idx[a]}-{idx[b]}" for a, b in zip(starts, ends)]
    if len(runs) <= MAX_RUNS:
        return ", ".join(runs)
    return ", ".join(runs[: MAX_RUNS - 2] + ["...", runs[-1]]) + f" ({len(runs)} runs)"


def step_args(plan: StepPlan) -> dict:
    return dict(
        step=plan.step,
        requests=len(plan.writes),
        tokens=sum(len(w.contents) for w in plan.writes),
        drafts=sum(w.num_drafts for w in plan.writes),
        live_requests=len(plan.views),
        events=[str(e) for e in plan.events],
        last=plan.last,
    )


def write_args(step: int, records: list[WriteRecord], what: str) -> dict:
    """A group's write slice: the requests, slots and positions (``what``) it wrote."""
    return dict(
        step=step,
        requests=[r.request_id for r in records],
        slots_written=sum(len(r.slots) for r in records),
        writes=[{"request": r.request_id, "slots": len(r.slots), what: describe_indices(r.index)} for r in records],
    )


def failure_event(failure) -> tuple[str, dict]:
    """Name and args of the instant event of a ``verify.report.Failure``."""
    args = json_safe(dataclasses.asdict(failure))
    args["report"] = failure.lines()
    return f"FAIL {failure.kind}", args


class _NullSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set(self, **args) -> None:
        pass


_NULL_SPAN = _NullSpan()


class NullRecorder:
    """Records nothing: the recorder of a run without ``--trace``."""

    enabled = False
    rank = 0
    events: tuple = ()

    def now(self) -> int:
        return 0

    def span(self, name: str, cat: str, *, start_ns: int | None = None, args: dict | None = None):
        """``with recorder.span(...) as s:`` a slice on the harness track; ``s.set(k=v)``
        adds args before it closes."""
        return _NULL_SPAN

    def step(self, plan: StepPlan):
        """The slice of one scheduler step (its args: what the plan holds)."""
        return _NULL_SPAN

    def complete(self, name: str, cat: str, start_ns: int, *, tid: int | None = None, args: dict | None = None) -> None:
        """A slice from ``start_ns`` to now (on the harness track unless ``tid``)."""

    def instant(self, name: str, cat: str, *, args: dict | None = None) -> None:
        pass

    def failure(self, failure) -> None:
        """The first failure, as an instant event."""

    def counter(self, name: str, values: dict) -> None:
        pass

    def name_thread(self, tid: int, name: str, sort_index: int) -> None:
        pass

    def write_observer(self, geometries):
        """The worker's ``WriteObserver`` for the engine's group ``geometries`` (None: none)."""
        return None


NULL_RECORDER = NullRecorder()


class _Span:
    __slots__ = ("rec", "name", "cat", "start", "args")

    def __init__(self, rec: TraceRecorder, name: str, cat: str, start: int | None, args: dict | None):
        self.rec, self.name, self.cat, self.start, self.args = rec, name, cat, start, dict(args or {})

    def __enter__(self):
        if self.start is None:
            self.start = self.rec.now()
        self.rec.open.append(self.name)
        return self

    def __exit__(self, *exc) -> bool:
        self.rec.open.pop()
        self.rec.complete(self.name, self.cat, self.start, args=self.args)
        return False

    def set(self, **args) -> None:
        self.args.update(args)


class TraceRecorder(NullRecorder):
    """One rank's events, timestamped in ns since the parent's ``origin_ns`` (see the
    module docstring for the clocks)."""

    enabled = True

    def __init__(self, rank: int, origin_ns: int, thread: str = "harness"):
        self.rank, self.pid, self.tid = rank, rank_pid(rank), harness_tid(rank)
        self._origin = origin_ns
        self.events: list[dict] = []
        self.open: list[str] = []
        """Names of the open harness slices, innermost last (a collective's phase)."""
        self.name_thread(self.tid, thread, 0)

    def now(self) -> int:
        return time.monotonic_ns() - self._origin

    def span(self, name, cat, *, start_ns=None, args=None):
        return _Span(self, name, cat, start_ns, args)

    def step(self, plan):
        return _Span(self, f"step {plan.step}", "step", None, step_args(plan))

    def complete(self, name, cat, start_ns, *, tid=None, args=None):
        self.events.append(
            dict(
                name=name,
                cat=cat,
                ph="X",
                ts=_us(start_ns),
                dur=_us(self.now() - start_ns),
                pid=self.pid,
                tid=self.tid if tid is None else tid,
                args=args or {},
            )
        )

    def instant(self, name, cat, *, args=None):
        self.events.append(dict(name=name, cat=cat, ph="i", s="t", ts=_us(self.now()), pid=self.pid, tid=self.tid, args=args or {}))

    def failure(self, failure):
        name, args = failure_event(failure)
        self.instant(name, "failure", args=args)

    def counter(self, name, values):
        self.events.append(dict(name=name, cat="counter", ph="C", ts=_us(self.now()), pid=self.pid, tid=self.tid, args=values))

    def name_thread(self, tid, name, sort_index):
        self.events.append(dict(name="thread_name", ph="M", pid=self.pid, tid=tid, args={"name": name}))
        self.events.append(dict(name="thread_sort_index", ph="M", pid=self.pid, tid=tid, args={"sort_index": sort_index}))

    def write_observer(self, geometries):
        return WriteTracer(self, geometries)


class TracedCollectives(Collectives):
    """A rank's collectives with every call recorded: a slice named after the operation,
    with the bytes this rank sent (the inner ``bytes_sent`` difference) and the open
    harness slice it ran in."""

    def __init__(self, inner: Collectives, recorder: TraceRecorder):
        self.inner, self.rec = inner, recorder
        self.rank, self.world_size = inner.rank, inner.world_size

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    def subgroup(self, name, groups):
        inner = self.inner.subgroup(name, groups)
        return None if inner is None else TracedCollectives(inner, self.rec)

    def _call(self, op: str, fn, arg, what: dict):
        rec, before, start = self.rec, self.inner.bytes_sent, self.rec.now()
        out = fn(arg)
        sent = self.inner.bytes_sent - before
        rec.complete(
            op, "collective", start, args=dict(bytes=sent, phase=rec.open[-1] if rec.open else None, world_size=self.world_size, **what)
        )
        rec.counter("collective bytes", {"sent": self.inner.bytes_sent})
        return out

    @staticmethod
    def _tensor(t) -> dict:
        return dict(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))

    def all_gather_tensor(self, tensor):
        return self._call("all_gather", self.inner.all_gather_tensor, tensor, self._tensor(tensor))

    def all_gather_object(self, obj):
        return self._call("all_gather_object", self.inner.all_gather_object, obj, dict(object=type(obj).__name__))

    def all_to_all_tensor(self, tensor):
        return self._call("all_to_all", self.inner.all_to_all_tensor, tensor, self._tensor(tensor))

    def reduce_scatter_tensor(self, tensor):
        return self._call("reduce_scatter", self.inner.reduce_scatter_tensor, tensor, self._tensor(tensor))


class WriteTracer:
    """The worker's ``WriteObserver`` under ``--trace``: one ``write`` slice per group and
    step, on the group's own track."""

    def __init__(self, recorder: TraceRecorder, geometries):
        self.rec = recorder
        self.what = {g.group_id: "records" if g.storage == "records" else "positions" for g in geometries}
        self._start = 0
        for g in geometries:
            layout = "sharded" if g.sharded else "replicated"
            recorder.name_thread(
                group_tid(recorder.rank, g.group_id), f"group {g.group_id}: {g.name} ({g.storage}, {layout})", 1 + g.group_id
            )

    def group_started(self, step: int, group_id: int) -> None:
        self._start = self.rec.now()

    def group_written(self, step: int, group_id: int, records: list[WriteRecord]) -> None:
        self.rec.complete(
            "write", "write", self._start, tid=group_tid(self.rec.rank, group_id), args=write_args(step, records, self.what[group_id])
        )
