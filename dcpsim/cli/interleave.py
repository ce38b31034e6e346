"""``python -m dcpsim interleave SCENARIO --interleave 1,8,64,B [--dcp W]``: run the
scenario's schedule once per interleave size (every rank's write path in this process)
and compare how each spreads the KV cache over the ranks, per sharded group.

The statistics are ``dcpsim.views.interleave`` (run by ``dcpsim.campaigns.interleave``),
the rules a size breaks ``dcpsim.views.backend_rules``, the plot
``dcpsim.views.interleave_plot`` (``--png``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from dcpsim.campaigns.interleave import interleave_stats
from dcpsim.cli.lists import size_list
from dcpsim.cli.outcome import json_errors
from dcpsim.errors import EXIT_USAGE, ConfigError
from dcpsim.harness.budget import check_budget
from dcpsim.model.grouping import group_layer_specs
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.model.validate import PAGE
from dcpsim.scenarios.load import load_scenario
from dcpsim.views.backend_rules import RULES, broken_rules, layout_context
from dcpsim.views.interleave_plot import save_imbalance_png

DEFAULT_INTERLEAVES = "1,8,64,B"
WRAP = 100
DEFINITIONS = {
    "stored": "entries (positions, or records of a compressed group) of the requests' final contexts each "
    "rank wrote, each (request, index) once",
    "imbalance": "per decode step, max - min over ranks of the local length summed over the step's decoding "
    "requests; max and mean over decode steps",
    "speculative": "ranks the 1 + k tokens of a speculative step land on: mean, and share of steps on one rank",
    "empty_shards": "per rank, requests whose final context it holds nothing of; decode writes where a rank's "
    "shard was empty (its LSE must be -inf)",
    "fragmentation": "runs of consecutive tokens at consecutive slots in a rank's part of one write: mean runs "
    "per write and mean run length (slots per run)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="a scenario .toml file or the name of a built-in scenario")
    p.add_argument(
        "--cp-kv-cache-interleave-size",
        "--interleave",
        dest="interleave",
        default=DEFAULT_INTERLEAVES,
        metavar="I,...",
        help=f"comma list of interleave sizes; B = the scenario's block size "
        f"(its smallest page, in states) (default {DEFAULT_INTERLEAVES})",
    )
    p.add_argument(
        "--decode-context-parallel-size", "--dcp", dest="dcp", type=int, metavar="W", help="DCP world size (default: the scenario's)"
    )
    p.add_argument("--block-size", type=int, metavar="B", help="states per page of every paged layer (as for run)")
    p.add_argument("--png", metavar="FILE", help="also draw the load imbalance per interleave size (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def parse_interleaves(text: str, block_size: int) -> list[tuple[int, str]]:
    """``(I, label)`` in order, duplicates (after resolving ``B``) dropped."""
    out: dict[int, str] = {}
    for token in size_list(text, "--interleave", "cp_kv_cache_interleave_size", page=True):
        if token == PAGE:
            value, label = block_size, f"{block_size} (B)"
        else:
            value, label = token, str(token)
        if value in out and token == PAGE:
            out[value] += " (B)"
        out.setdefault(value, label)
    return [(i, label) for i, label in out.items()]


def compare(args) -> dict:
    loaded = load_scenario(args.scenario)
    try:
        base = loaded.with_overrides(ScenarioOverrides(decode_context_parallel_size=args.dcp, block_size=args.block_size))
    except ConfigError as exc:
        raise ConfigError(f"{loaded.source}: {exc}") from None
    W = base.config.decode_context_parallel_size
    context = layout_context(base)
    sharded = [g for g in context.groups if g.sharded]
    if not sharded:
        raise ConfigError(
            f"{base.source}: no sharded group at W={W}: the interleave has no effect (pass --dcp W with W > 1)"
            if W == 1
            else f"{base.source}: every group is replicated; the interleave has no effect"
        )
    B = min(g.states_per_page for g in context.groups)
    rows = []
    for interleave, label in parse_interleaves(args.interleave, B):
        row = {"interleave": interleave, "label": label, "valid": False, "error": None, "rules": [], "groups": {}}
        try:
            sc = base.with_overrides(ScenarioOverrides(cp_kv_cache_interleave_size=interleave))
            row["rules"] = broken_rules(layout_context(sc))
            check_budget(sc, in_process=True, hint="")  # the schedule runs here, with every rank's store
            row["groups"] = {g.name: result for g, result in interleave_stats(sc)}
            row["valid"] = True
        except ConfigError as exc:
            row["error"] = str(exc)
        rows.append(row)
    return {
        "scenario": base.name,
        "source": base.source,
        "decode_context_parallel_size": W,
        "block_size": B,
        "num_speculative_tokens": base.config.num_speculative_tokens,
        "engine": "reference",
        "groups": [g.name for g in sharded],
        "units": {g.name: "records" if g.tokens_per_state > 1 else "positions" for g in sharded},
        "not_compared": [g.name for g in group_layer_specs(base.layers) if g.name not in {s.name for s in sharded}],
        "rows": rows,
        "definitions": DEFINITIONS,
    }


# --- text --------------------------------------------------------------------------------


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


COLUMNS = (
    ("I", lambda row, s: row["label"]),
    ("stored per rank", lambda row, s: " ".join(map(str, s["stored"]))),
    ("imbalance max", lambda row, s: str(s["imbalance_max"])),
    ("mean", lambda row, s: _f(s["imbalance_mean"])),
    ("spec ranks", lambda row, s: _f(s["speculative_ranks_mean"])),
    ("on one rank", lambda row, s: _pct(s["speculative_one_rank_share"])),
    ("empty shards", lambda row, s: " ".join(map(str, s["empty_shards"]))),
    ("runs/write", lambda row, s: _f(s["runs_per_write"])),
    ("run length", lambda row, s: _f(s["run_length"])),
)


def render(doc: dict) -> str:
    out = [
        f"interleave: {doc['scenario']} at W={doc['decode_context_parallel_size']} (B = {doc['block_size']}, "
        f"num_speculative_tokens = {doc['num_speculative_tokens']}), reference engine, one run per interleave size"
    ]
    for name in doc["groups"]:
        out += ["", f"{name} ({doc['units'][name]})"]
        cells = [[h for h, _ in COLUMNS]]
        for row in doc["rows"]:
            if row["valid"]:
                cells.append([get(row, row["groups"][name]) for _, get in COLUMNS])
            else:
                cells.append([row["label"], "invalid"] + [""] * (len(COLUMNS) - 2))
        widths = [max(len(c[j]) for c in cells) for j in range(len(COLUMNS))]
        for c in cells:
            out.append(("  " + "  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(c, widths)))).rstrip())
    if doc["not_compared"]:
        out += ["", "not compared (replicated or ring: every rank holds every entry): " + ", ".join(doc["not_compared"])]
    invalid = [row for row in doc["rows"] if not row["valid"]]
    for row in invalid:
        out += textwrap.wrap(f"I={row['label']}: invalid: {row['error']}", WRAP, subsequent_indent="    ")
    broken = {}
    out += ["", "rules of known backends these sizes break (vLLM 0.33.0 paths):"]
    for row in doc["rows"]:
        ids = [r["id"] for r in row["rules"]]
        out.append(f"  I={row['label']}: {', '.join(ids) if ids else 'none'}")
        broken.update({r["id"]: r for r in row["rules"]})
    for rule in RULES:
        if rule.id in broken:
            out += textwrap.wrap(
                f"{rule.id} ({rule.kind}): {rule.rule}. Source: {rule.source}", WRAP, initial_indent="  - ", subsequent_indent="    "
            )
    out += ["", "definitions:"]
    for key, text in doc["definitions"].items():
        out += textwrap.wrap(f"{key}: {text}", WRAP, initial_indent="  - ", subsequent_indent="    ")
    return "\n".join(out)


def run(args) -> int:
    with json_errors(args.json):
        doc = compare(args)
        if args.png:
            save_imbalance_png(doc, args.png)
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    if doc["rows"] and not any(row["valid"] for row in doc["rows"]):
        labels = ", ".join(str(row["label"]) for row in doc["rows"])
        print(f"dcpsim: error: --interleave: no size is valid here ({labels}; the reasons are above)", file=sys.stderr)
        return EXIT_USAGE
    return 0
