"""Where replayable launches are kept (``launch_cache``): a memo per process, and files under
``$DCPSIM_CACHE/launches`` (or ``$DCPSIM_LAUNCH_CACHE_DIR``) shared by every process (each rank, each run, each release).

An entry is one file per key (and one per launch structure: its sets of output storages),
written to a temporary file and renamed (a reader sees a whole file or none), holding its own
checksum and key: a file that is cut short, corrupt or of another key is a miss. The folder is kept
under ``$DCPSIM_LAUNCH_CACHE_MB`` (default 256): the first store of a process removes the least
recently used files past it (a file's mtime is renewed as a process first reads it: a folder kept
across CI runs loses the launches of kernels that changed, not those still replayed), when no
process did in the last ``PRUNE_EVERY`` seconds (``prune_due``). An effect over ``MAX_EFFECT`` bytes is not kept.
"""

from __future__ import annotations

import hashlib
import itertools
import marshal
import os
import time
from collections import OrderedDict
from pathlib import Path

from dcpsim.cache import cache_dir

FORMAT = 1
MAX_EFFECT = 16 << 20
MEMO_BYTES = 64 << 20
MAX_OUTPUT_SETS = 8
PRUNE_EVERY = 600
PRUNED = "pruned"
"""The stamp file of the folder's last pruning (``prune_due``)."""
LIMIT_ENV = "DCPSIM_LAUNCH_CACHE_MB"
FOLDER_ENV = "DCPSIM_LAUNCH_CACHE_DIR"
"""Another folder for the files (a benchmark's own, emptied before each timed run)."""


def _size(effect: tuple) -> int:
    return sum(len(starts) + len(lengths) + len(data) for _, starts, lengths, data in effect)


class LaunchStore:
    """Effects by key (``get``, ``put``), and per launch structure (a kernel's code and arguments
    without their bytes) the sets of output storages its recorded launches had (``outputs``,
    ``add_outputs``): which keys to try."""

    def __init__(self, folder=None):
        self.folder = folder
        self.memo: OrderedDict[str, tuple] = OrderedDict()
        self.memo_bytes = 0
        self.known_outputs: dict[str, list] = {}
        self.pruned = False

    def _folder(self) -> Path:
        if self.folder is not None:
            return Path(self.folder)
        return Path(os.environ[FOLDER_ENV]) if os.environ.get(FOLDER_ENV) else cache_dir("launches")

    def path(self, key: str, kind: str = "launch") -> Path:
        return self._folder() / key[:2] / f"{key}.{kind}"

    def get(self, key: str) -> tuple | None:
        """The effect kept under ``key``, or None."""
        if key in self.memo:
            self.memo.move_to_end(key)
            return self.memo[key]
        effect = _load(self.path(key), key)
        if effect is not None:
            self._remember(key, effect)
        return effect

    def put(self, key: str, effect: tuple) -> bool:
        """Keep ``effect`` under ``key`` (False: too large, or the folder cannot be written)."""
        if _size(effect) > MAX_EFFECT:
            return False
        self._remember(key, effect)
        if not _save(self.path(key), key, effect):
            return False
        if not self.pruned:
            self.pruned = True
            if prune_due(self._folder()):
                prune(self._folder(), int(float(os.environ.get(LIMIT_ENV) or 256) * (1 << 20)))
        return True

    def outputs(self, structure: str) -> list:
        """The output sets (sorted tuples of storage positions) recorded for ``structure``."""
        if structure not in self.known_outputs:
            self.known_outputs[structure] = list(_load(self.path(structure, "outputs"), structure) or [])
        return self.known_outputs[structure]

    def add_outputs(self, structure: str, outputs: tuple) -> None:
        """Note ``outputs`` among ``structure``'s output sets (with those another process noted)."""
        known = self.outputs(structure)
        if outputs in known:
            return
        on_disk = _load(self.path(structure, "outputs"), structure) or []
        merged = list(dict.fromkeys([*on_disk, *known, outputs]))[-MAX_OUTPUT_SETS:]
        self.known_outputs[structure] = merged
        _save(self.path(structure, "outputs"), structure, merged)

    def _remember(self, key: str, effect: tuple) -> None:
        if key not in self.memo:
            self.memo[key] = effect
            self.memo_bytes += _size(effect)
        while self.memo_bytes > MEMO_BYTES and len(self.memo) > 1:
            _, dropped = self.memo.popitem(last=False)
            self.memo_bytes -= _size(dropped)


def _load(path: Path, key: str):
    """The value saved at ``path`` under ``key``; None for a missing, cut, corrupt or other file.
    A file read whole gets a new mtime (``prune`` removes the least recently used first)."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    checksum, payload = blob[:32], blob[32:]
    if hashlib.blake2b(payload, digest_size=32).digest() != checksum:
        return None
    try:
        form, stored_key, value = marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return None
    if form != FORMAT or stored_key != key:
        return None
    try:
        os.utime(path)
    except OSError:  # a read-only folder: still a hit
        pass
    return value


_made_folders: set[Path] = set()
"""The folders this process has made or found (``_save`` makes each once, not per file)."""
_temp_names = itertools.count()


def _save(path: Path, key: str, value) -> bool:
    """``value`` saved at ``path`` under ``key``: a temporary file renamed (atomic). The
    temporary's name is this process's and a counter's (no other process or save makes it), so
    ``O_EXCL`` creates it without ``mkstemp``'s random tries; a cold run saves one or two files
    per launch (70 -> 41 us a save here). A folder removed since it was made is made again."""
    payload = marshal.dumps((FORMAT, key, value))
    folder = path.parent
    tmp = folder / f"{path.name}.{os.getpid()}.{next(_temp_names)}.tmp"
    try:
        if folder not in _made_folders:
            folder.mkdir(parents=True, exist_ok=True)
            _made_folders.add(folder)
        try:
            fd = _create(tmp)
        except FileNotFoundError:  # the folder went (a user emptied the cache): make it again
            folder.mkdir(parents=True, exist_ok=True)
            fd = _create(tmp)
        with os.fdopen(fd, "wb") as out:
            out.write(hashlib.blake2b(payload, digest_size=32).digest() + payload)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def _create(path: Path) -> int:
    """A new file at ``path``, opened for writing (``FileExistsError`` if there is one)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def prune_due(folder) -> bool:
    """Whether the folder's last pruning (the mtime of its ``PRUNED`` stamp) is ``PRUNE_EVERY``
    seconds old or more (then the stamp is renewed): a scan stats every file (0.2 s of CPU over
    40,000), too much for each rank process's first store."""
    stamp = Path(folder) / PRUNED
    try:
        if time.time() - stamp.stat().st_mtime < PRUNE_EVERY:
            return False
    except OSError:
        pass
    try:
        stamp.touch()
    except OSError:
        pass
    return True


def prune(folder, limit: int) -> None:
    """Remove the entries of ``folder`` least recently written or read (``_load``) until it
    holds at most ``limit`` bytes."""
    try:
        files = [(e.stat().st_mtime, e.stat().st_size, e.path) for d in os.scandir(folder) if d.is_dir() for e in os.scandir(d.path)]
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= limit:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        total -= size
