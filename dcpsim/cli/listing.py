"""``dcpsim list``: the built-in scenarios, one line each (``--verbose``: with their layers,
requests and KV-cache groups)."""

from __future__ import annotations

import json

from dcpsim.errors import EXIT_OK
from dcpsim.model.grouping import group_layer_specs
from dcpsim.model.specs import is_dcp_replicated_spec
from dcpsim.plural import plural
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names


def add_arguments(p) -> None:
    p.add_argument("--verbose", "-v", action="store_true", help="also print each scenario's layers, requests and KV-cache groups")
    p.add_argument("--json", action="store_true", help="print the catalogue as JSON")


def run(args) -> int:
    rows = []
    for name in builtin_scenario_names():
        s = load_scenario(name)
        kinds = ", ".join(
            f"{g.name.split('[')[0]} ({'replicated' if is_dcp_replicated_spec(g.kv_cache_spec) else 'sharded'})"
            for g in group_layer_specs(s.layers)
        )
        rows.append({"name": name, "description": s.description, "layers": len(s.layers), "groups": kinds, "requests": len(s.requests)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['description']}")
        if args.verbose:
            print(f"{'':<{width}}  {plural(r['layers'], 'layer')}, {plural(r['requests'], 'request')}; groups: {r['groups']}")
    return EXIT_OK
