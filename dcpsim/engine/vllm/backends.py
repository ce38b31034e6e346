"""The vLLM attention backend a run names (``--vllm-attention-backend``), read from the tree.

Which base a backend's kernels return their LSEs in is the backend's own choice in vLLM:
the ``lse_base_on_e`` class attribute of its implementation (``AttentionImplBase``,
``vllm/v1/attention/backend.py``: ``True`` unless an implementation says otherwise, such as
``TokenspeedMLAImpl`` or the FlashInfer sparse MLA ones), or, for the non-MLA FlashInfer
implementation, the ``is_lse_base_on_e=False`` it binds into its combine function. The DCP
combine (``cp_lse_ag_out_rs``, ``dcp_a2a_lse_reduce``) is called with that base.

This module reads it from the source tree's text (Python's ``ast``), not from a table of
ours and without importing the backend (its module imports CUDA kernels): the backend's
class path from ``AttentionBackendEnum`` in ``vllm/v1/attention/backends/registry.py``,
its ``get_impl_cls``, and the implementation's bases followed through the modules' imports
to the class that sets the attribute.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dcpsim.errors import ConfigError

REGISTRY = "vllm/v1/attention/backends/registry.py"
ENUM = "AttentionBackendEnum"
DEFAULT_BACKEND = "FLASHMLA"
"""FlashMLA: vLLM's sharded-MLA decode backend for DeepSeek models on Hopper (base-e LSEs)."""
MLA_LAYER = "vllm/model_executor/layers/attention/mla_attention.py"
DCP_FLAGS = ("supports_dcp", "can_return_lse_for_decode")
"""The class attribute that says an implementation supports DCP: ``supports_dcp``, or, in
releases before it (0.23.0 among them), ``can_return_lse_for_decode``; the first found decides."""
MAX_BASES = 32
"""Classes followed up an implementation's bases before giving up (a cycle, a huge tree)."""


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    """The ``AttentionBackendEnum`` member (``--vllm-attention-backend``)."""
    backend_class: str
    impl_class: str
    lse_base_on_e: bool
    where: str
    """``file:line (what)`` of the setting the base was read from."""
    supports_dcp: bool

    @property
    def lse_base(self) -> str:
        return "e" if self.lse_base_on_e else "2"

    def describe(self) -> str:
        return f"{self.name}: {self.impl_class}, lse_base_on_e = {self.lse_base_on_e} ({self.where})"


@dataclass(frozen=True)
class _Module:
    name: str
    rel: str
    tree: ast.Module

    def classes(self) -> dict[str, ast.ClassDef]:
        """Top-level classes by name (a later definition wins, as at run time)."""
        return {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}

    def imported(self, name: str) -> tuple[str, str] | None:
        """``(module, name)`` a top-level ``from M import name`` (or inside ``if``) binds."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return node.module, alias.name
        return None


class _Reader:
    def __init__(self, root: Path):
        self.root = root

    @cache  # noqa: B019 (one reader per tree, kept for the process)
    def module(self, name: str) -> _Module:
        rel = name.replace(".", "/") + ".py"
        path = self.root / rel
        if not path.is_file():
            raise ConfigError(f"vLLM source {self.root}: missing {rel}")
        try:
            return _Module(name, rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel))
        except SyntaxError as exc:
            raise ConfigError(f"vLLM source {self.root}: {rel}:{exc.lineno}: SyntaxError: {exc.msg}") from None

    def backend_paths(self) -> dict[str, str]:
        """``AttentionBackendEnum`` member -> the class path it names."""
        registry = self.module(REGISTRY[:-3].replace("/", "."))
        enum = registry.classes().get(ENUM)
        if enum is None:
            raise ConfigError(f"vLLM source {self.root}: {REGISTRY} defines no {ENUM}")
        paths = {}
        for node in enum.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name) and node.value.value:
                        paths[target.id] = node.value.value
        return paths

    def find_class(self, module: _Module, name: str) -> tuple[_Module, ast.ClassDef] | None:
        """The class ``name`` as ``module`` sees it: defined there or imported from vLLM."""
        for _ in range(MAX_BASES):
            cls = module.classes().get(name)
            if cls is not None:
                return module, cls
            source = module.imported(name)
            if source is None or not source[0].startswith("vllm"):
                return None
            module, name = self.module(source[0]), source[1]
        return None

    def lineage(self, module: _Module, cls: ast.ClassDef):
        """The class, then its bases breadth-first (left first), each once, as ``(module, class)``."""
        todo, seen = [(module, cls)], set()
        while todo and len(seen) < MAX_BASES:
            module, cls = todo.pop(0)
            if (module.name, cls.name) in seen:
                continue
            seen.add((module.name, cls.name))
            yield module, cls
            todo += [found for found in (self.find_class(module, _base_name(b) or "") for b in cls.bases) if found]

    def attribute(self, module: _Module, cls: ast.ClassDef, attr: str):
        """``(value, module, node)`` of ``attr``'s constant value, first along the bases (left first)."""
        for owner, klass in self.lineage(module, cls):
            for node in klass.body:
                target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
                if isinstance(target, ast.Name) and target.id == attr and isinstance(node.value, ast.Constant):
                    return node.value.value, owner, node
        return None

    def impl_class(self, module: _Module, cls: ast.ClassDef) -> tuple[_Module, ast.ClassDef] | None:
        """The class the backend's ``get_impl_cls`` returns (its own or a base's)."""
        for owner, klass in self.lineage(module, cls):
            method = next((n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "get_impl_cls"), None)
            if method is not None:
                returned = [r.value.id for r in ast.walk(method) if isinstance(r, ast.Return) and isinstance(r.value, ast.Name)]
                return self.find_class(owner, returned[0]) if returned else None
        return None

    def layer_base(self) -> tuple[bool, str] | None:
        """Before implementations said their base (0.23.0, 0.24.0), vLLM's MLA layer passed one
        constant ``is_lse_base_on_e=`` to every DCP combine it calls (``MLA_LAYER``): that
        value and ``file:line (what)``, or None."""
        path = self.root / MLA_LAYER
        if not path.is_file():
            return None
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=MLA_LAYER)
        found = {
            (kw.value.value, node.lineno)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            for kw in node.keywords
            if kw.arg == "is_lse_base_on_e" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, bool)
        }
        values = {v for v, _ in found}
        if len(values) != 1:
            return None
        line = min(n for _, n in found)
        return values.pop(), f"{MLA_LAYER}:{line} (the MLA layer passes it to every DCP combine)"

    def bound_base(self, module: _Module, cls: ast.ClassDef):
        """A constant ``is_lse_base_on_e=...`` the class binds into a call (FlashInfer's
        ``partial(cp_lse_ag_out_rs, is_lse_base_on_e=False)``): ``(value, node)``."""
        for node in ast.walk(cls):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "is_lse_base_on_e" and isinstance(kw.value, ast.Constant):
                        return kw.value.value, node
        return None


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):  # MLACommonImpl[FlashMLAMetadata]
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@cache
def _reader(root: str) -> _Reader:
    return _Reader(Path(root))


def backend_names(root: str) -> list[str]:
    """The backends the tree's ``AttentionBackendEnum`` names."""
    return sorted(_reader(root).backend_paths())


def read_backend(root: str, name: str) -> AttentionBackend:
    """``name``'s implementation and the LSE base it returns, read from the tree at ``root``
    (``ConfigError`` naming the file for a backend the tree does not define, one that does
    not support DCP, or one whose LSE base cannot be found)."""
    reader = _reader(root)
    paths = reader.backend_paths()
    if name not in paths:
        raise ConfigError(f"--vllm-attention-backend {name}: not in {ENUM} ({REGISTRY}); valid: {', '.join(sorted(paths))}")
    module_name, _, class_name = paths[name].rpartition(".")
    backend = reader.find_class(reader.module(module_name), class_name)
    impl = backend and reader.impl_class(*backend)
    if not impl:
        raise ConfigError(f"--vllm-attention-backend {name}: {paths[name]}.get_impl_cls returns no implementation class")
    module, cls = impl
    qualname = f"{module.name}.{cls.name}"
    flag, dcp = next(((f, found) for f in DCP_FLAGS if (found := reader.attribute(module, cls, f)) is not None), (DCP_FLAGS[0], None))
    if not (dcp and dcp[0] is True):
        raise ConfigError(f"--vllm-attention-backend {name}: {qualname} does not support DCP ({flag} is not True)")
    bound = reader.bound_base(module, cls)
    if bound is not None:
        value, node = bound
        where = f"{module.rel}:{node.lineno} ({cls.name} binds is_lse_base_on_e into its DCP combine)"
    else:
        found = reader.attribute(module, cls, "lse_base_on_e")
        if found is not None and isinstance(found[0], bool):
            value, owner, node = found
            where = f"{owner.rel}:{node.lineno}"
        else:
            layer = reader.layer_base() if ".mla." in module.name else None
            if layer is None:
                raise ConfigError(f"--vllm-attention-backend {name}: no lse_base_on_e found along {qualname}'s bases")
            value, where = layer
    return AttentionBackend(name, paths[name], qualname, value, where, True)
