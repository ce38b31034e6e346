"""Load single modules of an engine's source tree (vLLM's, SGLang's), with small stubs for
everything around them.

``import vllm`` or ``import sglang`` as a whole is not practical on a CPU machine (hundreds
of modules, CUDA checks, compiled extensions). ``SourceTree.load(names)`` executes only the
named modules from ``DIR/PACKAGE/...``, each as the project wrote it, under their real names:

* a package (a folder) becomes an empty package whose ``__init__.py`` is not run, unless
  it is one of the named modules;
* the few modules the engine needs from around them have small hand-written stubs
  (``stubs``: module name -> ``factory(name, tree)``, given by each engine's loader);
* any other module of the package that the loaded code imports is an *automatic stub*
  (``dcpsim.engine.loading.placeholders``).

Their compiled code is kept between processes (``code_cache``). Triton kernels run on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is first imported;
``dcpsim.engine.loading.interpreter``). The loaded modules
are taken out of ``sys.modules`` again afterwards (the functions keep their own globals), so
several trees, say a clean one and a patched copy, can be loaded by one process; code that
imports lazily when called runs inside ``importable()``, which puts them back meanwhile.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
import traceback
import types
from pathlib import Path

from dcpsim.engine.loading import launch_cache
from dcpsim.engine.loading.code_cache import CachedSourceLoader
from dcpsim.engine.loading.interpreter import drop_dead_overflow_checks, mend_interpreter_bools, quicken_interpreter
from dcpsim.engine.loading.placeholders import StubModule
from dcpsim.errors import ConfigError

_LOCK = threading.RLock()


def source_dir(given: str | None, *, engine: str, package: str, fetch: str) -> str:
    """The directory holding ``package/`` for ``--engine ENGINE``: ``given`` (its
    ``--ENGINE-source``), else ``$DCPSIM_ENGINE_SOURCE``; a ``ConfigError`` naming the flag (and
    ``engine fetch FETCH``) when neither is set, or naming the folder when it does not exist."""
    flag = f"--{engine}-source"
    env = f"DCPSIM_{engine.upper().replace('-', '_')}_SOURCE"
    source = given or os.environ.get(env)
    if not source:
        raise ConfigError(
            f"--engine {engine} needs {flag} DIR (or {env}): a directory holding {package}/; "
            f"get one with: python -m dcpsim engine fetch {fetch}"
        )
    if not os.path.isdir(source):
        raise ConfigError(f"{flag} {source}: no such directory")
    return source


class _Mark:
    """A place in ``sys.modules``' order (a dict keeps its keys in the order they were put):
    an empty module of its own put last, so that the names put after it, and only those, are
    the names put (or put back) in ``sys.modules`` since, found without reading the rest."""

    _count = 0

    def __init__(self):
        _Mark._count += 1
        self.key = f"dcpsim.engine.loading.tree:mark-{_Mark._count}"
        sys.modules[self.key] = types.ModuleType(self.key)

    def drop(self) -> list[str] | None:
        """The mark taken out; the names put in ``sys.modules`` after it (None: someone took
        the mark out, so nothing is known)."""
        keys = list(sys.modules)
        if sys.modules.pop(self.key, None) is None:
            return None
        keys.reverse()
        return keys[: keys.index(self.key)]


_OUTSIDE: dict[str, tuple[list[str], _Mark]] = {}
"""Per package: its names ``sys.modules`` held when the last context of the package (of any
tree) ended, and a mark put then."""


def _present(package: str, scan) -> list[str]:
    """The names of ``package`` in ``sys.modules`` now: those it held when the last context of
    the package ended that it still holds, and those put since (``scan(keys)`` picks the
    package's names); ``scan()`` over all of ``sys.modules`` when nothing is known (the first
    context, a context inside another of the package, a mark taken out)."""
    known = _OUTSIDE.pop(package, None)
    added = known[1].drop() if known is not None else None
    if added is None:
        return scan()
    return list(dict.fromkeys([k for k in known[0] if k in sys.modules] + scan(added)))


def _left(package: str, names: list[str]) -> None:
    """A context of ``package`` ended with ``names`` its names in ``sys.modules``."""
    previous = _OUTSIDE.pop(package, None)
    if previous is not None:
        previous[1].drop()
    _OUTSIDE[package] = (names, _Mark())


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tree: SourceTree, real: set[str]):
        self.tree, self.real = tree, real
        self.stubbed: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        package = self.tree.package
        if fullname != package and not fullname.startswith(package + "."):
            return None
        file = self.tree.file(fullname)
        is_package = self.tree.is_package(fullname)
        if fullname in self.real and file is not None:  # a listed package runs its __init__.py too
            locations = [str(file.parent)] if is_package else None
            loader = CachedSourceLoader(fullname, str(file))  # compiled once, kept between processes
            return importlib.util.spec_from_file_location(fullname, file, loader=loader, submodule_search_locations=locations)
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)
        if is_package:
            spec.submodule_search_locations = [str(self.tree.root / fullname.replace(".", "/"))]
        return spec

    def create_module(self, spec):
        name = spec.name
        if name in self.tree.stubs:
            return self.tree.stubs[name](name, self.tree)
        if name not in self.real:
            self.stubbed.add(name)
        return StubModule(name, self.tree)

    def exec_module(self, module):
        pass


class SourceTree:
    """A folder holding the package ``package`` (``vllm``, ``sglang``): an unpacked wheel, a
    site-packages, a checkout. ``label`` names the project in messages (``vLLM``), ``flag``
    the option that gave the folder (``--vllm-source``)."""

    def __init__(self, root, *, package: str, label: str, flag: str, stubs: dict | None = None, absent_third_party: tuple = ()):
        self.package, self.label, self.flag = package, label, flag
        self.stubs = dict(stubs or {})
        self.absent_third_party = tuple(absent_third_party)
        root = Path(root).expanduser()
        if not (root / package).is_dir():
            if root.name == package and (root / "__init__.py").is_file():
                root = root.parent
            else:
                raise ConfigError(
                    f"{flag} {root}: no {package}/ package in this directory (give the folder that holds {package}/, "
                    "e.g. an unpacked wheel)"
                )
        self.root = root.resolve()
        self.modules: dict[str, types.ModuleType] = {}
        self.stubbed: set[str] = set()
        self._imported: dict[str, types.ModuleType] = {}
        """Every module of the package the loads put in ``sys.modules`` (stubs too): what
        ``importable()`` puts back."""

    @property
    def version(self) -> str:
        text = ""
        candidates = (self.root / self.package / "_version.py", *self.root.glob(f"{self.package}-*.dist-info/METADATA"))
        for candidate in candidates:
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

    def _ours(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def _our_names(self, keys=None) -> list[str]:
        """The names of ``keys`` (all of ``sys.modules`` by default) in this tree's package."""
        dotted = self.package + "."
        return [k for k in (list(sys.modules) if keys is None else keys) if k.startswith(dotted) or k == self.package]

    @contextlib.contextmanager
    def _installed(self, finder: _Finder, modules: dict):
        """This tree's package importable: ``modules`` in ``sys.modules``, ``finder`` first on
        the meta path; whatever held the package's names before comes back afterwards.

        Which names of the package ``sys.modules`` holds is known without reading all of it
        (``_Mark``): on entry, those known when the last context of the package ended plus
        those added since; on exit, ``modules`` plus those added inside."""
        with _LOCK:
            saved = {k: sys.modules.pop(k) for k in _present(self.package, self._our_names)}
            absent = {n: StubModule(n, None) for n in self.absent_third_party if n not in sys.modules}
            sys.modules.update(absent)
            sys.modules.update(modules)
            inside = _Mark()
            sys.meta_path.insert(0, finder)
            try:
                yield
            finally:
                sys.meta_path.remove(finder)
                for n in absent:
                    sys.modules.pop(n, None)
                added = inside.drop()
                names = self._our_names() if added is None else [*modules, *self._our_names(added)]
                for k in dict.fromkeys(names):
                    if k in sys.modules:
                        self._imported[k] = sys.modules.pop(k)
                sys.modules.update(saved)
                _left(self.package, list(saved))

    def importable(self):
        """A context in which the loaded code may import lazily (at call time) what it imports:
        the modules of the loads, and stubs for the rest."""
        return self._installed(_Finder(self, set(self.modules)), dict(self._imported))

    def load(self, names: list[str], warm=None) -> dict[str, types.ModuleType]:
        """Execute the modules ``names`` (and return them by name); every other module of the
        package they import is a stub. ``warm(modules)``, if given, runs while the tree is
        still importable: for code that imports lazily on first use. Raises ``ConfigError``
        naming a missing file, or the file and line of a tree that does not import."""
        missing = [n for n in names if self.file(n) is None]
        if missing:
            files = ", ".join(str(self.root / (n.replace(".", "/") + ".py")) for n in missing)
            raise ConfigError(f"{self.label} source {self.root}: missing {files}")
        os.environ["TRITON_INTERPRET"] = "1"
        mend_interpreter_bools()
        drop_dead_overflow_checks()  # a third of each interpreted kernel, asserting nothing
        quicken_interpreter()  # costs of the interpreter that change no result
        launch_cache.install()  # a launch whose kernel and inputs repeat: replayed
        finder = _Finder(self, set(names))
        before = {k: m for k, m in self._imported.items() if k not in names or not getattr(m, "__dcpsim_stub__", False)}
        with self._installed(finder, before):
            try:
                for name in names:
                    self.modules[name] = self._import(name)
                if warm is not None:
                    warm({n: self.modules[n] for n in names})
            except ConfigError:
                raise
            except Exception as exc:  # a tree that does not import: exit 2 naming the file and line
                raise ConfigError(f"{self.label} source {self.root}: {self.failure_text(exc)}") from None
        self.stubbed |= finder.stubbed
        return {n: self.modules[n] for n in names}

    def _import(self, name: str) -> types.ModuleType:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            if isinstance(exc, ModuleNotFoundError) and exc.name and not self._ours(exc.name):
                raise ConfigError(
                    f"{self.label} source {self.root}: {name} imports {exc.name!r}, which is not installed "
                    f"(pip install {exc.name}; dcpsim's '{self.package}' extra holds what the loaded modules need)"
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
