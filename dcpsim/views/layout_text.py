"""The text view of ``dcpsim layout``: a header, an ownership grid, local lengths, a slot table."""

from __future__ import annotations

from dcpsim.model.layout import PAD
from dcpsim.plural import plural

GRID_WIDTH = 64  # columns per grid line
RULER_EVERY = 8  # ruler labels on multiples of 8 (and run starts), where they fit


def _grid_lines(idx: list[int]) -> list[list[int | None]]:
    """Column layout of the grid: indices into ``idx``, ``None`` for a gap between runs."""
    lines: list[list[int | None]] = [[]]
    for i, p in enumerate(idx):
        cur = lines[-1]
        gap = bool(cur) and p != idx[i - 1] + 1
        if len(cur) + gap >= GRID_WIDTH:
            cur = []
            lines.append(cur)
        elif gap:
            cur.append(None)  # indices jump: leave a blank column
        cur.append(i)
    return lines


def _ruler(cols: list[int | None], idx: list[int], indent: int) -> str:
    """Label run starts and multiples of 8, wherever a label fits."""
    line = ""
    for c, i in enumerate(cols):
        if i is None:
            continue
        p = idx[i]
        run_start = c == 0 or cols[c - 1] is None
        if (run_start or p % RULER_EVERY == 0) and (not line or len(line) < c):
            line = line.ljust(c) + str(p)
    return " " * indent + line


def header(d: dict) -> list[str]:
    c, W = d["config"], d["config"]["decode_context_parallel_size"]
    R = c["tokens_per_state"]
    out = [
        f"DCP layout: W={W} I={c['cp_kv_cache_interleave_size']} B={c['block_size']} "
        f"Bk={c['kernel_block_size']}"
        + (f" R={R}" if R > 1 else "")
        + f" replicated={'yes' if c['replicated'] else 'no'} block_table={c['block_table']}",
    ]
    sharded = not c["replicated"] and W > 1
    if R == 1:
        out.append(
            f"one block-table entry covers {plural(d['_span'], 'position')}"
            + (f" ({plural(c['block_size'], 'slot')} on each rank)" if sharded else "")
        )
    else:
        out.append(
            f"one block-table entry covers {d['_span']} positions = {d['_span_states']} records"
            + (f" ({c['block_size']} records on each rank)" if sharded else "")
        )
        out.append(
            f"compressed cache (tokens_per_state {R}): record c folds positions c*{R}..c*{R}+{R - 1} "
            f"and is emitted at position (c+1)*{R}-1; records are dealt to ranks by record index"
        )
    if c["replicated"]:
        out.append(f"replicated group: every rank stores every {d['index_kind']} (plain slot mapping)")
    if d["around"] is not None:
        pos = d["positions"]
        out.append(f"window of {plural(len(pos), 'position')} {pos[0]}..{pos[-1]} around position {d['around']}")
    return out


def render(d: dict) -> str:
    W = d["config"]["decode_context_parallel_size"]
    slots, idx, kind = d["slots"], d["_index"], d["index_kind"]
    out = header(d)
    contiguous = idx == list(range(idx[0], idx[-1] + 1))
    which = f"{idx[0]}..{idx[-1]}" if contiguous else "listed"
    noun = "positions" if kind == "position" else "records"
    emitted = ""
    if kind == "record":
        em = d["record_emit_positions"]
        emitted = f", emitted at positions {em[0]}..{em[-1]}"
    out += ["", f"ownership of {which} {noun} ({len(idx)}{emitted}; # = stored on the rank, . = not)"]
    label_w = len(f"rank {W - 1}") + 2
    caret = d["_around_col"]
    for cols in _grid_lines(idx):
        out.append(_ruler(cols, idx, label_w))
        for r in range(W):
            row = slots[str(r)]
            marks = "".join(" " if i is None else "." if row[i] == PAD else "#" for i in cols)
            out.append(f"rank {r}".ljust(label_w) + marks)
        if caret is not None and caret in cols:
            what = "" if kind == "position" else f" (record {idx[caret]})"
            out.append(" " * (label_w + cols.index(caret)) + f"^ position {d['around']}{what}")

    def per_rank(values):
        return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))

    out.append("")
    pos = d["positions"]
    if d["_prefix"] and kind == "position":
        out.append(f"local_seq_lens (L={pos[-1] + 1}): {per_rank(d['local_seq_lens'])}")
    elif d["_prefix"]:
        out.append(f"local_seq_lens in records (L={pos[-1] + 1} positions emit {len(idx)} records): {per_rank(d['local_seq_lens'])}")
    else:
        out.append(f"owned among the {len(idx)} given {noun}: {per_rank(d['owned_counts'])}")

    owner = d["owner"]
    extra = [] if kind == "position" else [str(e) for e in d["record_emit_positions"]]
    cells = [
        [str(p)]
        + ([extra[i]] if extra else [])
        + ["all" if owner == "all" else str(owner[i]), str(d["local_index"][i])]
        + ["-" if slots[str(r)][i] == PAD else str(slots[str(r)][i]) for r in range(W)]
        for i, p in enumerate(idx)
    ]
    head = [kind] + (["emitted"] if extra else []) + ["owner", "local"] + [f"rank {r}" for r in range(W)]
    widths = [max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(head)]

    def fmt(row):
        return "  ".join(v.rjust(w) for v, w in zip(row, widths))

    out += ["", "slots (local = index in the owner's local sequence; - = PAD, not stored)", fmt(head)] + [fmt(row) for row in cells]
    return "\n".join(out)
