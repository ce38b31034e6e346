"""The key of an interpreted kernel launch (``launch_cache``): everything its result can depend on.

* The kernel by its code (``kernel_identity``): under the interpreter ``@triton.jit`` gives an
  ``InterpretedFunction``, which has no ``JITFunction.cache_key`` (nor its dependency finder), so
  the source of the kernel and of every ``@triton.jit`` helper or Python function it reaches
  through its globals is digested (``_source_digest``: the lines the interpreter rewrites and
  runs, decorators included, with the function's defaults and compiler flags), with the value of
  every plain global it names (an int, a ``tl.constexpr``, a dtype); a global of any other kind
  makes the launch uncacheable. The rest of a kernel's file is not in the key, so the releases
  of an engine that changed the file around an unchanged kernel share its launches.
* What runs it (``runtime_tag``): Triton's version and its interpreter's file, numpy's version,
  the interpreter's options, the text of dcpsim's interpreter patches and of this key.
* Its arguments (``Arguments``): the grid, every scalar and constexpr by type and value, every
  tensor by dtype, shape, strides, offset and the storage it views; each storage by its size and
  bytes (all of them: a kernel may reach any of its storage), but for the storages the kernel only
  writes (``outputs``: never loaded from, as recorded; their bytes before the launch cannot
  matter, say a ``torch.empty`` output). A pointer table (``pointers_to``) is keyed by the tensors
  it points to, not by their addresses.

``None`` anywhere: an argument or global whose effect cannot be keyed; the launch just runs.
"""

from __future__ import annotations

import hashlib
import os
import types

import numpy as np

POINTS_TO = "_dcpsim_points_to"
"""The attribute of a pointer table (``pointers_to``) naming the tensors its entries point to."""

_FILES: dict[str, bytes] = {}
_SOURCES: dict[types.FunctionType, bytes | None] = {}
_NAMES: dict[types.CodeType, tuple[str, ...]] = {}
_LIBRARIES = ("triton", "numpy", "torch", "math", "builtins", "typing", "functools")


def pointers_to(*tensors):
    """An int64 tensor of the addresses of ``tensors`` (for a kernel that loads a pointer, as
    vLLM's ``_load_ptr``), marked so that a launch's key holds the tensors, not the addresses."""
    import torch

    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    setattr(table, POINTS_TO, tuple(tensors))
    return table


def digest(*parts) -> str:
    h = hashlib.blake2b(digest_size=20)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def _file_digest(path: str) -> bytes | None:
    """The digest of ``path``'s text, read once per process (as the interpreter reads a
    kernel's source once)."""
    if path not in _FILES:
        try:
            with open(path, "rb") as f:
                _FILES[path] = hashlib.blake2b(f.read(), digest_size=20).digest()
        except OSError:
            return None
    return _FILES[path]


def _source_digest(fn: types.FunctionType) -> bytes | None:
    """The digest of what ``fn`` runs as under the interpreter, remembered per function: the
    text of its definition (``inspect.getsource``, the lines Triton's interpreter parses again
    and runs, decorators included), its defaults and its compiler flags (a ``__future__``
    import changes how its annotations, the ``tl.constexpr`` marks, read). None: no source
    (a function made at run time), a closure, or a default that is not a plain value."""
    import inspect

    if fn not in _SOURCES:
        try:
            text = inspect.getsource(fn)
        except (OSError, TypeError):
            text = None
        defaults = [_plain(v) for v in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())]
        if text is None or fn.__code__.co_freevars or any(d is None for d in defaults):
            _SOURCES[fn] = None
        else:
            kw = sorted(fn.__kwdefaults__ or {})
            _SOURCES[fn] = hashlib.blake2b(repr((text, defaults, kw, fn.__code__.co_flags)).encode(), digest_size=20).digest()
    return _SOURCES[fn]


def _names(code: types.CodeType) -> tuple[str, ...]:
    """The global and attribute names ``code`` and the code nested in it use."""
    if code not in _NAMES:
        names = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names.update(_names(const))
        _NAMES[code] = tuple(sorted(names))
    return _NAMES[code]


def _plain(value):
    """``value`` as a key part when it is a plain value (None otherwise)."""
    import torch
    import triton.language as tl

    if value is None:
        return ("None",)
    if isinstance(value, (bool, int, float, str, bytes, np.generic)):
        return (type(value).__name__, value)
    if isinstance(value, tl.constexpr):
        inner = _plain(value.value)
        return None if inner is None else ("constexpr", inner)
    if isinstance(value, (tl.dtype, torch.dtype)):
        return ("dtype", str(value))
    if isinstance(value, tuple):
        parts = [_plain(v) for v in value]
        return None if any(p is None for p in parts) else ("tuple", tuple(parts))
    return None


def _callee(value):
    """The Python function of a ``@triton.jit`` helper or of a plain function, else None."""
    fn = getattr(value, "fn", None)
    if isinstance(fn, types.FunctionType) and hasattr(value, "run"):
        return fn
    return value if isinstance(value, types.FunctionType) else None


def _global_part(value, names, pending):
    """A global's key part (queuing the functions it holds in ``pending``), None: unkeyable."""
    if isinstance(value, types.ModuleType):
        if value.__name__.split(".")[0] in _LIBRARIES:
            return ("library", value.__name__)
        parts = [(n, _global_part(getattr(value, n), names, pending)) for n in names if n in vars(value)]
        return None if any(p is None for _, p in parts) else ("module", value.__name__, tuple(parts))
    fn = _callee(value)
    if fn is not None:
        if fn.__module__ and fn.__module__.split(".")[0] in _LIBRARIES:
            return ("library", fn.__module__, fn.__qualname__)
        pending.append(fn)
        return ("function", fn.__module__, fn.__qualname__)
    if isinstance(value, type) and value.__module__.split(".")[0] in _LIBRARIES:
        return ("library", value.__module__, value.__qualname__)
    return _plain(value)


def kernel_identity(fn: types.FunctionType) -> str | None:
    """The digest of ``fn``'s code and of everything its globals reach (see the module's
    docstring); None when a global cannot be keyed."""
    parts, pending, seen = [], [fn], set()
    while pending:
        f = pending.pop()
        if f in seen:
            continue
        seen.add(f)
        text = _source_digest(f)
        if text is None:
            return None
        names = _names(f.__code__)
        parts.append((f.__module__, f.__qualname__, text))
        for name in names:
            if name in f.__globals__:
                part = _global_part(f.__globals__[name], names, pending)
                if part is None:
                    return None
                parts.append((name, part))
    return digest(*parts)


def runtime_tag() -> str:
    """What runs a kernel: Triton (version, its interpreter's file), numpy, the interpreter's
    options, dcpsim's interpreter patches and this key's own text."""
    import triton
    from triton.runtime import interpreter

    here = os.path.dirname(__file__)
    files = [interpreter.__file__, *(os.path.join(here, f) for f in ("interpreter.py", "launch_key.py", "launch_record.py"))]
    return digest(triton.__version__, np.__version__, repr(interpreter.interpreter_builder.options), *(_file_digest(f) for f in files))


def storage_bytes(storage) -> np.ndarray:
    """The bytes of a torch storage as a numpy ``uint8`` array over the same memory."""
    import torch

    if storage.nbytes() == 0:
        return np.zeros(0, dtype=np.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


class Arguments:
    """A launch's arguments keyed: ``structure`` (the grid, scalars and tensors without their
    bytes; None: unkeyable), ``storages`` (the distinct storages its tensors view, in order of
    first use), ``tables`` (the positions among them of pointer tables, whose bytes are
    addresses) and ``key(kernel, outputs)``: the kernel, the structure and the bytes of every storage but the tables
    and ``outputs`` (storages the kernel only writes, whose bytes before it cannot matter)."""

    def __init__(self, args: tuple, kwargs: dict, grid):
        self.storages: list = []
        self.tables: set[int] = set()
        self._by_address: dict[int, int] = {}
        self._digests: dict[int, bytes] = {}
        names = ["grid", *(f"#{i}" for i in range(len(args))), *sorted(kwargs)]
        parts = [self._grid(grid), *(self._part(a) for a in args), *(self._part(kwargs[k]) for k in sorted(kwargs))]
        if any(p is None for p in parts):
            self.structure = None
        else:
            sizes = [(s.nbytes(), i in self.tables) for i, s in enumerate(self.storages)]
            self.structure = digest(*zip(names, parts), *sizes)

    def key(self, kernel: str, outputs: frozenset) -> str:
        """The key of a launch of ``kernel`` (its code and runtime's digest) over these arguments
        whose ``outputs`` (storage positions) are only stored to."""
        inputs = [i for i in range(len(self.storages)) if i not in outputs and i not in self.tables]
        return digest(kernel, self.structure, tuple(sorted(outputs)), *((i, self.storage_digest(i)) for i in inputs))

    def storage_digest(self, i: int) -> bytes:
        """The digest of storage ``i``'s bytes (as they are at its first asking; SHA-256, about
        twice as fast as BLAKE2b where the CPU has SHA instructions)."""
        if i not in self._digests:
            self._digests[i] = hashlib.sha256(storage_bytes(self.storages[i])).digest()
        return self._digests[i]

    def digested(self, i: int) -> bool:
        """Whether storage ``i``'s bytes have been digested (they are in a key already asked for)."""
        return i in self._digests

    @staticmethod
    def _grid(grid):
        if callable(grid):
            return None
        return tuple(int(g) for g in grid)

    def _storage(self, tensor) -> int:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in self._by_address:
            self._by_address[address] = len(self.storages)
            self.storages.append(storage)
        return self._by_address[address]

    def _tensor(self, t):
        return ("tensor", str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset(), self._storage(t))

    def _part(self, value):
        import torch

        if type(value) is torch.Tensor:
            targets = getattr(value, POINTS_TO, None)
            if targets is None:
                return self._tensor(value)
            if value.dtype != torch.int64 or value.tolist() != [t.data_ptr() for t in targets]:
                return None
            self.tables.add(self._storage(value))
            return ("pointers", tuple(self._tensor(t) for t in targets), tuple(value.shape), tuple(value.stride()))
        if hasattr(value, "data_ptr"):  # a tensor of another kind (a wrapper, a descriptor): not keyed
            return None
        return _plain(value)
