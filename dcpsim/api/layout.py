"""``dcpsim.layout``: which rank stores each position of one request, and its slots
(``dcpsim.views.layout_view``, as ``python -m dcpsim layout``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dcpsim.errors import ConfigError
from dcpsim.views.failure import load_failure_view
from dcpsim.views.layout_picture import draw
from dcpsim.views.layout_text import render
from dcpsim.views.layout_view import LayoutQuery, compute, public


@dataclass(frozen=True)
class Layout:
    data: dict = field(repr=False)
    failure: object = field(repr=False, default=None)
    """A ``views.failure.FailureView`` (``from_report``), else None."""

    def to_dict(self) -> dict:
        """``layout --json``'s document."""
        doc = public(self.data)
        if self.failure is not None:
            doc["failure"] = self.failure.summary(self.data)
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def text(self) -> str:
        lines = self.failure.lines(self.data) + [""] if self.failure is not None else []
        return "\n".join([*lines, render(self.data)])

    def draw(self, path: str | Path) -> Path:
        """Draw the view as a PNG or SVG picture (by the file's suffix; needs matplotlib)."""
        fmt = Path(path).suffix.lstrip(".").lower()
        if fmt not in ("png", "svg"):
            raise ConfigError(f"{path}: a layout picture is a .png or .svg file")
        v = self.failure
        draw(self.data, str(path), fmt, marks=v.marks(self.data) if v else (), notes=v.notes(self.data) if v else (),
             title=v.title() if v else None)  # fmt: skip
        return Path(path)


def layout(
    *, dcp: int | None = None, block_size: int | None = None, interleave: int = 1, kernel_block_size: int | None = None,
    tokens_per_state: int = 1, replicated: bool = False, block_table: list[int] | None = None, positions=None,
    around: int | None = None, window: int | None = None, from_report: str | Path | None = None,
) -> Layout:  # fmt: skip
    """One request's layout at ``dcp`` ranks, ``interleave`` and ``block_size`` (``positions``:
    a ``layout --positions`` spec or a list of positions), or the first failure of a
    ``run --json`` report file (``from_report``, around its first bad index)."""
    if from_report is not None:
        view = load_failure_view(str(from_report))
        try:
            return Layout(compute(view.query(around=around, window=window)), view)
        except ConfigError as exc:
            raise ConfigError(f"{from_report}: {exc}") from None
    if dcp is None or block_size is None:
        raise ConfigError("dcpsim.layout needs dcp and block_size (or from_report)")
    if not isinstance(positions, str | None):
        positions = ",".join(str(int(p)) for p in positions)
    query = LayoutQuery(
        dcp_size=dcp, interleave_size=interleave, block_size=block_size, kernel_block_size=kernel_block_size,
        tokens_per_state=tokens_per_state, replicated=replicated, block_table=block_table, positions=positions, around=around,
        window=window,
    )  # fmt: skip
    return Layout(compute(query))
