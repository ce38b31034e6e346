"""Load single modules of a vLLM source tree, with small stubs for everything around them.

``import vllm`` as a whole is not practical on a CPU machine (hundreds of modules, CUDA
checks, compiled extensions). ``SourceTree.load(names)`` executes only the named modules
from ``DIR/vllm/...``, each as vLLM wrote it, under their real names:

* a package (a folder) becomes an empty package whose ``__init__.py`` is not run, unless
  it is one of the named modules;
* the few modules the adapter needs from around them have small hand-written stubs
  (``STUBS``: a logger, ``triton_utils`` over the real ``triton``, ``get_dtype_size``, the
  KV event records);
* any other ``vllm`` module the loaded code imports is an *automatic stub*: every name in
  it is a placeholder that can be called, subclassed, decorated with and tested for
  truth (always false), so import-time code runs; using one for real fails loudly.

Triton kernels run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is first imported). The loaded modules are taken out of ``sys.modules``
again afterwards (the functions keep their own globals), so several trees, say a clean one
and a patched copy, can be loaded by one process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import re
import sys
import threading
import traceback
import types
from pathlib import Path

from dcpsim.errors import ConfigError

_LOCK = threading.Lock()
INTERPRETER_LOCK = threading.Lock()
"""Triton's interpreter patches the kernel module's globals while a kernel runs, so ranks
that are threads of one process (``--in-process``) launch one kernel at a time."""


def source_dir(vllm_source: str | None) -> str:
    """The directory holding ``vllm/``: ``vllm_source``, else ``$DCPSIM_VLLM_SOURCE``."""
    source = vllm_source or os.environ.get("DCPSIM_VLLM_SOURCE")
    if not source:
        raise ConfigError(
            "--engine vllm needs --vllm-source DIR (or DCPSIM_VLLM_SOURCE): a directory holding "
            "vllm/; get one with: python -m dcpsim engine fetch vllm==0.33.0"
        )
    if not os.path.isdir(source):
        raise ConfigError(f"--vllm-source {source}: no such directory")
    return source


class _Placeholder:
    """What an automatic stub hands out for every name (see the module docstring)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator: keep the function
        return _Placeholder(f"{self._name}(...)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __getitem__(self, key):
        return _Placeholder(f"{self._name}[...]")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):  # type annotations such as ``Stub | None``
        return _Placeholder(f"{self._name} | ...")

    __ror__ = __or__

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return f"<vLLM stub {self._name}>"


class _StubModule(types.ModuleType):
    """A module of placeholders; a package one still imports its real submodules."""

    def __init__(self, name: str, tree: SourceTree):
        super().__init__(name)
        self.__dcpsim_stub__ = True
        self._tree = tree

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if self._tree.exists(f"{self.__name__}.{name}"):
            raise AttributeError(name)  # a submodule: let the import system load it
        return _Placeholder(f"{self.__name__}.{name}")


class _Logger(logging.LoggerAdapter):
    """vLLM's logger: a standard logger plus its ``*_once`` methods (each message once)."""

    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})
        self._said: set = set()

    def _once(self, level: int, msg, *args, **kwargs) -> None:
        key = (level, msg, args)
        if key not in self._said:
            self._said.add(key)
            self.log(level, msg, *args, **{k: v for k, v in kwargs.items() if k != "scope"})

    def debug_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.WARNING, msg, *args, **kwargs)


def _logger_stub(name: str, tree) -> types.ModuleType:
    module = types.ModuleType(name)
    module.init_logger = _Logger
    module.logger = _Logger("vllm")
    return module


def _triton_utils_stub(name: str, tree) -> types.ModuleType:
    import triton
    import triton.language as tl

    module = types.ModuleType(name)
    module.triton, module.tl, module.HAS_TRITON = triton, tl, True
    module.LOG2E = 1.4426950408889634
    return module


def _torch_utils_stub(name: str, tree) -> types.ModuleType:
    import torch

    module = _StubModule(name, tree)
    module.get_dtype_size = lambda dtype: torch.tensor([], dtype=dtype).element_size()
    return module


class _Event:
    """A KV cache event as vLLM's block pool builds it (keywords only), readable back."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


def _kv_events_stub(name: str, tree) -> types.ModuleType:
    """vLLM's KV event types (msgspec structs there) as plain records of the same names."""
    module = types.ModuleType(name)
    module.KVCacheEvent = type("KVCacheEvent", (_Event,), {})
    for event in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        setattr(module, event, type(event, (module.KVCacheEvent,), {}))
    module.MEDIUM_GPU, module.MEDIUM_CPU, module.MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
    module.KVEventBatch = type("KVEventBatch", (_Event,), {})
    module.EventPublisherFactory = _EventPublisherFactory
    return module


class _EventPublisher:
    """vLLM's event publisher (a ZMQ socket there): keeps each published batch's events,
    for whoever drives vLLM's scheduler to read back (``take``)."""

    def __init__(self):
        self.events: list = []

    def publish(self, batch) -> None:
        self.events += batch.events

    def take(self) -> list:
        events, self.events = self.events, []
        return events

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self):
        return None


class _EventPublisherFactory:
    @staticmethod
    def create(config, data_parallel_rank: int = 0) -> _EventPublisher:
        return _EventPublisher()


ABSENT_THIRD_PARTY = ("uvloop",)
"""Third-party modules vLLM imports at module level for code dcpsim never runs (the engine
core's event loop): placeholders while a tree loads, if they are not installed."""

STUBS = {
    "vllm.logger": _logger_stub,
    "vllm.triton_utils": _triton_utils_stub,
    "vllm.utils.torch_utils": _torch_utils_stub,
    "vllm.distributed.kv_events": _kv_events_stub,
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tree: SourceTree, real: set[str]):
        self.tree, self.real = tree, real
        self.stubbed: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        file = self.tree.file(fullname)
        is_package = self.tree.is_package(fullname)
        if fullname in self.real and file is not None:  # a listed package runs its __init__.py too
            locations = [str(file.parent)] if is_package else None
            return importlib.util.spec_from_file_location(fullname, file, submodule_search_locations=locations)
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)
        if is_package:
            spec.submodule_search_locations = [str(self.tree.root / fullname.replace(".", "/"))]
        return spec

    def create_module(self, spec):
        name = spec.name
        if name in STUBS:
            return STUBS[name](name, self.tree)
        if name not in self.real:
            self.stubbed.add(name)
        return _StubModule(name, self.tree)

    def exec_module(self, module):
        pass


class SourceTree:
    """A folder holding a ``vllm/`` package: an unpacked wheel, a site-packages, a checkout."""

    def __init__(self, root):
        root = Path(root).expanduser()
        if not (root / "vllm").is_dir():
            if root.name == "vllm" and (root / "__init__.py").is_file():
                root = root.parent
            else:
                raise ConfigError(
                    f"--vllm-source {root}: no vllm/ package in this directory (give the folder that holds vllm/, e.g. an unpacked wheel)"
                )
        self.root = root.resolve()
        self.modules: dict[str, types.ModuleType] = {}
        self.stubbed: set[str] = set()

    @property
    def version(self) -> str:
        text = ""
        for candidate in (self.root / "vllm" / "_version.py", *self.root.glob("vllm-*.dist-info/METADATA")):
            if candidate.is_file():
                text = candidate.read_text(encoding="utf-8", errors="replace")
                match = re.search(r"""(?:__version__|^version)\s*[:=]\s*(?:version\s*=\s*)?['"]?([0-9][^'"\s]*)""", text, re.M)
                if match:
                    return match.group(1)
        return "unknown"

    def file(self, name: str) -> Path | None:
        base = self.root / name.replace(".", "/")
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None

    def is_package(self, name: str) -> bool:
        return (self.root / name.replace(".", "/")).is_dir()

    def exists(self, name: str) -> bool:
        return self.is_package(name) or self.file(name) is not None

    def load(self, names: list[str], warm=None) -> dict[str, types.ModuleType]:
        """Execute the modules ``names`` (and return them by name); every other ``vllm``
        module they import is a stub. ``warm(modules)``, if given, runs while the tree is
        still importable: for code that imports lazily on first use (vLLM's spec-manager
        registry). Raises ``ConfigError`` naming a missing file."""
        missing = [n for n in names if self.file(n) is None]
        if missing:
            files = ", ".join(str(self.root / (n.replace(".", "/") + ".py")) for n in missing)
            raise ConfigError(f"vLLM source {self.root}: missing {files}")
        os.environ["TRITON_INTERPRET"] = "1"
        mend_interpreter_bools()
        with _LOCK:
            saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
            for k in saved:
                del sys.modules[k]
            finder = _Finder(self, set(names))
            absent = {n: _StubModule(n, self) for n in ABSENT_THIRD_PARTY if n not in sys.modules}
            sys.modules.update(absent)
            sys.meta_path.insert(0, finder)
            try:
                for name in names:
                    self.modules[name] = self._import(name)
                if warm is not None:
                    warm({n: self.modules[n] for n in names})
            except ConfigError:
                raise
            except Exception as exc:  # a tree that does not import: exit 2 naming the file and line
                raise ConfigError(f"vLLM source {self.root}: {self.failure_text(exc)}") from None
            finally:
                sys.meta_path.remove(finder)
                for n in absent:
                    del sys.modules[n]
                for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
                    del sys.modules[k]
                sys.modules.update(saved)
            self.stubbed |= finder.stubbed
        return {n: self.modules[n] for n in names}

    def _import(self, name: str) -> types.ModuleType:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith("vllm"):
                raise ConfigError(
                    f"vLLM source {self.root}: {name} imports {exc.name!r}, which is not installed "
                    f"(pip install {exc.name}; dcpsim's 'vllm' extra holds what the loaded modules need)"
                ) from None
            raise

    def frames(self, exc: BaseException) -> list[traceback.FrameSummary]:
        """The frames of ``exc``'s traceback inside this tree, outermost first."""
        return [f for f in traceback.extract_tb(exc.__traceback__) if self.contains(f.filename)]

    def contains(self, filename: str) -> bool:
        try:
            return Path(filename).resolve().is_relative_to(self.root)
        except OSError:
            return False

    def relative(self, filename: str) -> str:
        return str(Path(filename).resolve().relative_to(self.root))

    def failure_text(self, exc: BaseException) -> str:
        """Where in the tree ``exc`` came from: ``vllm/x.py:12: SyntaxError: ...``."""
        if isinstance(exc, SyntaxError) and exc.filename and self.contains(exc.filename):
            return f"{self.relative(exc.filename)}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
        frames = self.frames(exc)
        if frames:
            f = frames[-1]
            return f"{self.relative(f.filename)}:{f.lineno} ({f.name}): {type(exc).__name__}: {exc}"
        return f"{type(exc).__name__}: {exc}"


_FIXED = False


def mend_interpreter_bools() -> None:
    """Restore bool semantics in Triton 3.9's interpreter (never in vLLM's code).

    * A ``torch.bool`` tensor argument becomes an int8 pointer, so a load through it comes
      back as int8 and ``~x`` is bitwise (``~1 == -2``, still true): such arguments are
      passed as int1 pointers instead.
    * A comparison (and the cast of a load to int1) yields numpy bools tagged with the
      operand's type (say int8), so a mask built from it is refused ("mask has
      unsupported dtype") or ``~`` flips every bit: a boolean result is tagged int1.
    * An interpreted kernel has no ``constexprs`` (the indices of its ``tl.constexpr``
      parameters, a ``JITFunction`` attribute vLLM's kernel launchers read): it gets one.
    """
    global _FIXED
    if _FIXED:
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original_cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, torch.Tensor) and arg.dtype == torch.bool:
            ty = tl.pointer_type(tl.int1)
            return tl.tensor(interpreter.TensorHandle(np.array([arg.data_ptr()], dtype=np.uint64), ty), ty)
        return original_cvt(arg)

    builder = interpreter.InterpreterBuilder
    original_binary_op = builder.binary_op

    def binary_op(self, lhs, rhs, op):
        out = original_binary_op(self, lhs, rhs, op)
        if out.data.dtype == np.bool_ and out.dtype != tl.int1:
            return interpreter.TensorHandle(out.data, tl.int1)
        return out

    def constexprs(self) -> list[int]:  # what JITFunction has and vLLM's kernel launchers read
        params = inspect.signature(self.fn).parameters.values()
        return [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]

    interpreter._implicit_cvt = implicit_cvt
    builder.binary_op = binary_op
    if not hasattr(interpreter.InterpretedFunction, "constexprs"):
        interpreter.InterpretedFunction.constexprs = property(constexprs)
    _FIXED = True
