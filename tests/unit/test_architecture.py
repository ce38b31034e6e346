"""The two sides of the harness stay apart: the checker never imports the engine.

``import_closure`` follows every ``import`` statement (top level or inside a function) of
a module through the package's own modules; the rules below hold for the closure, so a
checker module cannot reach the engine through a third module either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "dcpsim"


def module_imports(path: Path, module: str) -> set[str]:
    """Every dcpsim module ``path`` (the module ``module``) imports, by dotted name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
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
    return {m for m in out if m == "dcpsim" or m.startswith("dcpsim.")}


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

RULES = {
    # the checker derives its expectation from the scenario alone
    "dcpsim.verify": ("dcpsim.engine", "dcpsim.campaigns", "dcpsim.cli"),
    # the pure model is shared by both sides and imports neither
    "dcpsim.model": ("dcpsim.engine", "dcpsim.verify", "dcpsim.harness", "dcpsim.campaigns", "dcpsim.cli"),
    "dcpsim.scenarios": ("dcpsim.engine", "dcpsim.verify", "dcpsim.harness", "dcpsim.campaigns", "dcpsim.cli"),
    # the engine under test never consults the checker
    "dcpsim.engine": ("dcpsim.verify", "dcpsim.campaigns", "dcpsim.cli"),
    # views of a layout (text, pictures, a failure report) read the pure model only
    "dcpsim.views": ("dcpsim.engine", "dcpsim.verify", "dcpsim.harness", "dcpsim.campaigns", "dcpsim.cli",
                     "dcpsim.scenarios"),
}


@pytest.mark.parametrize("side", sorted(RULES))
def test_import_rule(side):
    assert TREE, "no modules found"
    assert any(m.startswith(side) for m in TREE), f"no package {side}"
    problems = forbidden_imports(TREE, side, RULES[side])
    assert not problems, f"{side} must not import {RULES[side]}:\n" + "\n".join(problems)


def test_the_checker_layout_math_is_its_own():
    """The checker reads no fast layout math (it has its own naive geometry)."""
    for name, path in TREE.items():
        if name.startswith("dcpsim.verify"):
            assert "dcpsim.model.layout" not in module_imports(path, name), name


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
    problems = forbidden_imports(tree, "dcpsim.verify", RULES["dcpsim.verify"])
    assert "dcpsim.verify.direct -> dcpsim.engine.reference" in problems
    assert "dcpsim.verify.clean -> dcpsim.verify.helper -> dcpsim.engine.reference" in problems
    _write(root, "verify/helper.py", "def f():\n    return 1\n")
    _write(root, "verify/direct.py", "import numpy\n")
    assert forbidden_imports(modules(root), "dcpsim.verify", RULES["dcpsim.verify"]) == []
