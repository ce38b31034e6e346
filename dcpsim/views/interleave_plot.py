"""``interleave --png``: the decode-step load imbalance per interleave size, as bars.

One panel per sharded group; for each interleave size a bar of the mean and one of the
max (over decode steps) of the max - min local length across ranks. matplotlib is
imported here, when a plot is asked for (the ``views`` extra); without it the command
ends with exit 2 naming the extra.
"""

from __future__ import annotations

from dcpsim.errors import ConfigError

MEAN_COLOUR = "#1f77b4"
MAX_COLOUR = "#ff7f0e"
PANEL_INCHES = (8.0, 2.6)
DPI = 100


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install 'dcpsim[views]'") from None
    return Figure, FigureCanvasAgg


def imbalance_figure(doc: dict):
    """The figure of an ``interleave`` JSON document (``rows`` with ``groups``)."""
    Figure, FigureCanvasAgg = _matplotlib()
    rows = doc["rows"]
    names = doc["groups"]
    fig = Figure(figsize=(PANEL_INCHES[0], PANEL_INCHES[1] * max(1, len(names))), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(names)), 1, squeeze=False)[:, 0]
    labels = [row["label"] + ("" if row["valid"] else "\n(invalid)") for row in rows]
    x = list(range(len(rows)))
    for ax, name in zip(axes, names):
        means = [row["groups"][name]["imbalance_mean"] if row["valid"] else 0 for row in rows]
        maxes = [row["groups"][name]["imbalance_max"] if row["valid"] else 0 for row in rows]
        style = dict(width=0.38, linewidth=0, antialiased=False)
        ax.bar([i - 0.2 for i in x], means, color=MEAN_COLOUR, label="mean over decode steps", **style)
        ax.bar([i + 0.2 for i in x], maxes, color=MAX_COLOUR, label="max over decode steps", **style)
        ax.set_xticks(x, labels)
        ax.set_ylabel(doc["units"][name])
        ax.set_title(f"{name}: max - min local length across ranks (W={doc['decode_context_parallel_size']})", fontsize=9)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a bar
    fig.tight_layout()
    return fig


def save_imbalance_png(doc: dict, path: str) -> None:
    fig = imbalance_figure(doc)
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise ConfigError(f"--png {path}: cannot write: {exc}") from None
