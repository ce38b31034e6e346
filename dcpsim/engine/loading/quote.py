"""Quoting an engine's own rule from its source tree: ``file:line: the line``, found by a marker
the line holds (not by a line number, which moves from release to release)."""

from __future__ import annotations


def quote(tree, rule: tuple[str, str]) -> str:
    """``file:line: the line`` of the first line of ``rule[0]`` (in ``tree``) holding ``rule[1]``."""
    rel, marker = rule
    path = tree.root / rel
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return f"{rel} (not in this tree)"
    for n, line in enumerate(lines, 1):
        if marker in line:
            return f"{rel}:{n}: {line.strip()}"
    return f"{rel} (no line holds {marker!r} in this version)"
