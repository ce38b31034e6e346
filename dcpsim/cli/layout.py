"""``python -m dcpsim layout``: show which DCP rank stores each position, and its slots.

A read-only view of one request's KV layout: a grid, the local lengths and a per-position
table (or one JSON document with ``--json``), and with ``--png``/``--svg`` a picture.
``--from-report`` shows the first failure of a ``run --json`` report. The numbers come
only from ``dcpsim.model.layout`` (``dcpsim.views.layout_view``); this module parses the
flags and picks the outputs. matplotlib is imported only to draw.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dcpsim.errors import ConfigError
from dcpsim.views.failure import load_failure_view
from dcpsim.views.layout_picture import draw
from dcpsim.views.layout_text import header, render
from dcpsim.views.layout_view import LayoutQuery, compute, parse_block_table, public
from dcpsim.views.pcp_chunks import pcp_chunk_view, pcp_lines

# flags that --from-report takes from the report instead (dest, flag)
_FROM_REPORT = (
    ("dcp_size", "--decode-context-parallel-size"),
    ("interleave_size", "--cp-kv-cache-interleave-size"),
    ("block_size", "--block-size"),
    ("kernel_block_size", "--kernel-block-size"),
    ("tokens_per_state", "--tokens-per-state"),
    ("positions", "--positions"),
    ("block_table", "--block-table"),
    ("replicated", "--dcp-replicated"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--decode-context-parallel-size",
        "--dcp",
        dest="dcp_size",
        type=int,
        default=None,
        metavar="W",
        help="number of DCP ranks (W; required unless --from-report)",
    )
    p.add_argument(
        "--cp-kv-cache-interleave-size",
        "--interleave",
        dest="interleave_size",
        type=int,
        default=None,
        metavar="I",
        help="consecutive positions (records) stored on one rank before moving on (I, default 1)",
    )
    p.add_argument(
        "--block-size",
        dest="block_size",
        type=int,
        default=None,
        metavar="B",
        help="states per page of the group: B tokens, or B records (B*R tokens) with "
        "--tokens-per-state R, as in run --block-size (required unless --from-report)",
    )
    p.add_argument(
        "--kernel-block-size",
        dest="kernel_block_size",
        type=int,
        default=None,
        metavar="Bk",
        help="attention-kernel block size in states, divides B (default B)",
    )
    p.add_argument(
        "--tokens-per-state",
        dest="tokens_per_state",
        type=int,
        default=None,
        metavar="R",
        help="a compressed cache: one record per R tokens, record c emitted at position (c+1)*R-1 and sharded by record index (default 1)",
    )
    p.add_argument(
        "--positions",
        default=None,
        metavar="SPEC",
        help="a:b (half-open), a: (to the end of the block table), a comma list, "
        "or a mix such as 0:8,40:48 (default: 2 virtual blocks, or what "
        "--block-table covers)",
    )
    p.add_argument("--around", type=int, default=None, metavar="P", help="show a window of positions centred on P instead of --positions")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help="with --around (or --from-report): positions in the window (default: "
        "4 rounds of W*I*R positions, at least 32 and at most 256)",
    )
    p.add_argument(
        "--block-table",
        dest="block_table",
        default=None,
        metavar="IDS",
        help="comma list of KV block ids of the request; 0 is the reserved null block (default: 1..n, enough for the positions)",
    )
    p.add_argument(
        "--dcp-replicated", dest="replicated", action="store_true", default=None, help="replicated group: every rank stores every position"
    )
    p.add_argument(
        "--from-report",
        dest="from_report",
        default=None,
        metavar="REPORT.json",
        help="show the first failure of a run/worker --json report (its group, around its "
        "first bad index, with the expected and the actual owner and slot)",
    )
    p.add_argument(
        "--pcp",
        "--prefill-context-parallel-size",
        dest="pcp",
        type=int,
        default=None,
        metavar="P",
        help="also show which PCP rank computes each position of a prefill row (chunks r and 2P-1-r), before the KV all-gather",
    )
    p.add_argument(
        "--prefill-start",
        dest="prefill_start",
        type=int,
        default=0,
        metavar="S",
        help="with --pcp: the prefill row starts at position S (earlier ones computed before; "
        "default 0) and ends at the last position shown",
    )
    p.add_argument("--png", default=None, metavar="FILE", help="also draw the view as a PNG picture")
    p.add_argument("--svg", default=None, metavar="FILE", help="also draw the view as an SVG picture")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")


def _query(args: argparse.Namespace) -> LayoutQuery:
    for dest, flag in (("dcp_size", "--decode-context-parallel-size/--dcp W"), ("block_size", "--block-size B")):
        if getattr(args, dest) is None:
            raise ConfigError(f"{flag} is required (or --from-report REPORT.json)")
    if args.around is not None and args.positions is not None:
        raise ConfigError("--around P and --positions SPEC both choose the positions; give one of them")
    if args.window is not None and args.around is None:
        raise ConfigError("--window N sizes the window of --around P (or --from-report); give --around P too")
    return LayoutQuery(
        dcp_size=args.dcp_size,
        interleave_size=1 if args.interleave_size is None else args.interleave_size,
        block_size=args.block_size,
        kernel_block_size=args.kernel_block_size,
        tokens_per_state=1 if args.tokens_per_state is None else args.tokens_per_state,
        replicated=bool(args.replicated),
        block_table=parse_block_table(args.block_table) if args.block_table is not None else None,
        positions=args.positions,
        around=args.around,
        window=args.window,
    )


def _from_report(args: argparse.Namespace):
    given = [flag for dest, flag in _FROM_REPORT if getattr(args, dest) is not None]
    if given:
        raise ConfigError(f"--from-report takes the layout from the report; drop {', '.join(given)}")
    view = load_failure_view(args.from_report)
    q = view.query(around=args.around, window=args.window)
    try:
        d = compute(q)
    except ConfigError as exc:
        raise ConfigError(f"{args.from_report}: {exc}") from None
    return view, d


def _draw(d: dict, args: argparse.Namespace, view) -> list[str]:
    outputs = [(path, fmt) for path, fmt in ((args.png, "png"), (args.svg, "svg")) if path]
    if not outputs:
        return []
    for path, fmt in outputs:
        draw(d, path, fmt, marks=view.marks(d) if view else (), notes=view.notes(d) if view else (), title=view.title() if view else None)
    return [path for path, _ in outputs]


def run(args: argparse.Namespace) -> int:
    if args.from_report is not None:
        view, d = _from_report(args)
    else:
        view, d = None, compute(_query(args))
    pictures = _draw(d, args, view)
    pcp = None
    if args.pcp is not None:
        pcp = pcp_chunk_view(d["positions"], args.pcp, d["config"]["decode_context_parallel_size"], args.prefill_start, None)
    if args.json:
        doc = public(d)
        if pcp is not None:
            doc["pcp"] = pcp
        if view is not None:
            doc["failure"] = view.summary(d)
        if pictures:
            doc["pictures"] = pictures
        text = json.dumps(doc)
    else:
        lines = view.lines(d) + [""] if view is not None else []
        if pictures:
            lines += header(d) + [f"wrote {path}" for path in pictures]
        else:
            lines.append(render(d))
        if pcp is not None:
            lines += pcp_lines(pcp, d["positions"])
        text = "\n".join(lines)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. `| head`: the reader is gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
