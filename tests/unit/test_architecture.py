"""The packages keep their layers: the checker never imports the engine, and no package
imports one above it.

``import_closure`` follows every ``import`` statement (top level or inside a function) of
a module through the package's own modules; the rules below hold for the closure, so a
checker module cannot reach the engine through a third module either.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "dcpsim"


def module_imports(path: Path, module: str) -> frozenset[str]:
    """Every dcpsim module ``path`` (the module ``module``) imports, by dotted name."""
    return _imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")


@functools.cache
def _imports_of(text: str, module: str, is_package: bool) -> frozenset[str]:
    """The imports of one module's text, parsed once: every closure of every rule walks
    the same files."""
    tree = ast.parse(text)
    package = module if is_package else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # "from pkg import module"
    return frozenset(m for m in out if m == "dcpsim" or m.startswith("dcpsim."))


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_closure(start: str, tree: dict[str, Path]) -> dict[str, str]:
    """Every package module reachable from ``start``, each with the module importing it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        name = todo.pop()
        for imp in module_imports(tree[name], name):
            # "from dcpsim.x import y": y may be a module or a name inside dcpsim.x
            target = imp if imp in tree else imp.rsplit(".", 1)[0]
            if target in tree and target not in seen:
                seen[target] = name
                todo.append(target)
    return seen


def forbidden_imports(tree: dict[str, Path], side: str, forbidden: tuple[str, ...]) -> list[str]:
    """``a -> ... -> b`` chains by which a module of ``side`` reaches a forbidden module."""
    problems = []
    for name in sorted(m for m in tree if m == side or m.startswith(side + ".")):
        closure = import_closure(name, tree)
        for reached in sorted(closure):
            if reached.startswith(forbidden):
                chain = [reached]
                while closure[chain[-1]]:
                    chain.append(closure[chain[-1]])
                problems.append(" -> ".join(reversed(chain)))
    return problems


TREE = modules(PACKAGE_ROOT)

LAYERS = (
    # neutral ground: errors, words, the cache folder, report files, the Collectives interface,
    # option trees
    ("dcpsim.errors", "dcpsim.plural", "dcpsim.cache", "dcpsim.report_file", "dcpsim.collectives", "dcpsim.options"),
    # the pure model both sides share (specs, layout math, the scenario, plan records)
    ("dcpsim.model",),
    # scenario files: reading, writing, the built-ins
    ("dcpsim.scenarios",),
    # the two sides and the read-only analyses: none of them consults another
    ("dcpsim.engine", "dcpsim.verify", "dcpsim.views"),
    # jobs, a rank's run, worlds of gloo ranks or threads: the only place that touches the process group
    ("dcpsim.harness",),
    # campaigns of runs: selftest, matrix, fuzz, shards
    ("dcpsim.campaigns",),
    # the command line and the Python API (dcpsim.run, ...): neither calls the other
    ("dcpsim.cli", "dcpsim.api"),
    # the command line's entry point; the pytest plugin (over the API)
    ("dcpsim.__main__", "dcpsim.pytest_plugin"),
)
"""Bottom to top. A package never imports a package of a higher layer, nor a sibling of
its own layer, not even inside a function."""


def rules() -> dict[str, tuple[str, ...]]:
    """Package -> the packages it must not reach, from ``LAYERS``."""
    out = {}
    for k, layer in enumerate(LAYERS):
        above = tuple(p for higher in LAYERS[k + 1 :] for p in higher)
        for package in layer:
            siblings = tuple(p for p in layer if p != package and k > 0)
            out[package] = above + siblings
    return out


RULES = rules()


def test_every_module_has_a_layer():
    placed = [p for layer in LAYERS for p in layer]
    loose = [m for m in TREE if m != "dcpsim" and not any(m == p or m.startswith(p + ".") for p in placed)]
    assert not loose, f"modules outside every layer of LAYERS: {loose}"


def test_the_rules_name_the_two_sides_apart():
    """The checker never imports the engine, nor the engine the checker; the harness
    never imports the campaigns (faults are engine variants)."""
    assert "dcpsim.engine" in RULES["dcpsim.verify"] and "dcpsim.verify" in RULES["dcpsim.engine"]
    assert "dcpsim.campaigns" in RULES["dcpsim.harness"] and "dcpsim.cli" in RULES["dcpsim.campaigns"]
    assert "dcpsim.harness" in RULES["dcpsim.engine"] and "dcpsim.harness" in RULES["dcpsim.verify"]


@pytest.mark.parametrize("side", sorted(p for p, forbidden in RULES.items() if forbidden))
def test_import_rule(side):
    assert TREE, "no modules found"
    assert any(m == side or m.startswith(side + ".") for m in TREE), f"no package {side}"
    problems = forbidden_imports(TREE, side, RULES[side])
    assert not problems, f"{side} must not import {RULES[side]}:\n" + "\n".join(problems)


def test_the_checker_layout_math_is_its_own():
    """The checker reads no fast layout math (it has its own naive geometry), nor the
    engine's context gather (its plan and its kept slots: ``verify.context_gather`` derives
    and keeps its own)."""
    for name, path in TREE.items():
        if name.startswith("dcpsim.verify"):
            imported = module_imports(path, name)
            assert "dcpsim.model.layout" not in imported, name
            assert "dcpsim.model.context_gather" not in imported, name


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_the_rule_catches_a_bad_import_even_through_another_module(tmp_path):
    root = tmp_path / "dcpsim"
    _write(root, "__init__.py", "")
    _write(root, "engine/__init__.py", "")
    _write(root, "engine/reference.py", "X = 1\n")
    _write(root, "verify/__init__.py", "")
    _write(root, "verify/clean.py", "from dcpsim.verify import helper\n")
    _write(root, "verify/helper.py", "def f():\n    from ..engine.reference import X\n    return X\n")
    _write(root, "verify/direct.py", "import dcpsim.engine.reference\n")
    tree = modules(root)
    problems = forbidden_imports(tree, "dcpsim.verify", ("dcpsim.engine",))
    assert "dcpsim.verify.direct -> dcpsim.engine.reference" in problems
    assert "dcpsim.verify.clean -> dcpsim.verify.helper -> dcpsim.engine.reference" in problems
    _write(root, "verify/helper.py", "def f():\n    return 1\n")
    _write(root, "verify/direct.py", "import numpy\n")
    assert forbidden_imports(modules(root), "dcpsim.verify", ("dcpsim.engine",)) == []
