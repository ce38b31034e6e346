"""``python -m dcpsim layout``: show which DCP rank stores each position, and its slots.

A read-only view of one request's KV layout. The numbers come only from
``dcpsim.model.layout`` (``validate_layout``, ``owner_rank``, ``slot_mapping``,
``local_seq_lens``); this module parses the flags, checks them against the
block table, and prints a grid, the local lengths and a per-position table
(or one JSON document with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.model.layout import PAD, local_seq_lens, owner_rank, slot_mapping, validate_layout
from dcpsim.plural import plural

GRID_WIDTH = 64  # positions per grid line
RULER_EVERY = 8  # ruler labels on multiples of 8 (and run starts), where they fit
MAX_POSITIONS = 1 << 20  # a view, not a bulk export

_RANGE = re.compile(r"^(\d+):(\d*)$")
_INT = re.compile(r"^\d+$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-context-parallel-size", "--dcp", dest="dcp_size", type=int,
                   required=True, metavar="W", help="number of DCP ranks (W)")
    p.add_argument("--cp-kv-cache-interleave-size", "--interleave", dest="interleave_size",
                   type=int, default=1, metavar="I",
                   help="consecutive positions stored on one rank before moving on (I, default 1)")
    p.add_argument("--block-size", dest="block_size", type=int, required=True, metavar="B",
                   help="KV-manager block size of the group (B)")
    p.add_argument("--kernel-block-size", dest="kernel_block_size", type=int, default=None,
                   metavar="Bk", help="attention-kernel block size, divides B (default B)")
    p.add_argument("--positions", default=None, metavar="SPEC",
                   help="a:b (half-open), a: (to the end of the block table), a comma list, "
                        "or a mix such as 0:8,40:48 (default: 2 virtual blocks, or what "
                        "--block-table covers)")
    p.add_argument("--block-table", dest="block_table", default=None, metavar="IDS",
                   help="comma list of KV block ids of the request; 0 is the reserved null "
                        "block (default: 1..n, enough for the positions)")
    p.add_argument("--dcp-replicated", dest="replicated", action="store_true",
                   help="replicated group: every rank stores every position")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")


# --- parsing ---------------------------------------------------------------------------


def parse_block_table(text: str) -> list[int]:
    ids: list[int] = []
    seen: set[int] = set()
    for tok in (t.strip() for t in text.split(",")):
        if not _INT.match(tok):
            raise ConfigError(f"--block-table: {tok!r} is not a block id (expected e.g. 5,6)")
        b = int(tok)
        if b == 0:
            raise ConfigError("--block-table: block 0 is the reserved null block; use ids >= 1")
        if b in seen:
            raise ConfigError(f"--block-table: block {b} is listed twice")
        seen.add(b)
        ids.append(b)
    return ids


def parse_positions(text: str, open_end: int, open_end_is: str) -> list[int]:
    """Sorted, de-duplicated positions; ``a:`` runs to ``open_end`` (``open_end_is`` says why)."""
    out: set[int] = set()
    for tok in (t.strip() for t in text.split(",")):
        m = _RANGE.match(tok)
        if m:
            lo, hi = int(m[1]), int(m[2]) if m[2] else open_end
            if lo >= hi:
                why = "" if m[2] else f": an open range ends at {open_end}, {open_end_is}"
                raise ConfigError(f"--positions: range {tok!r} is empty ({lo} >= {hi}{why})")
            if hi - lo + len(out) > MAX_POSITIONS:
                raise ConfigError(f"--positions: {tok!r} makes more than {MAX_POSITIONS} positions")
            out.update(range(lo, hi))
        elif _INT.match(tok):
            out.add(int(tok))
        else:
            raise ConfigError(
                f"--positions: cannot parse {tok!r} (expected a:b, a:, a comma list, "
                "or a mix such as 0:8,40:48; positions are >= 0)"
            )
    return sorted(out)


# --- computation -----------------------------------------------------------------------


def compute(args: argparse.Namespace) -> dict:
    W, I, B = args.dcp_size, args.interleave_size, args.block_size
    Bk = args.kernel_block_size if args.kernel_block_size is not None else B
    validate_layout(block_size=B, dcp_size=W, interleave_size=I, kernel_block_size=Bk,
                    replicated=args.replicated)
    sharded = W > 1 and not args.replicated
    span = B * W if sharded else B  # positions covered by one block-table entry
    bt = parse_block_table(args.block_table) if args.block_table is not None else None
    if bt is not None:
        covered, why = len(bt) * span, "the end of --block-table"
    else:
        covered, why = 2 * span, "the end of the default 2-entry block table"
    positions = parse_positions(
        "0:" if args.positions is None else args.positions, covered, why)
    last = positions[-1]
    if bt is None:
        bt = list(range(1, last // span + 2))
    elif last >= len(bt) * span:
        raise ConfigError(
            f"position {last} needs block-table entry {last // span}, but --block-table has "
            f"{len(bt)} {'entry' if len(bt) == 1 else 'entries'} (each covers {plural(span, 'position')}, "
            f"so positions < {len(bt) * span})"
        )

    pos = np.asarray(positions, dtype=np.int64)
    slots = np.stack([
        slot_mapping(pos, bt, block_size=B, dcp_size=W, dcp_rank=r, interleave_size=I,
                     kernel_block_size=Bk, replicated=args.replicated)
        for r in range(W)
    ])
    L = last + 1
    if sharded:
        owner = owner_rank(pos, dcp_size=W, interleave_size=I)
        # index in the owner's local sequence = positions before p that the owner stores
        local_index = local_seq_lens(pos, dcp_size=W, interleave_size=I)[np.arange(pos.size), owner]
        lens = local_seq_lens([L], dcp_size=W, interleave_size=I)[0]
    else:
        owner, local_index, lens = None, pos, np.full(W, L, dtype=np.int64)
    return {
        "config": {
            "decode_context_parallel_size": W, "cp_kv_cache_interleave_size": I,
            "block_size": B, "kernel_block_size": Bk, "replicated": bool(args.replicated),
            "block_table": bt,
        },
        "positions": positions,
        "owner": owner.tolist() if owner is not None else "all",
        "local_index": local_index.tolist(),
        "local_seq_lens": lens.tolist(),
        "owned_counts": (slots != PAD).sum(axis=1).tolist(),
        "slots": {str(r): slots[r].tolist() for r in range(W)},
        "_span": span,
        "_prefix": positions == list(range(L)),
    }


# --- human output ----------------------------------------------------------------------


def _grid_lines(pos: list[int]) -> list[list[int | None]]:
    """Column layout of the grid: indices into ``pos``, ``None`` for a gap between runs."""
    lines: list[list[int | None]] = [[]]
    for i, p in enumerate(pos):
        cur = lines[-1]
        gap = bool(cur) and p != pos[i - 1] + 1
        if len(cur) + gap >= GRID_WIDTH:
            cur = []
            lines.append(cur)
        elif gap:
            cur.append(None)  # positions jump: leave a blank column
        cur.append(i)
    return lines


def _ruler(cols: list[int | None], pos: list[int], indent: int) -> str:
    """Label run starts and multiples of 8, wherever a label fits."""
    line = ""
    for c, i in enumerate(cols):
        if i is None:
            continue
        p = pos[i]
        run_start = c == 0 or cols[c - 1] is None
        if (run_start or p % RULER_EVERY == 0) and (not line or len(line) < c):
            line = line.ljust(c) + str(p)
    return " " * indent + line


def render(d: dict) -> str:
    c, pos, W = d["config"], d["positions"], d["config"]["decode_context_parallel_size"]
    slots = d["slots"]
    out = [
        f"DCP layout: W={W} I={c['cp_kv_cache_interleave_size']} B={c['block_size']} "
        f"Bk={c['kernel_block_size']} replicated={'yes' if c['replicated'] else 'no'} "
        f"block_table={c['block_table']}",
        f"one block-table entry covers {plural(d['_span'], 'position')}"
        + ("" if c["replicated"] or W == 1 else f" ({plural(c['block_size'], 'slot')} on each rank)"),
    ]
    if c["replicated"]:
        out.append("replicated group: every rank stores every position (plain slot mapping)")
    contiguous = pos == list(range(pos[0], pos[-1] + 1))
    which = f"{pos[0]}..{pos[-1]}" if contiguous else "listed"
    out += ["", f"ownership of {which} positions ({len(pos)}; # = stored on the rank, . = not)"]
    label_w = len(f"rank {W - 1}") + 2
    for cols in _grid_lines(pos):
        out.append(_ruler(cols, pos, label_w))
        for r in range(W):
            row = slots[str(r)]
            marks = "".join(" " if i is None else "." if row[i] == PAD else "#" for i in cols)
            out.append(f"rank {r}".ljust(label_w) + marks)

    def per_rank(values):
        return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))

    out.append("")
    if d["_prefix"]:
        out.append(f"local_seq_lens (L={pos[-1] + 1}): {per_rank(d['local_seq_lens'])}")
    else:
        out.append(f"owned among the {len(pos)} given positions: {per_rank(d['owned_counts'])}")

    owner = d["owner"]
    cells = [[str(p), "all" if owner == "all" else str(owner[i]), str(d["local_index"][i])]
             + ["-" if slots[str(r)][i] == PAD else str(slots[str(r)][i]) for r in range(W)]
             for i, p in enumerate(pos)]
    head = ["position", "owner", "local"] + [f"rank {r}" for r in range(W)]
    widths = [max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(head)]

    def fmt(row):
        return "  ".join(v.rjust(w) for v, w in zip(row, widths))

    out += ["", "slots (local = index in the owner's local sequence; - = PAD, not stored)",
            fmt(head)] + [fmt(row) for row in cells]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    d = compute(args)
    text = json.dumps({k: v for k, v in d.items() if not k.startswith("_")}) if args.json \
        else render(d)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. `| head`: the reader is gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
