"""What an interpreted launch touched (``launch_cache``): every load and store the interpreter makes
(``_interpreter.load``/``store``, its atomics) checked against the storages its key covers, and
the bytes it stored.

The storages it never loaded from are its outputs (``Recording.outputs``): the key leaves their
bytes out. A launch is replayable only when every access fell inside those storages, no pointer was turned
into an integer (a result that would depend on an address), no pointer was stored and no pointer
table written. Its effect (``Recording.effect``) is then the bytes at every stored-to offset of
each storage after the launch, as runs: replaying it over the same inputs leaves each storage as
the kernel would.
"""

from __future__ import annotations

import threading

import numpy as np

_ACTIVE = threading.local()


class Recording:
    """The accesses of one launch over ``storages`` (torch storages; positions in ``tables``:
    pointer tables, which must not be written)."""

    def __init__(self, storages: list, tables: set[int]):
        self.storages, self.tables = storages, tables
        starts = np.array([s.data_ptr() for s in storages], dtype=np.uint64)
        order = np.argsort(starts, kind="stable")
        self.order = order
        self.starts = starts[order]
        self.ends = self.starts + np.array([storages[i].nbytes() for i in order], dtype=np.uint64)
        self.replayable = True
        self.read: set[int] = set()  # the positions of the storages loaded from
        self.written: list[tuple[np.ndarray, np.ndarray, int]] = []  # (storage position, offset, itemsize)

    def __enter__(self):
        _ACTIVE.recording = self
        return self

    def __exit__(self, *exc):
        _ACTIVE.recording = None

    def access(self, ptrs: np.ndarray, mask, itemsize: int, write: bool) -> None:
        addresses = np.asarray(ptrs, dtype=np.uint64)
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if not mask.all():
                addresses = addresses[np.broadcast_to(mask, addresses.shape)]
        addresses = addresses.ravel()
        if not len(addresses):
            return
        if not len(self.starts):
            self.replayable = False
            return
        slot = int(np.searchsorted(self.starts, addresses.min(), side="right")) - 1
        if slot >= 0 and addresses.max() + np.uint64(itemsize) <= self.ends[slot]:  # one storage: the usual case
            position = int(self.order[slot])
            if not write:
                self.read.add(position)
                return
            self._touch(np.array([position]), addresses - self.starts[slot], itemsize, write)
            return
        slots = np.searchsorted(self.starts, addresses, side="right").astype(np.int64) - 1
        inside = slots >= 0
        slots = np.maximum(slots, 0)
        if not (inside & (addresses + np.uint64(itemsize) <= self.ends[slots])).all():
            self.replayable = False
            return
        self._touch(self.order[slots], addresses - self.starts[slots], itemsize, write)

    def _touch(self, positions: np.ndarray, offsets: np.ndarray, itemsize: int, write: bool) -> None:
        """A load or store at ``offsets`` of the storages at ``positions`` (one, or one per offset)."""
        if not write:
            self.read.update(int(p) for p in np.unique(positions))
            return
        if any(int(p) in self.tables for p in np.unique(positions)):
            self.replayable = False
        self.written.append((np.broadcast_to(positions, offsets.shape), offsets.astype(np.int64), itemsize))

    def outputs(self) -> frozenset:
        """The storages never loaded from (pointer tables aside): the kernel's result does not
        depend on their bytes before it."""
        return frozenset(range(len(self.storages))) - self.read - self.tables

    def effect(self, storage_bytes) -> tuple:
        """Per written storage: ``(position, run starts, run lengths, bytes)`` (numpy arrays as
        bytes), the bytes read from ``storage_bytes(storage)`` now."""
        out = []
        if not self.written:
            return ()
        offsets = np.concatenate([(o[:, None] + np.arange(size)).ravel() for _, o, size in self.written])
        owners = np.concatenate([np.repeat(p, size) for p, _, size in self.written])
        for position in np.unique(owners):
            mine = np.unique(offsets[owners == position])
            breaks = np.flatnonzero(np.diff(mine) != 1) + 1
            starts = mine[np.r_[0, breaks]]
            lengths = np.diff(np.r_[np.r_[0, breaks], len(mine)])
            data = storage_bytes(self.storages[int(position)])[mine]
            out.append((int(position), starts.astype(np.int64).tobytes(), lengths.astype(np.int64).tobytes(), data.tobytes()))
        return tuple(out)


def replay(effect: tuple, storages: list, storage_bytes) -> None:
    """Write a recorded ``effect`` into ``storages`` (those of a launch with the same key)."""
    for position, starts, lengths, data in effect:
        starts = np.frombuffer(starts, dtype=np.int64)
        lengths = np.frombuffer(lengths, dtype=np.int64)
        index = np.repeat(starts - np.r_[0, np.cumsum(lengths)[:-1]], lengths) + np.arange(int(lengths.sum()))
        storage_bytes(storages[position])[index] = np.frombuffer(data, dtype=np.uint8)


def unreplayable() -> None:
    """The launch under way (if recorded) cannot be replayed."""
    recording = getattr(_ACTIVE, "recording", None)
    if recording is not None:
        recording.replayable = False


def install(interpreter) -> None:
    """Route the interpreter's memory operations through the recording under way (if any):
    ``InterpreterBuilder``'s masked load and store, atomics, pointer-to-integer casts."""
    builder = interpreter.InterpreterBuilder
    load, store, ptr_to_int = builder.create_masked_load, builder.create_masked_store, builder.create_ptr_to_int

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        recording = getattr(_ACTIVE, "recording", None)
        if recording is not None:
            recording.access(ptrs.data, mask.data, interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize, False)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        recording = getattr(_ACTIVE, "recording", None)
        if recording is not None:
            if value.dtype.is_ptr():
                recording.replayable = False
            recording.access(ptrs.data, mask.data, value.data.dtype.itemsize, True)
        return store(self, ptrs, value, mask, cache_policy)

    def create_ptr_to_int(self, *args, **kwargs):
        unreplayable()
        return ptr_to_int(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    builder.create_ptr_to_int = create_ptr_to_int
    _route_atomics(builder)


def _route_atomics(builder) -> None:
    """An atomic's access recorded as a load, then a store."""
    cas, rmw = builder.create_atomic_cas, builder.create_atomic_rmw

    def both(ptr, mask, val) -> None:
        recording = getattr(_ACTIVE, "recording", None)
        if recording is not None:
            for write in (False, True):
                recording.access(ptr.data, mask, val.data.dtype.itemsize, write)

    def create_atomic_cas(self, ptr, cmp, val, sem, scope):
        both(ptr, None, val)
        return cas(self, ptr, cmp, val, sem, scope)

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        both(ptr, mask.data, val)
        return rmw(self, rmwOp, ptr, val, mask, sem, scope)

    builder.create_atomic_cas, builder.create_atomic_rmw = create_atomic_cas, create_atomic_rmw
