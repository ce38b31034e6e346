"""Counted nouns in messages: ``plural(1, "request")`` is ``1 request``, ``plural(3, "request")``
is ``3 requests``; irregular plurals are given (``plural(n, "entry", "entries")``)."""

from __future__ import annotations


def plural(count: int, singular: str, many: str | None = None) -> str:
    """``count`` and the noun, singular for exactly one, else ``many`` (default ``singular + "s"``)."""
    return f"{count} {singular if count == 1 else (many or singular + 's')}"
