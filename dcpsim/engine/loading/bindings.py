"""Which of an engine's known code shapes a source tree holds, decision by decision.

An engine adapter makes each of its decisions with one function of the engine's tree (vLLM's
slot-mapping kernel, SGLang's local lengths, ...). Where that function lives and what it takes
has changed from release to release, and a checkout (an engine's main branch, a fork) has no
version string to trust. So each engine keeps **one table** (``Decision``s, each with the
``Shape``s its code has had and the releases that had them), and ``bind(tree, table)`` reads
the tree's files (Python's ``ast``: nothing is imported) to find, per decision, the first shape
the tree holds: its file, its function, its leading parameters.

* A decision the tree holds in a known shape is **bound** to that shape; the adapter's code
  for the decision branches on ``Bindings.shape(name)``, never on a version.
* A decision whose code a known release never had (``Decision.absent``: vLLM's KV events
  before they existed, SGLang's interleave before 0.5.22) is **absent** where the tree names
  itself as one of those releases: the reference engine decides, and the adapter says so.
* Anything else (a tree newer than any known one, whose code moved or changed shape) is a
  **mismatch**: ``BindingError`` lists every mismatch at once (file, function, the signature
  found and the ones known), or, with ``partial=True`` (``--engine-partial``), the reference
  decides exactly those decisions and ``Bindings.partial`` names them.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from dcpsim.cache import cache_dir
from dcpsim.engine.loading.placeholders import is_placeholder
from dcpsim.errors import ConfigError


@dataclass(frozen=True)
class Shape:
    """One shape a decision's code has had."""

    name: str
    """What the adapter branches on (``"v2-dcp-sharded"``)."""
    module: str
    """The module that holds it (``vllm.v1.worker.gpu.block_table``)."""
    qualname: str
    """The function, or ``Class.method`` (``ComputeSlotMappingKernel.kernel``); ``""``: the module itself."""
    args: tuple[str, ...] = ()
    """Its leading parameters, as the adapter passes them."""
    releases: tuple[str, ...] = ()
    """The known releases that hold this shape."""
    exact: bool = False
    """The parameters must be exactly ``args`` (not only start with them)."""

    @property
    def file(self) -> str:
        return self.module.replace(".", "/") + ".py"

    def describe(self) -> str:
        where = f"{self.file}::{self.qualname}" if self.qualname else self.file
        args = f"({', '.join(self.args)}{'' if self.exact else ', ...'})" if self.qualname else ""
        return f"{where}{args}"


@dataclass(frozen=True)
class Decision:
    """One decision of an engine adapter and the shapes its code has had, newest first."""

    name: str
    shapes: tuple[Shape, ...]
    absent: tuple[str, ...] = ()
    """Known releases that have none of it."""
    absent_reason: str = ""
    """What those releases lack, and what decides instead (``"no KV events; reference"``)."""


@dataclass(frozen=True)
class Found:
    """What a tree holds where a shape would be."""

    shape: Shape
    state: str
    """``match``, ``no file``, ``missing`` or ``signature``."""
    have: tuple[str, ...] = ()
    """The parameters found (``signature``)."""

    def describe(self) -> str:
        if self.state == "no file":
            return f"{self.shape.file} is missing"
        if self.state == "missing":
            return f"{self.shape.file} has no {self.shape.qualname}"
        return f"{self.shape.file}::{self.shape.qualname} is ({', '.join(self.have)})"


@dataclass(frozen=True)
class Bound:
    """How one decision is made for a tree."""

    decision: str
    shape: Shape | None
    """The shape bound; None: the reference decides (absent, or partial)."""
    why: str = ""
    """Why the reference decides (``""`` when bound)."""

    def describe(self, label: str) -> str:
        if self.shape is not None:
            return f"{label} {self.shape.describe()} [{self.shape.name}]"
        return f"reference ({self.why})"


@dataclass(frozen=True)
class Mismatch:
    """A decision the tree holds in no known shape."""

    decision: Decision
    found: tuple[Found, ...]

    def describe(self) -> str:
        seen = "; ".join(dict.fromkeys(f.describe() for f in self.found))
        known = "; ".join(f"{s.describe()} in {_releases(s.releases)}" for s in self.decision.shapes)
        return f"{self.decision.name}: found {seen}; known: {known}"


class BindingError(ConfigError):
    """A tree holding some decisions in no known shape (exit 2, listing every one)."""

    def __init__(self, message: str, mismatches: tuple[Mismatch, ...]):
        super().__init__(message)
        self.mismatches = mismatches


@dataclass(frozen=True)
class Bindings:
    """Every decision of a table, bound for one tree."""

    release: str | None
    """The tree's own version when it names one (a wheel's ``dist-info``), else None."""
    bound: dict[str, Bound]
    partial: tuple[str, ...] = ()
    """Decisions the reference makes because the tree holds them in no known shape (``--engine-partial``)."""
    mismatches: tuple[Mismatch, ...] = field(default=())

    def shape(self, decision: str) -> str | None:
        """The name of the shape bound to ``decision``; None where the reference decides."""
        got = self.bound[decision].shape
        return None if got is None else got.name

    def has(self, decision: str) -> bool:
        return self.bound[decision].shape is not None

    def modules(self, decisions=None) -> list[str]:
        """The modules of the bound shapes (of ``decisions``, default all), in table order."""
        names = self.bound if decisions is None else decisions
        return list(dict.fromkeys(b.shape.module for n in names if (b := self.bound[n]).shape is not None))

    def why(self, decision: str) -> str:
        return self.bound[decision].why

    def describe(self, label: str) -> dict[str, str]:
        """Decision -> what makes it, as ``engine releases`` and ``engine info`` print it."""
        return {name: b.describe(label) for name, b in self.bound.items()}


def bind(root, table: tuple[Decision, ...], *, release: str | None, label: str, flag: str, partial: bool = False) -> Bindings:
    """Bind every decision of ``table`` to the first of its shapes that the tree at ``root``
    holds. ``release``: the version the tree names itself (None for a checkout). A decision in
    no known shape is ``absent`` when ``release`` is one the table says lacks it, else a
    mismatch: a ``BindingError`` listing them all, unless ``partial``."""
    root = Path(root)
    bound: dict[str, Bound] = {}
    mismatches: list[Mismatch] = []
    for decision in table:
        try:
            found = tuple(probe(root, shape) for shape in decision.shapes)
        except SyntaxError as exc:  # a tree that does not parse: exit 2 naming the file and line
            rel = Path(exc.filename).relative_to(root) if exc.filename and Path(exc.filename).is_relative_to(root) else exc.filename
            raise ConfigError(f"{label} source {root}: {rel}:{exc.lineno}: SyntaxError: {exc.msg}") from None
        match = next((f.shape for f in found if f.state == "match"), None)
        if match is not None:
            bound[decision.name] = Bound(decision.name, match)
        elif release is not None and release in decision.absent:
            bound[decision.name] = Bound(decision.name, None, f"{label} {release} {decision.absent_reason}")
        else:
            mismatches.append(Mismatch(decision, found))
            bound[decision.name] = Bound(decision.name, None, f"--engine-partial: {label} {release or 'tree'} holds it in no known shape")
    if mismatches and not partial:
        lines = "\n".join(f"  - {m.describe()}" for m in mismatches)
        raise BindingError(
            f"{label} {release or 'tree'} at {root}: {len(mismatches)} decision(s) in no known shape (pass --engine-partial "
            f"to let the reference make exactly these):\n{lines}",
            tuple(mismatches),
        )
    return Bindings(release, bound, tuple(m.decision.name for m in mismatches), tuple(mismatches))


def span(releases: tuple[str, ...], first: str, last: str | None = None) -> tuple[str, ...]:
    """The releases of ``releases`` from ``first`` to ``last`` (default the newest), both included."""
    return releases[releases.index(first) : releases.index(last or releases[-1]) + 1]


def resolve(tree, mods: dict, shape: Shape, known: str):
    """The object ``shape`` names in the loaded modules ``mods`` of ``tree`` (a loader's
    ``SourceTree``), its leading parameters checked again on the code as loaded; a
    ``ConfigError`` naming the file if it is missing there (a placeholder) or takes other
    parameters. ``known``: the releases the engine knows, for the message."""
    obj = mods[shape.module]
    for part in shape.qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None or is_placeholder(obj):
            raise ConfigError(_where(tree, shape, "is missing", known))
    have = _arg_names(obj)
    if have[: len(shape.args)] != shape.args:
        raise ConfigError(_where(tree, shape, f"has the signature ({', '.join(have)}), expected ({', '.join(shape.args)})", known))
    return obj


def _arg_names(fn) -> tuple[str, ...]:
    """A function's parameter names (a Triton kernel's: its Python function's)."""
    names = getattr(fn, "arg_names", None)
    if names is None:
        names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    return tuple(names)


def _where(tree, shape: Shape, what: str, known: str) -> str:
    return f"{tree.label} {tree.version} at {tree.root}: {shape.qualname} in {tree.root / shape.file} {what}; {known}"


def probe(root: Path, shape: Shape) -> Found:
    """What the tree at ``root`` holds where ``shape`` would be."""
    path = root / shape.file
    if not path.is_file():
        return Found(shape, "no file")
    if not shape.qualname:
        return Found(shape, "match")
    have = parameters(str(path), path.stat().st_mtime_ns, shape.qualname)
    if have is None:
        return Found(shape, "missing")
    fits = have == shape.args if shape.exact else have[: len(shape.args)] == shape.args
    return Found(shape, "match" if fits else "signature", have)


@lru_cache(maxsize=512)
def parameters(path: str, mtime_ns: int, qualname: str) -> tuple[str, ...] | None:
    """The parameter names of ``qualname`` (a function, a method, a class's ``__init__`` or
    dataclass fields) defined at the top of the file ``path``, or None. Kept between processes
    by the file's content (``_Kept``): a rank that binds a tree the parent bound parses none of
    its files."""
    kept = _kept(path, mtime_ns)
    if qualname in kept.found:
        return kept.found[qualname]
    have = _parameters(path, mtime_ns, qualname)
    kept.add(qualname, have)
    return have


class _Kept:
    """The answers of ``parameters`` for one file's content, in ``$DCPSIM_CACHE/signatures``
    under the SHA-256 of its bytes: another process (a rank, the next test run) reads them
    instead of parsing the file again; an edited file (a bug planted in a copy) has another
    digest, so never another content's answers. A file the cache cannot read or write is
    parsed as before."""

    VERSION = b"dcpsim-signatures-1"
    """Part of the key: a change to what ``_parameters`` answers for a file changes it too."""

    def __init__(self, path: str):
        self.file = None
        self.found: dict[str, tuple[str, ...] | None] = {}
        try:
            digest = hashlib.sha256(self.VERSION + Path(path).read_bytes()).hexdigest()
        except OSError:
            return
        self.file = cache_dir("signatures", digest[:2]) / f"{digest}.json"
        try:
            self.found = {k: None if v is None else tuple(v) for k, v in json.loads(self.file.read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            self.found = {}

    def add(self, qualname: str, have: tuple[str, ...] | None) -> None:
        self.found[qualname] = have
        if self.file is None:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                json.dump({k: None if v is None else list(v) for k, v in self.found.items()}, out)
            os.replace(tmp, self.file)  # atomic: a concurrent reader reads a whole file or none
        except OSError:
            pass


@lru_cache(maxsize=256)
def _kept(path: str, mtime_ns: int) -> _Kept:
    return _Kept(path)


def _parameters(path: str, mtime_ns: int, qualname: str) -> tuple[str, ...] | None:
    node = _module(path, mtime_ns)
    for part in qualname.split("."):
        node = _child(node, part)
        if node is None:
            return None
    if isinstance(node, ast.ClassDef):
        init = _child(node, "__init__")
        if init is not None:
            node = init
        else:
            return tuple(n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    a = node.args
    return tuple(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])


@lru_cache(maxsize=256)
def _module(path: str, mtime_ns: int) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"), filename=path)


def _child(node, name: str):
    """The last definition of ``name`` directly in ``node`` (as at run time), looking into
    top-level ``if``/``try`` blocks too."""
    hit = None
    for child in _body(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == name:
            hit = child
    return hit


def _body(node):
    for child in getattr(node, "body", ()):
        if isinstance(child, (ast.If, ast.Try)):
            yield from _body(child)
            yield from (c for h in getattr(child, "handlers", ()) for c in h.body)
            yield from getattr(child, "orelse", ())
        else:
            yield child


def _releases(releases: tuple[str, ...]) -> str:
    if not releases:
        return "no release"
    return releases[0] if len(releases) == 1 else f"{releases[0]}..{releases[-1]}"
