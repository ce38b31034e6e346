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

import bisect
import threading

import numpy as np

_ACTIVE = threading.local()
_HIGHEST = np.iinfo(np.uint64).max


class Recording:
    """The accesses of one launch over ``storages`` (torch storages; positions in ``tables``:
    pointer tables, which must not be written). The bytes of a storage in ``deferred`` are digested
    only at its first load (``first_load(position)``, before any store of the launch changed them): a
    storage the launch only stores to (an output) is never digested; one stored to before it is
    loaded from makes the launch unreplayable (its bytes before the launch are gone)."""

    def __init__(self, storages: list, tables: set[int], deferred: set[int] = frozenset(), first_load=None):
        self.storages, self.tables = storages, tables
        starts = [s.data_ptr() for s in storages]
        self.order = sorted(range(len(storages)), key=starts.__getitem__)
        self.starts = [starts[i] for i in self.order]
        self.ends = [starts[i] + storages[i].nbytes() for i in self.order]
        self.deferred, self.first_load = set(deferred), first_load
        self.replayable = True
        self.read: set[int] = set()  # the positions of the storages loaded from
        self.written: dict[int, list[tuple[np.ndarray, int]]] = {}  # position: [(offsets, itemsize)]

    def __enter__(self):
        _ACTIVE.recording = self
        return self

    def __exit__(self, *exc):
        _ACTIVE.recording = None

    def access(self, ptrs: np.ndarray, mask, itemsize: int, write: bool) -> None:
        addresses = ptrs if isinstance(ptrs, np.ndarray) and ptrs.dtype == np.uint64 else np.asarray(ptrs, dtype=np.uint64)
        live = None  # the live lanes of a partly masked access
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if not mask.all():
                live = np.broadcast_to(mask, addresses.shape)
        if live is None:
            if not addresses.size:
                return
            low, high = int(addresses.min()), int(addresses.max()) + itemsize
        else:  # the bounds of the live lanes, without copying them out
            if not live.any():
                return
            low = int(addresses.min(where=live, initial=_HIGHEST))
            high = int(addresses.max(where=live, initial=0)) + itemsize
        slot = bisect.bisect_right(self.starts, low) - 1
        inside = slot >= 0 and high <= self.ends[slot]  # one storage: the usual case
        if live is not None and (write or not inside):  # the offsets a store keeps, or each lane's storage
            addresses = addresses[live]
        if not inside:
            self._spread(addresses.ravel(), itemsize, write)
        elif write:
            self._store(self.order[slot], addresses.ravel() - np.uint64(self.starts[slot]), itemsize)
        else:
            self._load(self.order[slot])

    def _spread(self, addresses: np.ndarray, itemsize: int, write: bool) -> None:
        """An access over several storages (or outside them all: unreplayable)."""
        starts, ends = np.array(self.starts, dtype=np.uint64), np.array(self.ends, dtype=np.uint64)
        slots = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
        inside = slots >= 0
        slots = np.maximum(slots, 0)
        if not len(starts) or not (inside & (addresses + np.uint64(itemsize) <= ends[slots])).all():
            self.replayable = False
            return
        for slot in np.unique(slots).tolist():
            position = self.order[slot]
            if write:
                self._store(position, addresses[slots == slot] - starts[slot], itemsize)
            else:
                self._load(position)

    def _load(self, position: int) -> None:
        if position in self.deferred:
            self.deferred.discard(position)
            if position in self.written:
                self.replayable = False
            else:
                self.first_load(position)
        self.read.add(position)

    def _store(self, position: int, offsets: np.ndarray, itemsize: int) -> None:
        if position in self.tables:
            self.replayable = False
        self.written.setdefault(position, []).append((offsets.astype(np.int64), itemsize))

    def outputs(self) -> frozenset:
        """The storages never loaded from (pointer tables aside): the kernel's result does not
        depend on their bytes before it."""
        return frozenset(range(len(self.storages))) - self.read - self.tables

    def effect(self, storage_bytes) -> tuple:
        """Per written storage: ``(position, run starts, run lengths, bytes)`` (numpy arrays as
        bytes), the bytes read from ``storage_bytes(storage)`` now."""
        out = []
        for position in sorted(self.written):
            mine = written_bytes(self.written[position])
            breaks = np.flatnonzero(np.diff(mine) != 1) + 1
            starts = mine[np.r_[0, breaks]]
            lengths = np.diff(np.r_[np.r_[0, breaks], len(mine)])
            data = storage_bytes(self.storages[position])[mine]
            out.append((position, starts.astype(np.int64).tobytes(), lengths.astype(np.int64).tobytes(), data.tobytes()))
        return tuple(out)


def written_bytes(stores: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """The distinct byte offsets that ``stores`` (``(element offsets, itemsize)`` each) wrote,
    ascending. Stores of one item size whose distinct offsets lie at least an item apart (the
    usual case: no store overlaps another partially) are sorted by element, each then spread
    over its bytes in order, instead of sorting every byte."""
    sizes = {size for _, size in stores}
    if len(sizes) != 1:
        return _every_byte(stores)
    (size,) = sizes
    starts = stores[0][0] if len(stores) == 1 else np.concatenate([o for o, _ in stores])
    if not _apart(starts, size):
        starts = np.unique(starts)
        if not _apart(starts, size):
            return _every_byte(stores)
    return (starts[:, None] + np.arange(size, dtype=np.int64)).ravel()


def _apart(offsets: np.ndarray, size: int) -> bool:
    """Whether ``offsets`` ascend at least ``size`` apart (their items neither repeat nor overlap)."""
    return len(offsets) < 2 or bool((np.diff(offsets) >= size).all())


def _every_byte(stores: list[tuple[np.ndarray, int]]) -> np.ndarray:
    return np.unique(np.concatenate([(o[:, None] + np.arange(size)).ravel() for o, size in stores]))


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
