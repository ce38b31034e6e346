"""Interpreted kernel launches replayed when their kernel and inputs repeat.

Under Triton's CPU interpreter a launch costs milliseconds per program (vLLM's slot-mapping
kernel, SGLang's writes and page-table builder), and the same launch recurs: in every rank, every
run, every release sharing the kernel. ``install()`` wraps ``InterpretedFunction.run`` (every
``kernel[grid](...)`` of every engine goes through it) so that a launch

* is keyed (``launch_key``) by the kernel's code, what runs it, the grid, every scalar and every
  tensor's dtype, shape, strides and storage bytes;
* is looked up under each set of output storages (storages it only writes) its earlier launches
  of the same structure had, their bytes left out of the key (a ``torch.empty`` output);
* on a hit, gets the recorded effect written into its tensors (``launch_record.replay``): the
  bytes the kernel stored, exactly, and nothing else;
* on a miss, runs with its memory accesses recorded (``launch_record``) and, if every access
  stayed inside the storages its key covers, keeps its effect (``launch_store``).

Anything that cannot be keyed (a callable grid, a pre-run hook, an argument or global of an
unknown kind) or replayed (an access outside the keyed storages, a pointer turned into an integer)
just runs. ``DCPSIM_LAUNCH_CACHE=0`` turns it off (read at every launch).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from dcpsim.engine.loading.launch_key import Arguments, digest, kernel_identity, pointers_to, runtime_tag, storage_bytes
from dcpsim.engine.loading.launch_record import Recording, replay
from dcpsim.engine.loading.launch_store import FOLDER_ENV, LaunchStore

__all__ = ["BENCH_STATES", "COUNTS", "ENV", "STORE", "describe", "enabled", "for_benchmark", "install", "pointers_to"]

ENV = "DCPSIM_LAUNCH_CACHE"
STORE = LaunchStore()
COUNTS = {"hit": 0, "miss": 0, "unkeyable": 0, "unreplayable": 0}
"""This process's launches by outcome (a miss that was unreplayable counts in both)."""

_INSTALLED = False
_TAG: list[str] = []


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def describe() -> str:
    """What ``engine info`` says of kernel launches."""
    if not enabled():
        return f"under Triton's interpreter, every launch run ({ENV}=0: the launch cache is off)"
    return (
        "under Triton's interpreter; a launch whose kernel code (its source and its helpers', the globals it reads) "
        "and inputs (grid, scalars, "
        "each tensor's dtype, shape, strides and bytes) repeat is replayed from the launch cache "
        f"($DCPSIM_CACHE/launches; {ENV}=0: off)"
    )


BENCH_STATES = {
    "cold": "an empty launch cache before each timed run (what a first run of a tree pays)",
    "warm": "the launch cache the untimed first run filled (a repeated run)",
    "off": f"no launch cache ({ENV}=0)",
}


def for_benchmark(state: str):
    """A benchmark's launch cache in ``state`` (``BENCH_STATES``), in a folder of its own (set in
    the environment: call it before the ranks' forkserver starts); returns what to call before
    each timed run."""
    folder = tempfile.mkdtemp(prefix="dcpsim-launches-")
    os.environ[FOLDER_ENV] = folder
    atexit.register(shutil.rmtree, folder, True)
    if state == "off":
        os.environ[ENV] = "0"

    def before_each_run() -> None:
        if state == "cold":
            shutil.rmtree(folder, ignore_errors=True)

    return before_each_run


def install() -> None:
    """Wrap the interpreter's launches (process-wide, idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from triton.runtime import interpreter

    from dcpsim.engine.loading import launch_record

    launch_record.install(interpreter)
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        def launch():
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        if warmup or self.pre_run_hooks or not enabled():
            return launch()
        return _cached(self.fn, args, kwargs, grid, launch)

    interpreter.InterpretedFunction.run = run
    _INSTALLED = True


def _cached(fn, args: tuple, kwargs: dict, grid, launch):
    identity = kernel_identity(fn)
    arguments = Arguments(args, kwargs, grid) if identity is not None else None
    if arguments is None or arguments.structure is None:
        COUNTS["unkeyable"] += 1
        return launch()
    if not _TAG:
        _TAG.append(runtime_tag())
    kernel = digest(_TAG[0], identity)
    structure = digest(kernel, arguments.structure)
    known = STORE.outputs(structure)
    for outputs in known:
        effect = STORE.get(arguments.key(kernel, frozenset(outputs)))
        if effect is not None:
            COUNTS["hit"] += 1
            replay(effect, arguments.storages, storage_bytes)
            return None
    COUNTS["miss"] += 1
    recording = Recording(arguments.storages, arguments.tables, _deferred(arguments, known), arguments.storage_digest)
    for i in set(range(len(arguments.storages))) - recording.deferred - arguments.tables:  # the bytes before the launch
        arguments.storage_digest(i)
    with recording:
        result = launch()
    if recording.replayable:
        outputs = recording.outputs()
        if STORE.put(arguments.key(kernel, outputs), recording.effect(storage_bytes)):
            STORE.add_outputs(structure, tuple(sorted(outputs)))
    else:
        COUNTS["unreplayable"] += 1
    return result


def _deferred(arguments: Arguments, known: list) -> set[int]:
    """The storages whose bytes a recorded launch digests at its first load only: those every
    earlier launch of its structure only stored to (``known``: their output sets), never digested
    by a look-up (say a large KV buffer the kernel writes). None when the structure is new, or when
    storages overlap (a store through one would change the other's bytes before its load)."""
    if not known or _overlap(arguments.storages):
        return set()
    return {i for i in set.intersection(*(set(o) for o in known)) if not arguments.digested(i)}


def _overlap(storages: list) -> bool:
    spans = sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages)
    return any(end > start for (_, end), (start, _) in zip(spans, spans[1:]))
