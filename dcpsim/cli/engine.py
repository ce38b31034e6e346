"""``dcpsim engine fetch`` (vLLM's or SGLang's source, without dependencies) and ``dcpsim engine info``
(what an engine is, what it loaded, and who makes each decision)."""

from __future__ import annotations

import json

from dcpsim.cli.options import add_engine_arguments, engine_choice
from dcpsim.engine.loading.fetch import PACKAGES, fetch
from dcpsim.engine.registry import engine_info
from dcpsim.errors import EXIT_OK
from dcpsim.plural import plural


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="engine_command", required=True)
    f = sub.add_parser("fetch", help="download vLLM's or SGLang's wheel without dependencies and unpack its source")
    f.add_argument(
        "requirement",
        nargs="?",
        default=PACKAGES["vllm"],
        help=f"{' or '.join(PACKAGES.values())} (default {PACKAGES['vllm']})",
    )
    f.add_argument("--dest", metavar="DIR", help="where to unpack (default $DCPSIM_CACHE or ~/.cache/dcpsim, /PACKAGE-VERSION)")
    i = sub.add_parser("info", help="the engine's version, what it loaded, and what makes each decision")
    add_engine_arguments(i)
    i.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    if args.engine_command == "fetch":
        print(fetch(args.requirement, args.dest))
        return EXIT_OK
    engine = engine_choice(args).build()  # resolves DCPSIM_VLLM_SOURCE and validates, as a run does
    info = engine_info(engine)
    tree = getattr(engine, "tree", None)
    if tree is not None:
        info["source"] = str(tree.root)
        info["loaded"] = sorted(tree.modules)
        info["stubbed"] = sorted(tree.stubbed)
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"engine {info['name']}" + (f" {info['version']}" if info.get("version") else ""))
    if tree is not None:
        print(f"  source: {info['source']}")
        print(f"  loaded: {', '.join(info['loaded'])}")
        print(f"  stubbed: {plural(len(info['stubbed']), 'module')}")
    for decision, who in info["decisions"].items():
        print(f"  {decision}: {who}")
    if info.get("scheduler_decisions"):
        print("  scheduler decisions:")
        for decision, who in info["scheduler_decisions"].items():
            print(f"    {decision}: {who}")
    return EXIT_OK
