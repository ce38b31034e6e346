"""Integer arithmetic the layout formulas share (``docs/dcp-semantics.md``, notation)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers: ``cdiv(7, 2) == 4``, ``cdiv(8, 2) == 4``."""
    return -(-a // b)
