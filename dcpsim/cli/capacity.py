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
    out = []
    for token in (t.strip() for t in text.split(",")):
        try:
            out.append(int(token))
        except ValueError:
            raise ConfigError(f"--dcp: {token!r} is not an integer (expected e.g. 1,2,4,8)") from None
    return out


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


def render(p: cap.CapacityPlan) -> str:
    pool = p.pool
    if pool["mode"] == "scenario":
        setting = next(
            (f"{k} = {pool[k]}" for k in ("kv_cache_tokens", "num_gpu_blocks") if pool[k] is not None), "room for every request at once"
        )
        head = f"pool from the scenario: {setting}"
    else:
        head = (
            f"pool from a KV budget of {pool['gpu_memory_gib']:g} GiB * {pool['gpu_memory_utilization']:g} = "
            f"{fmt_bytes(pool['budget_bytes_per_rank'])} per rank"
        )
    out = [f"capacity: {p.scenario} (max_model_len {p.max_model_len:,}); {head}"]
    cols = p.columns
    valid = [c for c in cols if c.valid]
    rows: list[tuple[str, list[str]]] = [("", [f"W={c.decode_context_parallel_size}" for c in cols])]
    for i, first in enumerate(valid[0].groups):
        rows.append((f"{first.name} ({first.layers} layer{'s' if first.layers > 1 else ''})", [""] * len(cols)))
        for label, get in GROUP_ROWS:
            if label == "  if sharded" and all(not c.valid or c.groups[i].if_sharded_bytes is None for c in cols):
                continue
            rows.append((f"  {label}", [get(c.groups[i]) if c.valid else "-" for c in cols]))
    rows.append(("per rank, all groups", [""] * len(cols)))
    budget = pool["mode"] != "scenario"
    totals = [
        ("max memory per request", lambda c: fmt_bytes(c.max_memory_per_request)),
        ("  of it replicated groups", lambda c: fmt_bytes(c.replicated_per_request)),
        ("  those groups if sharded", lambda c: fmt_bytes(c.replicated_if_sharded)),
        ("pool bytes", lambda c: fmt_bytes(c.pool_bytes)),
    ]
    if budget:
        totals += [
            ("block bytes (largest group page)", lambda c: fmt_bytes(c.block_bytes)),
            ("num_blocks (shared pool)", lambda c: fmt_int(c.num_blocks)),
        ]
    totals += [
        ("concurrency at max_model_len", lambda c: fmt_ratio(c.concurrency)),
        ("context the DCP group holds (tokens)", lambda c: fmt_int(c.context_tokens)),
    ]
    if budget:
        totals += [
            ("  concurrency without padding", lambda c: fmt_ratio(c.concurrency_without_padding)),
            ("  context without padding (tokens)", lambda c: fmt_int(c.context_tokens_without_padding)),
        ]
    for label, get in totals:
        rows.append((f"  {label}", [get(c) if c.valid else "-" for c in cols]))
    label_w = max(len(label) for label, _ in rows)
    widths = [max(len(r[1][j]) for r in rows) for j in range(len(cols))]
    for label, cells in rows:
        line = label.ljust(label_w) + "".join("  " + v.rjust(w) for v, w in zip(cells, widths))
        out.append(line.rstrip())
    for c in cols:
        if not c.valid:
            out.append(f"W={c.decode_context_parallel_size}: invalid: {c.error}")
    if budget:
        pad = [(g.name, g.padding_bytes_per_block) for g in valid[0].groups if g.padding_bytes_per_block]
        if pad:
            out.append(
                "padding per block (the shared block is as large as the largest group page): "
                + ", ".join(f"{name} {fmt_bytes(b)}" for name, b in pad)
            )
    out.append("notes:")
    for n in p.notes:
        out += textwrap.wrap(n, NOTE_WIDTH, initial_indent="  - ", subsequent_indent="    ")
    return "\n".join(out)


def run(args) -> int:
    with json_errors(args.json):
        p = plan(args)
    print(json.dumps(p.to_dict(), indent=2) if args.json else render(p))
    return 0
