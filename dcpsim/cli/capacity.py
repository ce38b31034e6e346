"""``python -m dcpsim capacity SCENARIO --dcp 1,2,4,8``: what each KV-cache group costs and
holds per rank, side by side for each DCP size.

The arithmetic is ``dcpsim.views.capacity``; this module parses the flags, validates each
DCP size the way ``run`` does (a size the scenario cannot take becomes a column that says
why), and prints a table or one JSON document.
"""

from __future__ import annotations

import argparse
import json
import textwrap

from dcpsim.cli.lists import size_list
from dcpsim.cli.outcome import json_errors
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.harness.budget import check_scheduler_fits
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario
from dcpsim.views import capacity as cap

NOTE_WIDTH = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="a scenario .toml file or the name of a built-in scenario")
    p.add_argument(
        "--decode-context-parallel-size", "--dcp", dest="dcp", metavar="W,...", help="comma list of DCP sizes (default: the scenario's)"
    )
    p.add_argument("--block-size", type=int, metavar="B", help="states per page of every paged layer (as for run)")
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="G",
        help="size the pool from a per-rank KV budget of G * U GiB instead of the scenario's "
        "kv_cache_tokens / num_gpu_blocks (nothing is subtracted for weights or activations)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="U",
        help=f"share of --gpu-memory-gib given to the KV cache (default {cap.DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")


def parse_dcp_list(text: str) -> list[int]:
    return size_list(text, "--dcp", "decode_context_parallel_size")


def budget_of(args) -> cap.Budget | None:
    if args.gpu_memory_gib is None:
        if args.gpu_memory_utilization is not None:
            raise ConfigError("--gpu-memory-utilization needs --gpu-memory-gib")
        return None
    if not args.gpu_memory_gib > 0:
        raise ConfigError(f"--gpu-memory-gib must be > 0, got {args.gpu_memory_gib}")
    u = cap.DEFAULT_GPU_MEMORY_UTILIZATION if args.gpu_memory_utilization is None else args.gpu_memory_utilization
    if not 0 < u <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {u}")
    return cap.Budget(args.gpu_memory_gib, u)


def plan(args) -> cap.CapacityPlan:
    budget = budget_of(args)
    scenario = load_scenario(args.scenario)
    dcps = parse_dcp_list(args.dcp) if args.dcp else [scenario.config.decode_context_parallel_size]
    columns = []
    for w in dcps:
        try:
            sc = scenario.with_overrides(ScenarioOverrides(decode_context_parallel_size=w, block_size=args.block_size))
            engine = ReferenceEngine()
            geometries = engine.geometries(sc.layers, sc.config)  # what run refuses, refused here
            if budget is None:
                check_scheduler_fits(sc)  # before the pools are built
                Scheduler(sc, engine, geometries)  # the scenario's pools must hold every request
            columns.append(cap.column(sc, budget))
        except ConfigError as exc:
            columns.append(cap.invalid_column(w, str(exc)))
    if not any(c.valid for c in columns):
        reasons = "; ".join(f"W={c.decode_context_parallel_size}: {c.error}" for c in columns)
        raise ConfigError(f"{scenario.source}: no valid DCP size: {reasons}")
    return cap.plan_capacity(scenario, columns, budget)


# --- text --------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B" if float(n).is_integer() else f"{n:.1f} B"


def fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


GROUP_ROWS = (
    ("sharded", lambda g: "sharded" if g.sharded else "replicated" if g.dcp_replicated else "whole (W=1)"),
    ("page bytes", lambda g: fmt_bytes(g.page_size_bytes)),
    ("bytes per token", lambda g: fmt_bytes(g.bytes_per_token) if g.bytes_per_token is not None else "fixed"),
    ("blocks per request at max_model_len", lambda g: fmt_int(g.blocks_per_request)),
    ("max memory per request", lambda g: fmt_bytes(g.max_memory_usage_bytes)),
    ("  if sharded", lambda g: fmt_bytes(g.if_sharded_bytes)),
    ("pool blocks", lambda g: fmt_int(g.pool_blocks)),
    ("pool tokens", lambda g: fmt_int(g.pool_tokens)),
    ("pool bytes", lambda g: fmt_bytes(g.pool_bytes)),
    ("concurrency at max_model_len", lambda g: fmt_ratio(g.concurrency)),
)


TOTAL_ROWS = (
    ("max memory per request", lambda c: fmt_bytes(c.max_memory_per_request), False),
    ("  of it replicated groups", lambda c: fmt_bytes(c.replicated_per_request), False),
    ("  those groups if sharded", lambda c: fmt_bytes(c.replicated_if_sharded), False),
    ("pool bytes", lambda c: fmt_bytes(c.pool_bytes), False),
    ("block bytes (largest group page)", lambda c: fmt_bytes(c.block_bytes), True),
    ("num_blocks (shared pool)", lambda c: fmt_int(c.num_blocks), True),
    ("concurrency at max_model_len", lambda c: fmt_ratio(c.concurrency), False),
    ("context the DCP group holds (tokens)", lambda c: fmt_int(c.context_tokens), False),
    ("  concurrency without padding", lambda c: fmt_ratio(c.concurrency_without_padding), True),
    ("  context without padding (tokens)", lambda c: fmt_int(c.context_tokens_without_padding), True),
)
"""The rows of the "per rank, all groups" section: label, value of a column, and whether
the row is shown only for a pool sized from a KV budget (``--gpu-memory-gib``)."""

Rows = list[tuple[str, list[str]]]
"""A table's rows: a label, then one cell per DCP size."""


def render(p: cap.CapacityPlan) -> str:
    """The capacity plan as text: the heading, the table (a column per DCP size: each
    group's rows, then the totals per rank), why each invalid size is invalid, a budget's
    padding per block, and the notes."""
    budget = p.pool["mode"] != "scenario"
    valid = [c for c in p.columns if c.valid]
    out = [f"capacity: {p.scenario} (max_model_len {p.max_model_len:,}); {_pool_heading(p.pool)}"]
    rows = [("", [f"W={c.decode_context_parallel_size}" for c in p.columns])]
    rows += _group_rows(p.columns, valid[0].groups)
    rows += _total_rows(p.columns, budget)
    out += _aligned(rows)
    out += [f"W={c.decode_context_parallel_size}: invalid: {c.error}" for c in p.columns if not c.valid]
    if budget:
        out += _padding_lines(valid[0].groups)
    out.append("notes:")
    for n in p.notes:
        out += textwrap.wrap(n, NOTE_WIDTH, initial_indent="  - ", subsequent_indent="    ")
    return "\n".join(out)


def _pool_heading(pool: dict) -> str:
    """Where the pool's size comes from: the scenario's setting, or the KV budget per rank."""
    if pool["mode"] == "scenario":
        setting = next(
            (f"{k} = {pool[k]}" for k in ("kv_cache_tokens", "num_gpu_blocks") if pool[k] is not None), "room for every request at once"
        )
        return f"pool from the scenario: {setting}"
    return (
        f"pool from a KV budget of {pool['gpu_memory_gib']:g} GiB * {pool['gpu_memory_utilization']:g} = "
        f"{fmt_bytes(pool['budget_bytes_per_rank'])} per rank"
    )


def _group_rows(cols: list, groups: list) -> Rows:
    """Each group's title row and ``GROUP_ROWS`` (``groups``: a valid column's, for the
    titles); "if sharded" only where some column has it, "-" in an invalid column."""
    rows: Rows = []
    for i, first in enumerate(groups):
        rows.append((f"{first.name} ({first.layers} layer{'s' if first.layers > 1 else ''})", [""] * len(cols)))
        for label, get in GROUP_ROWS:
            if label == "  if sharded" and all(not c.valid or c.groups[i].if_sharded_bytes is None for c in cols):
                continue
            rows.append((f"  {label}", [get(c.groups[i]) if c.valid else "-" for c in cols]))
    return rows


def _total_rows(cols: list, budget: bool) -> Rows:
    """The "per rank, all groups" title and the ``TOTAL_ROWS`` shown for this pool, "-" in an invalid column."""
    rows: Rows = [("per rank, all groups", [""] * len(cols))]
    for label, get, budget_only in TOTAL_ROWS:
        if budget or not budget_only:
            rows.append((f"  {label}", [get(c) if c.valid else "-" for c in cols]))
    return rows


def _aligned(rows: Rows) -> list[str]:
    """The rows as lines: labels left-aligned, each column right-aligned to its widest cell."""
    label_w = max(len(label) for label, _ in rows)
    widths = [max(len(r[1][j]) for r in rows) for j in range(len(rows[0][1]))]
    return [(label.ljust(label_w) + "".join("  " + v.rjust(w) for v, w in zip(cells, widths))).rstrip() for label, cells in rows]


def _padding_lines(groups: list) -> list[str]:
    """Under a KV budget, the padding each group's page leaves in the shared block (no line if none does)."""
    pad = [(g.name, g.padding_bytes_per_block) for g in groups if g.padding_bytes_per_block]
    if not pad:
        return []
    return [
        "padding per block (the shared block is as large as the largest group page): "
        + ", ".join(f"{name} {fmt_bytes(b)}" for name, b in pad)
    ]


def run(args) -> int:
    with json_errors(args.json):
        p = plan(args)
    print(json.dumps(p.to_dict(), indent=2) if args.json else render(p))
    return 0
