"""The first failure of a run report as a layout view, and what to mark on it.

``load_failure_view(path)`` reads a ``run``/``worker --json`` report (or a ``matrix --json``
report: its first failing cell) and keeps the failing group's layout: ``W``, ``I``, the
page and kernel block sizes, ``R``, sharded or replicated, and the request's block-table
row when the report carries one (``failure.block_table``). The view is centred on the first
bad index; its marks are the expected owner and slot, what that slot holds instead, and
where the entry was found (or written). Every slot drawn comes from the layout view; a
report's own numbers are quoted in the labels. Reads plain JSON: no checker import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.layout import record_emit_positions
from dcpsim.report_file import read_report_text
from dcpsim.views.layout_view import LayoutQuery
from dcpsim.views.marks import Mark

REPORT_KEYS = ("scenario", "dcp_size", "interleave_size", "kernel_block_size", "groups", "passed", "failure")
MAX_ACTUAL_MARKS = 4


def _read(path: str):
    text = read_report_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not a JSON report ({exc}); expected the output of python -m dcpsim run SCENARIO --json") from None


def _pick_report(data, path: str) -> dict:
    if isinstance(data, list):  # matrix --json: the first failing cell with a report
        for cell in data:
            if isinstance(cell, dict) and isinstance(cell.get("report"), dict) and cell["report"].get("failure"):
                return cell["report"]
        raise ConfigError(f"{path}: no failing cell with a report in this matrix report; nothing to draw")
    if isinstance(data, dict) and "error" in data and "failure" not in data:
        err = data["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise ConfigError(f"{path}: the run ended with an error before anything was verified ({msg}); nothing to draw")
    if not isinstance(data, dict) or not all(k in data for k in REPORT_KEYS):
        missing = [k for k in REPORT_KEYS if not isinstance(data, dict) or k not in data]
        raise ConfigError(
            f"{path}: not a dcpsim run report (missing {', '.join(missing)}); expected the output of python -m dcpsim run SCENARIO --json"
        )
    return data


def _int(value, path: str, field: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{path}: {field} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass
class FailureView:
    path: str
    report: dict
    failure: dict
    group: dict
    index: int
    """The first bad index (a position, or a record of a compressed group); for an attention
    mismatch, the query position."""
    index_kind: str
    centre: int
    """The position the view is centred on."""
    dcp_size: int
    interleave_size: int
    block_size: int
    kernel_block_size: int | None
    tokens_per_state: int
    replicated: bool
    block_table: list[int] | None

    @property
    def is_query(self) -> bool:
        return self.failure.get("index") is None

    def query(self, *, around: int | None = None, window: int | None = None) -> LayoutQuery:
        return LayoutQuery(
            dcp_size=self.dcp_size,
            interleave_size=self.interleave_size,
            block_size=self.block_size,
            kernel_block_size=self.kernel_block_size,
            tokens_per_state=self.tokens_per_state,
            replicated=self.replicated,
            block_table=self.block_table,
            around=self.centre if around is None else around,
            window=window,
            table_source="failure.block_table",
        )

    # --- what the view marks ---------------------------------------------------------

    def _column(self, d: dict, index: int) -> int | None:
        """The view's column of a position or record (None: not shown)."""
        kind_matches = d["index_kind"] == self.index_kind
        return d["_index"].index(index) if kind_matches and index in d["_index"] else None

    def _cell_of_slot(self, d: dict, rank: int, slot: int) -> int | None:
        """The column whose slot on ``rank`` is ``slot``, if the report's table is drawn."""
        if self.block_table is None:
            return None
        row = d["slots"].get(str(rank), [])
        return row.index(slot) if slot in row else None

    def _box(self, d: dict, col: int | None) -> tuple[float, float]:
        if col is not None:
            return d["_x0"][col], d["_width"]
        return self.centre, 1

    def marks(self, d: dict) -> list[Mark]:
        f, kind = self.failure, self.index_kind
        col = self._column(d, self.index)
        x0, w = self._box(d, col)
        out: list[Mark] = []
        if self.is_query:
            out.append(
                Mark(
                    "query",
                    None,
                    self.centre,
                    1,
                    "query",
                    f"attention query position {self.centre}, head {f.get('head')}, error {f.get('error')}",
                    gid="query",
                )
            )
            return out
        owner = f.get("expected_owner")
        if owner is not None:
            rank = None if owner == "all" else owner
            where = "every rank" if rank is None else f"rank {rank}"
            out.append(
                Mark(
                    "expected",
                    rank,
                    x0,
                    w,
                    "expected",
                    f"expected: {kind} {self.index} on {where}, slot {f.get('expected_slot')} (report)",
                    gid="expected",
                )
            )
            for h in f.get("holdings") or []:
                if (rank is None or h["rank"] == rank) and h.get("index") != self.index:
                    held = (
                        "nothing (never written)"
                        if h.get("index", -1) == -1
                        else f"{kind} {h['index']} of {h.get('writer')} (step {h.get('step')})"
                    )
                    out.append(
                        Mark(
                            "holds",
                            h["rank"],
                            x0,
                            w,
                            "holds " + ("nothing" if h.get("index", -1) == -1 else str(h["index"])),
                            f"rank {h['rank']} slot {h['slot']} holds {held}",
                            gid=f"holds-r{h['rank']}",
                        )
                    )
        elif col is not None:
            model_owner = d["owner"] if d["owner"] == "all" else d["owner"][col]
            rank = None if model_owner == "all" else model_owner
            slot = d["slots"][str(rank if rank is not None else 0)][col]
            out.append(
                Mark(
                    "expected",
                    rank,
                    x0,
                    w,
                    "expected",
                    f"expected (layout model): {kind} {self.index} on "
                    + ("every rank" if rank is None else f"rank {rank}")
                    + f", slot {slot}",
                    gid="expected",
                )
            )
        out += self._actual_marks(d, x0, w)
        return out

    def _actual_marks(self, d: dict, x0: float, w: float) -> list[Mark]:
        f, kind = self.failure, self.index_kind
        found = [
            (h["rank"], s, self.index, f"rank {h['rank']} holds {kind} {self.index} at slot {s}")
            for h in f.get("holdings") or []
            for s in h.get("found_at") or []
        ]
        found += [
            (
                v["rank"],
                v["slot"],
                v["index"],
                f"rank {v['rank']} wrote {kind}s {v['index']}..{v.get('last_index', v['index'])} "
                f"from slot {v['slot']} ({v.get('count', 1)} writes): {v.get('reason')}",
            )
            for v in f.get("violations") or []
        ]
        out = []
        for k, (rank, slot, index, text) in enumerate(found[:MAX_ACTUAL_MARKS]):
            q = self._cell_of_slot(d, rank, slot)
            if q is not None:
                there = d["_index"][q]
                where = "" if there == index else f"; the layout puts {kind} {there} there"
                out.append(Mark("actual", rank, d["_x0"][q], d["_width"], "actual", f"actual: {text}{where}", gid=f"actual-{k}"))
                continue
            why = "not in the request's block table" if self.block_table is not None else "the block table is not in the report"
            col = self._column(d, index)
            bx, bw = (x0, w) if col is None else self._box(d, col)
            out.append(
                Mark(
                    "actual",
                    rank,
                    bx,
                    bw,
                    "actual?",
                    f"actual: {text} (slot {slot}: {why}; marked at "
                    f"{kind} {index if col is not None else self.index} in rank {rank}'s lane)",
                    exact=False,
                    gid=f"actual-{k}",
                )
            )
        return out

    # --- words -------------------------------------------------------------------

    def title(self) -> str:
        f = self.failure
        what = f"query position {self.centre}" if self.is_query else f"first bad {self.index_kind} {self.index}"
        return (
            f"{self.report['scenario']}: {f.get('kind')} at step {f.get('step')}, group {f.get('group')}, "
            f"request {f.get('request_id')}, {what}"
        )

    def _table_note(self, d: dict) -> str:
        if self.block_table is not None:
            return f"block table: the request's row from the report, {self.block_table}"
        return (
            f"block table not in the report: assumed {d['config']['block_table']} (1..n); the slots "
            "drawn may differ from the run's by a block offset"
        )

    def notes(self, d: dict) -> list[str]:
        g = self.group
        out = [
            f"from {self.path}: group {g['name']}, {g['storage']}, {'sharded' if g['sharded'] else 'replicated'}, "
            f"{g['states_per_page']} states per page ({g['block_size']} tokens)",
            self._table_note(d),
        ]
        for c in self.failure.get("contributions") or []:
            out.append(f"rank {c.get('rank')}: {c.get('keys')} keys visible, lse {c.get('lse')}")
        return out

    def lines(self, d: dict) -> list[str]:
        f = self.failure
        out = [
            f"failure in {self.path} (scenario {self.report['scenario']}): {f.get('kind')} at step {f.get('step')}: {f.get('message')}",
            f"  group {f.get('group')}, request {f.get('request_id')}",
        ]
        out += [f"  {m.label}" for m in self.marks(d)]
        out.append(f"  {self._table_note(d)}")
        return out

    def summary(self, d: dict) -> dict:
        f = self.failure
        return {
            "report": self.path,
            "scenario": self.report["scenario"],
            "kind": f.get("kind"),
            "step": f.get("step"),
            "group": f.get("group"),
            "request_id": f.get("request_id"),
            "index_kind": self.index_kind,
            "index": None if self.is_query else self.index,
            "centre": self.centre,
            "block_table_from_report": self.block_table is not None,
            "marks": [
                {"kind": m.kind, "rank": m.rank, "x0": m.x0, "width": m.width, "exact": m.exact, "label": m.label} for m in self.marks(d)
            ],
        }


def _check_entries(f: dict, path: str) -> None:
    """The holdings and violations the marks read: ranks, slots and indices are integers."""
    for field, keys in (("holdings", ("rank", "slot", "index")), ("violations", ("rank", "slot", "index"))):
        entries = f.get(field) or []
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ConfigError(f"{path}: failure.{field} must be a list of objects")
        for k, e in enumerate(entries):
            for key in keys:
                _int(e.get(key), path, f"failure.{field}[{k}].{key}", minimum=-1)
            for s in e.get("found_at") or []:
                _int(s, path, f"failure.{field}[{k}].found_at[]")


def load_failure_view(path: str) -> FailureView:
    report = _pick_report(_read(path), path)
    f = report["failure"]
    if not f:
        raise ConfigError(f"{path}: the report has no failure (scenario {report.get('scenario')} passed); nothing to draw")
    if not isinstance(f, dict):
        raise ConfigError(f"{path}: failure must be an object, got {type(f).__name__}")
    groups = [g for g in report["groups"] if isinstance(g, dict) and g.get("name") == f.get("group")]
    if not groups:
        raise ConfigError(
            f"{path}: the {f.get('kind')} failure names no group of the report "
            f"(group {f.get('group')!r}: {f.get('message')}); nothing to draw"
        )
    g = groups[0]
    if g.get("storage") == "ring":
        raise ConfigError(
            f"{path}: the first failure is in ring group {g['name']} (a compressor ring of "
            f"{g.get('block_size')} rows, one block per request); layout views cover paged groups only"
        )
    index = f.get("index")
    kind = f.get("index_kind") or "position"
    if index is None:
        index, kind = f.get("query_position"), "position"
    if index is None:
        raise ConfigError(f"{path}: a {f.get('kind')} failure has no bad index to draw ({f.get('message')})")
    index = _int(index, path, "failure.index")
    W = _int(report["dcp_size"], path, "dcp_size", 1)
    I = _int(report["interleave_size"], path, "interleave_size", 1)
    tokens = _int(g.get("block_size"), path, "groups[].block_size", 1)
    B = _int(g.get("states_per_page"), path, "groups[].states_per_page", 1)
    if tokens % B:
        raise ConfigError(f"{path}: group {g['name']}: block_size {tokens} is not a multiple of states_per_page {B}")
    R = tokens // B
    Bk = report["kernel_block_size"]
    if Bk is not None:
        Bk = _int(Bk, path, "kernel_block_size", 1)
    _check_entries(f, path)
    table = f.get("block_table")
    if table is not None:
        if not isinstance(table, list) or not table:
            raise ConfigError(f"{path}: failure.block_table must be a non-empty list of block ids, got {table!r}")
        table = [_int(b, path, "failure.block_table[]") for b in table]
    if kind == "record" and R == 1:
        raise ConfigError(f"{path}: a record index in group {g['name']}, whose pages hold one state per token")
    centre = int(record_emit_positions([index], R)[0]) if kind == "record" else index
    return FailureView(
        path=path,
        report=report,
        failure=f,
        group=g,
        index=index,
        index_kind=kind,
        centre=centre,
        dcp_size=W,
        interleave_size=I,
        block_size=B,
        kernel_block_size=Bk,
        tokens_per_state=R,
        replicated=not g.get("sharded", True),
        block_table=table,
    )
