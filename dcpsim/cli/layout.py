"""``python -m dcpsim layout``: show which DCP rank stores each position, and its slots.

A read-only view of one request's KV layout: a grid, the local lengths and a per-position
table (or one JSON document with ``--json``), and with ``--png``/``--svg`` a picture
(``dcpsim.views.layout_picture``). The numbers come only from ``dcpsim.model.layout``
(``dcpsim.views.layout_view``); this module parses the flags and picks the outputs.
matplotlib is imported only to draw.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dcpsim.errors import ConfigError
from dcpsim.views.layout_text import header, render
from dcpsim.views.layout_view import LayoutQuery, compute, parse_block_table, public


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-context-parallel-size", "--dcp", dest="dcp_size", type=int,
                   default=None, metavar="W", help="number of DCP ranks (W)")
    p.add_argument("--cp-kv-cache-interleave-size", "--interleave", dest="interleave_size",
                   type=int, default=None, metavar="I",
                   help="consecutive positions (records) stored on one rank before moving on (I, default 1)")
    p.add_argument("--block-size", dest="block_size", type=int, default=None, metavar="B",
                   help="states per page of the group: B tokens, or B records (B*R tokens) with "
                        "--tokens-per-state R, as in run --block-size")
    p.add_argument("--kernel-block-size", dest="kernel_block_size", type=int, default=None,
                   metavar="Bk", help="attention-kernel block size in states, divides B (default B)")
    p.add_argument("--tokens-per-state", dest="tokens_per_state", type=int, default=None, metavar="R",
                   help="a compressed cache: one record per R tokens, record c emitted at position "
                        "(c+1)*R-1 and sharded by record index (default 1)")
    p.add_argument("--positions", default=None, metavar="SPEC",
                   help="a:b (half-open), a: (to the end of the block table), a comma list, "
                        "or a mix such as 0:8,40:48 (default: 2 virtual blocks, or what "
                        "--block-table covers)")
    p.add_argument("--around", type=int, default=None, metavar="P",
                   help="show a window of positions centred on P instead of --positions")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help="with --around: positions in the window (default: "
                        "4 rounds of W*I*R positions, at least 32 and at most 256)")
    p.add_argument("--block-table", dest="block_table", default=None, metavar="IDS",
                   help="comma list of KV block ids of the request; 0 is the reserved null "
                        "block (default: 1..n, enough for the positions)")
    p.add_argument("--dcp-replicated", dest="replicated", action="store_true", default=None,
                   help="replicated group: every rank stores every position")
    p.add_argument("--png", default=None, metavar="FILE", help="also draw the view as a PNG picture")
    p.add_argument("--svg", default=None, metavar="FILE", help="also draw the view as an SVG picture")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")


def _query(args: argparse.Namespace) -> LayoutQuery:
    for dest, flag in (("dcp_size", "--decode-context-parallel-size/--dcp W"), ("block_size", "--block-size B")):
        if getattr(args, dest) is None:
            raise ConfigError(f"{flag} is required")
    if args.around is not None and args.positions is not None:
        raise ConfigError("--around P and --positions SPEC both choose the positions; give one of them")
    if args.window is not None and args.around is None:
        raise ConfigError("--window N sizes the window of --around P; give --around P too")
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


def _draw(d: dict, args: argparse.Namespace) -> list[str]:
    outputs = [(path, fmt) for path, fmt in ((args.png, "png"), (args.svg, "svg")) if path]
    if not outputs:
        return []
    from dcpsim.views.layout_picture import draw

    for path, fmt in outputs:
        draw(d, path, fmt)
    return [path for path, _ in outputs]


def run(args: argparse.Namespace) -> int:
    d = compute(_query(args))
    pictures = _draw(d, args)
    if args.json:
        doc = public(d)
        if pictures:
            doc["pictures"] = pictures
        text = json.dumps(doc)
    elif pictures:
        text = "\n".join(header(d) + [f"wrote {path}" for path in pictures])
    else:
        text = render(d)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. `| head`: the reader is gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
