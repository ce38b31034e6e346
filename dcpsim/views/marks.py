"""What a picture highlights on top of the layout: an outlined cell in one lane (or in all)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mark:
    kind: str
    """``expected`` (where the entry belongs), ``actual`` (where it went), ``holds`` (what the
    expected slot holds instead) or ``query`` (an attention query position); sets the style."""
    rank: int | None
    """The lane; None: every lane (a replicated group)."""
    x0: float
    """The cell's first position, and its width in positions (``R`` for a record)."""
    width: float
    tag: str
    """A word drawn at the mark (``expected``, ``actual``, ``holds 3``)."""
    label: str
    """The sentence for the legend, with the report's numbers."""
    exact: bool = True
    """False: the slot is not in the drawn window or block table; the mark stands at the
    index in that rank's lane and the label says where the slot is."""
    gid: str = ""
