"""How a gloo rank's process asks the kernel to schedule it: as batch work.

A world's ranks are CPU-bound and, on a machine with fewer cores than ranks (a W = 8 world on
2 cores, two such worlds under ``pytest -n 2``), they take turns on the cores. Linux's default
policy preempts a running rank whenever another wakes (a peer's collective, its progress
flusher), every few milliseconds, and each switch costs the next rank its caches. So each rank
(``rank_main``), once it has joined the world (gloo's handshakes, which wait on each peer's
turn, keep the default policy), asks for ``SCHED_BATCH`` (no wakeup preemption) and, where the
kernel takes a time slice per task (``sched_setattr``'s ``sched_runtime`` for a fair task,
Linux 6.12 on), a slice of ``DCPSIM_RANK_SLICE_MS`` (default 20 ms). It changes when a rank runs, never what it
computes. ``DCPSIM_RANK_SLICE_MS=0`` leaves the ranks under the caller's policy.

Best effort: where the kernel refuses ``sched_setattr`` (an older kernel, a sandbox) the rank
asks for ``SCHED_BATCH`` alone, and where that is refused too (not Linux) it runs as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

from dcpsim.errors import ConfigError

ENV = "DCPSIM_RANK_SLICE_MS"
DEFAULT_SLICE_MS = 20.0
"""A slice past this gained nothing more in the full matrix's worlds on 2 cores (20, 50 and
100 ms within 3% of each other; the default policy took 15% longer)."""
MAX_SLICE_MS = 100.0
"""The longest slice Linux grants a fair task (it clamps ``sched_runtime`` to 0.1-100 ms)."""
MIN_SLICE_MS = 0.1

_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
"""Linux's (sched_setattr, sched_getattr) by machine; elsewhere only ``SCHED_BATCH`` is asked for."""


def _syscalls() -> tuple[int, int] | None:
    """This system's (sched_setattr, sched_getattr) numbers, or None (not Linux, or a machine
    not in ``_SYSCALLS``)."""
    return _SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None


class _SchedAttr(ctypes.Structure):
    """The kernel's ``struct sched_attr`` (its first version, 56 bytes, and the utilization
    clamps that follow it)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


def rank_slice_ms(environ=os.environ) -> float:
    """The slice the ranks of the next world ask for, in ms (0: leave them alone), from
    ``DCPSIM_RANK_SLICE_MS``; a value that is not 0 or 0.1-100 is a ``ConfigError``."""
    text = environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_SLICE_MS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value != 0 and not MIN_SLICE_MS <= value <= MAX_SLICE_MS:
        bounds = f"{MIN_SLICE_MS:g}-{MAX_SLICE_MS:g} ms"
        raise ConfigError(f"{ENV} must be 0 (the ranks keep the default scheduling) or a slice of {bounds}, got {text!r}")
    return value


def schedule_as_batch(slice_ms: float) -> str:
    """Ask for ``SCHED_BATCH`` with a ``slice_ms`` slice for this process (0: nothing); says
    what the kernel granted: ``"batch, 20 ms slice"``, ``"batch"`` or ``"default"``."""
    if slice_ms <= 0 or not hasattr(os, "SCHED_BATCH"):
        return "default"
    calls = _syscalls()
    if calls is not None:
        attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=os.SCHED_BATCH, sched_runtime=int(slice_ms * 1e6))
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(calls[0], 0, ctypes.byref(attr), 0) == 0:
            granted = current()[1]
            return f"batch, {granted / 1e6:g} ms slice" if granted else "batch"
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return "default"
    return "batch"


def current() -> tuple[int, int]:
    """This process's (policy, requested slice in ns; 0 where the kernel keeps none)."""
    calls = _syscalls()
    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else 0
    if calls is None:
        return policy, 0
    attr = _SchedAttr()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(calls[1], 0, ctypes.byref(attr), ctypes.sizeof(_SchedAttr), 0) != 0:
        return policy, 0
    return attr.sched_policy, attr.sched_runtime
