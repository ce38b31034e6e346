"""The picture of a layout view: positions along x, one lane per DCP rank (matplotlib, Agg).

Draws the dict of ``dcpsim.views.layout_view.compute``; every owner, slot and kernel block
it shows is a number of that dict (from ``dcpsim.model.layout``), never recomputed here.
A cell is drawn in the lane of each rank that stores its position (a record's cell is as
wide as the ``R`` positions it folds), in the rank's colour, labelled with its slot where
labels fit. Each rank's page of a block-table entry is outlined in its lane, virtual-block
(or, replicated, block) boundaries are lines across the lanes, kernel blocks (``Bk < B``)
dashed outlines, null-block entries hatched.

SVG ids (``set_gid``), for tests and for anyone reading the SVG: ``lane-label-R``,
``lane-R``, ``cell-rR-pP`` (records: ``cell-rR-cC``), ``slot-rR-pP``, ``page-rR-eE``,
``kblock-rR-eE-kK``, ``vblock-boundary-X`` (replicated or W = 1: ``block-boundary-X``),
``entry-label-E``, ``around``, ``around-label``, ``title``, ``note-N``, and for marks their
own gid (``expected``; ``expected-rR`` on every lane of a replicated group) and
``tag-KIND-N``.

matplotlib is imported only inside ``draw``; a missing one is a ``ConfigError`` naming the
``views`` extra.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.layout import PAD
from dcpsim.views.marks import Mark

MAX_PICTURE_POSITIONS = 512
"""Widest window drawn, in positions; a wider view is refused with a way to narrow it."""
RANK_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd")
"""Lane colours by rank (cycled beyond 8 ranks); no red: red marks the actual slot."""
MARK_COLOURS = {"expected": "#000000", "actual": "#d62728", "holds": "#7f7f7f", "query": "#9467bd"}
INSET = {"expected": 0.03, "actual": 0.1, "query": 0.03}  # nested outlines when marks share a cell
LANE_BG, PAGE_EDGE, NULL_EDGE = "#f2f2f2", "#404040", "#bdbdbd"
DPI = 100
LANE_IN, CELL_IN, MIN_WIDTH_IN, MAX_WIDTH_IN = 0.5, 0.26, 8.0, 26.0  # inches
LEFT_IN, RIGHT_IN, TOP_IN, BOTTOM_IN, NOTE_IN, TAG_IN = 0.9, 0.3, 0.55, 0.55, 0.19, 0.125
LABEL_PT, NOTE_PT = 6.5, 7.0
INSTALL = "pip install 'dcpsim[views]'"


def rank_colour(r: int) -> str:
    return RANK_COLOURS[r % len(RANK_COLOURS)]


def x_range(d: dict) -> tuple[int, int]:
    """Positions drawn, ``[lo, hi)``: the view's positions and its cells (records reach back)."""
    return min(d["positions"][0], d["_x0"][0]), max(d["positions"][-1] + 1, d["_x0"][-1] + d["_width"])


def check_drawable(d: dict, flag: str) -> None:
    lo, hi = x_range(d)
    if hi - lo > MAX_PICTURE_POSITIONS:
        raise ConfigError(
            f"{flag}: {hi - lo} positions ({lo}..{hi - 1}) are too many for a readable picture "
            f"(at most {MAX_PICTURE_POSITIONS}); narrow the view with --positions a:b or "
            f"--around P --window N"
        )


def _import_matplotlib():
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as exc:
        raise ConfigError(f"pictures need matplotlib ({exc}); install the views extra: {INSTALL}") from None
    return matplotlib, Figure, FigureCanvasAgg, Rectangle


@dataclass(frozen=True)
class _Frame:
    """Where things go: the positions drawn and the sizes that decide labels."""

    lo: int
    hi: int
    fig_w: float
    ax_w: float
    cell_pt: float
    """Width of one cell (a position, or a record's R positions), in points."""

    @property
    def n(self) -> int:
        return self.hi - self.lo


def _frame(d: dict) -> _Frame:
    lo, hi = x_range(d)
    fig_w = min(max(LEFT_IN + RIGHT_IN + (hi - lo) * CELL_IN, MIN_WIDTH_IN), MAX_WIDTH_IN)
    ax_w = fig_w - LEFT_IN - RIGHT_IN
    return _Frame(lo, hi, fig_w, ax_w, ax_w * 72 / (hi - lo) * d["_width"])


def _fits(text: str, cell_pt: float) -> str | None:
    """How a slot label fits a cell: ``h`` (horizontal), ``v`` (rotated), or None."""
    length, lane_pt = 0.62 * LABEL_PT * len(text), LANE_IN * 72 * 0.76
    if length <= 0.92 * cell_pt:
        return "h"
    if 1.1 * LABEL_PT <= cell_pt and length <= 0.62 * lane_pt:
        return "v"
    return None


def _labelled_positions(d: dict) -> int:
    """About how many positions the widest picture holds with a slot label in every cell."""
    return int((MAX_WIDTH_IN - LEFT_IN - RIGHT_IN) * 72 / (LABEL_PT * 1.1) * d["_width"])


def _default_notes(d: dict, labelled: bool) -> list[str]:
    c = d["config"]
    W, R, B, Bk = c["decode_context_parallel_size"], c["tokens_per_state"], c["block_size"], c["kernel_block_size"]
    sharded = W > 1 and not c["replicated"]
    what = "record" if R > 1 else "position"
    if sharded:
        first = f"a cell = a {what} in the lane of the rank that stores it"
        span = f"{d['_span_states']} {what}s" + (f" = {d['_span']} positions" if R > 1 else "")
        second = f"thick lines: virtual blocks of B*W = {span} (one block-table entry); outlines: each rank's page of B = {B} slots"
    else:
        first = f"replicated: every rank stores every {what}" if c["replicated"] else f"W = 1: one rank stores every {what}"
        second = f"lines and outlines: blocks of B = {B} {what}s (one block-table entry each)"
    first += (
        "; its label is the slot on that rank"
        if labelled
        else f"; cells too narrow for slot numbers: draw at most ~{_labelled_positions(d)} positions "
        "(--around P --window N) to read every slot"
    )
    notes = [first, second]
    if Bk < B:
        notes.append(f"dashed: kernel blocks of Bk = {Bk} slots (ownership stays in B*W)")
    if R > 1:
        notes.append(
            f"compressed cache, tokens_per_state R = {R}: record c folds positions c*R..c*R+R-1 and "
            "is emitted at (c+1)*R-1" + ("; records are sharded by record index" if sharded else "")
        )
    if 0 in c["block_table"]:
        notes.append("hatched: the null block (block 0), an entry released or never allocated")
    return notes


def _tick_step(n: int) -> int:
    return next((s for s in (1, 2, 4, 8, 16, 32, 64) if n / s <= 24), 128)


def draw(d: dict, path: str, fmt: str, *, marks: Sequence[Mark] = (), notes: Sequence[str] = (), title: str | None = None) -> None:
    """Write the picture of view ``d`` to ``path`` (``fmt``: ``png`` or ``svg``)."""
    flag = f"--{fmt}"
    check_drawable(d, flag)
    matplotlib, Figure, FigureCanvasAgg, Rectangle = _import_matplotlib()
    W = d["config"]["decode_context_parallel_size"]
    fr = _frame(d)
    widest = max(s for row in d["slots"].values() for s in row)
    labelled = _fits(str(widest), fr.cell_pt) is not None  # every slot label, or none
    chars = int((fr.fig_w - LEFT_IN - 0.1) * 72 / (NOTE_PT * 0.56))
    texts = [(t, "#000000") for t in [*_default_notes(d, labelled), *notes]]
    texts += [(m.label, MARK_COLOURS.get(m.kind, "#000000")) for m in marks]
    lines = [(line, colour) for text, colour in texts for line in textwrap.wrap(text, chars, subsequent_indent="    ")]
    tag_rows = len({(m.tag, m.kind, m.x0, m.width) for m in marks})
    notes_in = BOTTOM_IN + NOTE_IN * len(lines)
    fig_h = TOP_IN + TAG_IN * tag_rows + W * LANE_IN + notes_in

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "dcpsim-layout", "font.size": 8}):
        fig = Figure(figsize=(fr.fig_w, fig_h), dpi=DPI)
        FigureCanvasAgg(fig)
        ax = fig.add_axes((LEFT_IN / fr.fig_w, notes_in / fig_h, fr.ax_w / fr.fig_w, W * LANE_IN / fig_h))
        _axes(ax, fr, W)
        _boundaries(ax, d, fr)
        if d["around"] is not None and not marks:  # a report's marks show its centre themselves
            _around(ax, Rectangle, d["around"], W)
        _cells(ax, Rectangle, d, fr, labelled)
        rows = _marks(ax, Rectangle, marks, W)
        _pages(ax, Rectangle, d, fr, rows)
        fig.text(0.5, 1 - 0.12 / fig_h, title or _title(d), ha="center", va="top", fontsize=9, gid="title")
        for k, (line, colour) in enumerate(lines):
            fig.text(
                LEFT_IN / fr.fig_w,
                (NOTE_IN * (len(lines) - k) - 0.05) / fig_h,
                line,
                ha="left",
                va="bottom",
                fontsize=NOTE_PT,
                color=colour,
                gid=f"note-{k}",
            )
        try:
            fig.savefig(path, format=fmt, dpi=DPI, metadata={"Date": None} if fmt == "svg" else None)
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot write the picture: {exc.strerror or exc}") from None


def _title(d: dict) -> str:
    c = d["config"]
    R = c["tokens_per_state"]
    return (
        f"DCP layout: W={c['decode_context_parallel_size']} I={c['cp_kv_cache_interleave_size']} "
        f"B={c['block_size']} Bk={c['kernel_block_size']}"
        + (f" R={R}" if R > 1 else "")
        + (" replicated" if c["replicated"] else "")
        + f", block table {c['block_table']}"
    )


def _axes(ax, fr: _Frame, W: int) -> None:
    """x in positions (a cell spans [p, p+1)), lane r spans [r, r+1), rank 0 on top."""
    ax.set_xlim(fr.lo, fr.hi)
    ax.set_ylim(W, 0)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    step = _tick_step(fr.n)
    ticks = [p for p in range(fr.lo, fr.hi) if p % step == 0 or (p == fr.lo and p % step <= step // 2)]
    ax.set_xticks([p + 0.5 for p in ticks], [str(p) for p in ticks], fontsize=7)
    ax.set_xlabel("position", fontsize=8)
    lane_of = ax.get_yaxis_transform()  # x in axes fraction, y in lanes
    for r in range(W):
        ax.text(
            -0.005,
            r + 0.5,
            f"rank {r}",
            transform=lane_of,
            ha="right",
            va="center",
            fontsize=8,
            color=rank_colour(r),
            fontweight="bold",
            gid=f"lane-label-{r}",
        )


def _entries(d: dict, fr: _Frame) -> range:
    span = d["_span"]
    return range(fr.lo // span, (fr.hi - 1) // span + 1)


def _boundaries(ax, d: dict, fr: _Frame) -> None:
    c, span, W = d["config"], d["_span"], d["config"]["decode_context_parallel_size"]
    name = "vblock-boundary" if W > 1 and not c["replicated"] else "block-boundary"
    edges = sorted({x for e in _entries(d, fr) for x in (e * span, (e + 1) * span) if fr.lo <= x <= fr.hi})
    for x in edges:
        ax.plot([x, x], [0, W], color="black", linewidth=1.6, zorder=3, solid_capstyle="butt", gid=f"{name}-{x}")


def _around(ax, Rectangle, P: int, W: int) -> None:
    ax.add_patch(Rectangle((P, 0), 1, W, facecolor="#ffd84d", edgecolor="#c9a000", linewidth=0.8, zorder=0.8, gid="around"))
    ax.annotate(
        f"P={P}",
        xy=(P + 0.5, 0),
        xytext=(0, 2),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=7,
        color="#8a6d00",
        fontweight="bold",
        gid="around-label",
        annotation_clip=False,
    )


def _cells(ax, Rectangle, d: dict, fr: _Frame, labelled: bool) -> None:
    """Each rank's stored cells, their slot labels, and (``Bk < B``) kernel-block outlines."""
    c, width, x0s, idx = d["config"], d["_width"], d["_x0"], d["_index"]
    kind = "c" if d["index_kind"] == "record" else "p"
    for r in range(c["decode_context_parallel_size"]):
        ax.add_patch(Rectangle((fr.lo, r + 0.08), fr.n, 0.84, facecolor=LANE_BG, edgecolor="none", zorder=0.5, gid=f"lane-{r}"))
        kblocks: dict[tuple[int, int], list[float]] = {}
        for i, s in enumerate(d["slots"][str(r)]):
            if s == PAD:
                continue
            x = x0s[i]
            ax.add_patch(
                Rectangle(
                    (x, r + 0.12),
                    width,
                    0.76,
                    facecolor=rank_colour(r),
                    edgecolor="white",
                    linewidth=0.4,
                    zorder=1,
                    gid=f"cell-r{r}-{kind}{idx[i]}",
                )
            )
            fit = _fits(str(s), fr.cell_pt)
            if labelled and fit:
                ax.text(
                    x + width / 2,
                    r + 0.5,
                    str(s),
                    ha="center",
                    va="center",
                    fontsize=LABEL_PT,
                    rotation=90 if fit == "v" else 0,
                    color="white",
                    zorder=4,
                    gid=f"slot-r{r}-{kind}{idx[i]}",
                )
            if c["kernel_block_size"] < c["block_size"]:
                box = kblocks.setdefault((d["_entry"][i], d["_kernel"][r][i]), [x, x + width])
                box[0], box[1] = min(box[0], x), max(box[1], x + width)
        for (e, k), (a, b) in kblocks.items():
            ax.add_patch(
                Rectangle(
                    (a, r + 0.1),
                    b - a,
                    0.8,
                    fill=False,
                    edgecolor="#202020",
                    linestyle="--",
                    linewidth=0.8,
                    zorder=2.6,
                    gid=f"kblock-r{r}-e{e}-k{k}",
                )
            )


def _pages(ax, Rectangle, d: dict, fr: _Frame, tag_rows: int) -> None:
    """Each rank's page of every block-table entry drawn, and the entry's block id above."""
    bt, span, W = d["config"]["block_table"], d["_span"], d["config"]["decode_context_parallel_size"]
    for e in _entries(d, fr):
        a, b = max(fr.lo, e * span), min(fr.hi, (e + 1) * span)
        null = bt[e] == 0
        ax.annotate(
            f"entry {e}: " + ("null block 0" if null else f"block {bt[e]}"),
            xy=((a + b) / 2, 0),
            xytext=(0, 3 + 9 * tag_rows),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
            gid=f"entry-label-{e}",
            annotation_clip=False,
        )
        for r in range(W):
            ax.add_patch(
                Rectangle(
                    (a, r + 0.06),
                    b - a,
                    0.88,
                    fill=False,
                    hatch="////" if null else None,
                    edgecolor=NULL_EDGE if null else PAGE_EDGE,
                    linewidth=0.8,
                    zorder=2.5,
                    gid=f"page-r{r}-e{e}",
                )
            )


def _marks(ax, Rectangle, marks: Sequence[Mark], W: int) -> int:
    """Outlines around the marked cells (``holds`` marks have none: they are the expected
    cell) and above the lanes one tag per (word, cell), naming its ranks. Returns the tag rows."""
    tags: dict[tuple[str, str, float, float], list[str]] = {}
    for m in marks:
        colour = MARK_COLOURS.get(m.kind, "#000000")
        lanes = range(W) if m.rank is None else (m.rank,)
        gid = m.gid or m.kind
        if m.kind != "holds":
            inset = INSET.get(m.kind, 0.03)
            for r in lanes:
                ax.add_patch(
                    Rectangle(
                        (m.x0, r + inset),
                        m.width,
                        1 - 2 * inset,
                        fill=False,
                        edgecolor=colour,
                        linewidth=2.2 if m.exact else 1.6,
                        linestyle="-" if m.exact else ":",
                        zorder=5,
                        gid=gid if m.rank is not None else f"{gid}-r{r}",
                    )
                )
        tags.setdefault((m.tag, m.kind, m.x0, m.width), []).append("all" if m.rank is None else f"r{m.rank}")
    for row, ((tag, kind, x0, width), ranks) in enumerate(tags.items()):
        text = tag if ranks == ["all"] else f"{tag} ({', '.join(ranks)})"
        ax.annotate(
            text,
            xy=(x0 + width / 2, 0),
            xytext=(0, 2 + 9 * row),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=6.5,
            color=MARK_COLOURS.get(kind, "#000000"),
            fontweight="bold",
            zorder=6,
            gid=f"tag-{kind}-{row}",
            annotation_clip=False,
        )
    return len(tags)
