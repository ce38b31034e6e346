"""``dcpsim.plural``: one noun for one, the plural otherwise, in every counted message."""

from __future__ import annotations

from dcpsim.plural import plural


def test_plural_is_singular_only_for_one():
    assert plural(1, "request") == "1 request"
    assert [plural(n, "preemption") for n in (0, 2)] == ["0 preemptions", "2 preemptions"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"
