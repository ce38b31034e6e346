"""What a layout view shows: which rank stores each position (or record), and its slots.

``compute(query)`` returns one dict, the JSON document of ``dcpsim layout --json`` (keys
starting with ``_`` are for the text and picture views only). Every owner, slot and
local length comes from ``dcpsim.model.layout`` (``validate_layout``, ``owner_rank``,
``slot_mapping``, ``record_slot_mapping``, ``records_emitted``, ``record_emit_positions``,
``local_seq_lens``); the views only read this dict.

Sizes follow ``dcpsim run``: ``B`` and ``Bk`` count states per page and per kernel block,
so with ``tokens_per_state = R > 1`` (a compressed cache: one record per ``R`` tokens,
record ``c`` emitted at position ``(c+1)*R - 1``, sharded by record index) a page covers
``B*R`` tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.model.layout import (
    PAD,
    local_seq_lens,
    owner_rank,
    record_emit_positions,
    record_slot_mapping,
    records_emitted,
    slot_mapping,
    validate_layout,
)
from dcpsim.model.validate import check_int

MAX_POSITIONS = 1 << 20  # a view, not a bulk export
AROUND_MIN, AROUND_MAX = 32, 256  # default --window: 4 rounds of W*I (records: *R), within these

_RANGE = re.compile(r"^(\d+):(\d*)$")
_INT = re.compile(r"^\d+$")


@dataclass(frozen=True)
class LayoutQuery:
    """One view: the group's layout and the positions to show."""

    dcp_size: int
    interleave_size: int
    block_size: int
    kernel_block_size: int | None = None
    tokens_per_state: int = 1
    replicated: bool = False
    block_table: list[int] | None = None
    """KV block ids of the request (0 = the null block); None: 1..n, enough for the view."""
    positions: str | None = None
    """``--positions`` text; None: what the block table covers (or 2 entries)."""
    around: int | None = None
    """Centre the view on this position (a window of ``window`` positions)."""
    window: int | None = None
    table_source: str = "--block-table"
    """Where ``block_table`` came from, for messages."""


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
                f"--positions: cannot parse {tok!r} (expected a:b, a:, a comma list, or a mix such as 0:8,40:48; positions are >= 0)"
            )
    return sorted(out)


def default_window(q: LayoutQuery) -> int:
    """Positions shown by ``--around`` without ``--window``: four rounds of ``W*I`` (states)."""
    round_len = q.dcp_size * q.interleave_size * q.tokens_per_state
    return min(max(4 * round_len, AROUND_MIN), AROUND_MAX)


def _entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"


def _around(q: LayoutQuery, covered: int | None, span: int) -> list[int]:
    """A window of positions with ``q.around`` in its middle, inside the block table."""
    P = q.around
    check_int("--around", P, minimum=0)
    width = check_int("--window", q.window if q.window is not None else default_window(q))
    if width > MAX_POSITIONS:
        raise ConfigError(f"--window: {width} positions is more than {MAX_POSITIONS}")
    if covered is not None and P >= covered:
        n = covered // span
        raise ConfigError(
            f"--around {P}: position {P} needs block-table entry {P // span}, but {q.table_source} "
            f"has {_entries(n)} (each covers {span} positions, so positions < {covered})"
        )
    lo = max(0, P - width // 2)
    hi = lo + width
    if covered is not None and hi > covered:
        hi = covered
        lo = max(0, hi - width)
    return list(range(lo, hi))


# --- computation -----------------------------------------------------------------------


def compute(q: LayoutQuery) -> dict:
    W, I, B, R = q.dcp_size, q.interleave_size, q.block_size, q.tokens_per_state
    Bk = q.kernel_block_size if q.kernel_block_size is not None else B
    check_int("--tokens-per-state", R)
    validate_layout(block_size=B, dcp_size=W, interleave_size=I, kernel_block_size=Bk, replicated=q.replicated)
    sharded = W > 1 and not q.replicated
    span_states = B * W if sharded else B  # states (positions or records) per block-table entry
    span = span_states * R  # positions per block-table entry
    bt = q.block_table
    if bt is not None:
        covered, why = len(bt) * span, f"the end of {q.table_source}"
    else:
        covered, why = 2 * span, "the end of the default 2-entry block table"
    if q.around is not None:
        positions = _around(q, covered if bt is not None else None, span)
    else:
        positions = parse_positions("0:" if q.positions is None else q.positions, covered, why)
    last = positions[-1]
    if bt is None:
        bt = list(range(1, last // span + 2))
    elif last >= len(bt) * span:
        raise ConfigError(
            f"position {last} needs block-table entry {last // span}, but {q.table_source} has "
            f"{_entries(len(bt))} (each covers {span} positions, so positions < {len(bt) * span})"
        )

    pos = np.asarray(positions, dtype=np.int64)
    L = last + 1
    prefix = positions == list(range(L))
    if R == 1:
        index, emit = pos, None
        slots = np.stack(
            [
                slot_mapping(
                    pos, bt, block_size=B, dcp_size=W, dcp_rank=r, interleave_size=I, kernel_block_size=Bk, replicated=q.replicated
                )
                for r in range(W)
            ]
        )
        stored_before_L = L
    else:
        candidates = records_emitted(int(pos[0]), L, R)
        emitted_at = record_emit_positions(candidates, R)
        keep = np.isin(emitted_at, pos)
        index, emit = candidates[keep], emitted_at[keep]
        if index.size == 0:
            raise ConfigError(
                f"--tokens-per-state {R}: no record is emitted at the positions shown "
                f"({positions[0]}..{last}); record c is emitted at position (c+1)*{R}-1 "
                f"(positions {R - 1}, {2 * R - 1}, ...)"
            )
        slots = np.stack(
            [
                record_slot_mapping(
                    index,
                    bt,
                    block_size=B * R,
                    tokens_per_state=R,
                    dcp_size=W,
                    dcp_rank=r,
                    interleave_size=I,
                    kernel_block_size=Bk * R,
                    replicated=q.replicated,
                )
                for r in range(W)
            ]
        )
        stored_before_L = len(records_emitted(0, L, R))
    if sharded:
        owner = owner_rank(index, dcp_size=W, interleave_size=I)
        # index in the owner's local sequence = indices before it that the owner stores
        local_index = local_seq_lens(index, dcp_size=W, interleave_size=I)[np.arange(index.size), owner]
        lens = local_seq_lens([stored_before_L], dcp_size=W, interleave_size=I)[0]
    else:
        owner, local_index, lens = None, index, np.full(W, stored_before_L, dtype=np.int64)
    stored = slots != PAD
    x0 = pos if emit is None else emit - (R - 1)  # a record's cell: the R tokens it folds
    d = {
        "config": {
            "decode_context_parallel_size": W,
            "cp_kv_cache_interleave_size": I,
            "block_size": B,
            "kernel_block_size": Bk,
            "tokens_per_state": R,
            "replicated": bool(q.replicated),
            "block_table": [int(b) for b in bt],
        },
        "positions": positions,
        "around": q.around,
        "index_kind": "position" if R == 1 else "record",
    }
    if R > 1:
        d["records"] = index.tolist()
        d["record_emit_positions"] = emit.tolist()
    d.update(
        {
            "owner": owner.tolist() if owner is not None else "all",
            "local_index": local_index.tolist(),
            "local_seq_lens": lens.tolist(),
            "owned_counts": stored.sum(axis=1).tolist(),
            "slots": {str(r): slots[r].tolist() for r in range(W)},
            # for the text and picture views
            "_span": span,
            "_span_states": span_states,
            "_prefix": prefix,
            "_index": index.tolist(),
            "_x0": x0.tolist(),
            "_width": R,
            "_entry": (index // span_states).tolist(),
            # the kernel block each slot lies in, read off the slot number (kernel id * Bk + offset)
            "_kernel": np.where(stored, slots // Bk, PAD).tolist(),
            "_around_col": _column_of(q.around, x0, R),
        }
    )
    return d


def _column_of(P: int | None, x0: np.ndarray, width: int) -> int | None:
    """The view's index whose cell covers position ``P`` (None: not shown)."""
    if P is None:
        return None
    hit = np.flatnonzero((x0 <= P) & (P < x0 + width))
    return int(hit[0]) if hit.size else None


def public(d: dict) -> dict:
    """The JSON document: without the views' private keys."""
    return {k: v for k, v in d.items() if not k.startswith("_")}
