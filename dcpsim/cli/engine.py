"""``dcpsim engine fetch`` (vLLM's or SGLang's source, without dependencies) and ``dcpsim engine info``
(what an engine is, what it loaded, and who makes each decision)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dcpsim.campaigns.bisect import bisect, release_range
from dcpsim.cli.flags import add_flags, flag_values
from dcpsim.cli.options import add_engine_arguments, engine_choice
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.loading.fetch import PACKAGES, fetch, pinned
from dcpsim.engine.loading.launch_cache import describe as describe_launches
from dcpsim.engine.registry import engine_info
from dcpsim.engine.release_tables import RELEASE_TABLES, table_document, tree_document
from dcpsim.engine.vllm_ascend.releases import VLLM_OF
from dcpsim.errors import EXIT_OK, ConfigError
from dcpsim.harness.launch import launch_options
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.attention_config import AttentionConfig
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.plural import plural
from dcpsim.verify.options import CheckOptions


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="engine_command", required=True)
    f = sub.add_parser("fetch", help="download vLLM's or SGLang's wheel without dependencies and unpack its source")
    f.add_argument(
        "requirement",
        nargs="?",
        default=PACKAGES["vllm"],
        help=f"{' or '.join(PACKAGES.values())} (default {PACKAGES['vllm']}); vllm-ascend also fetches the vLLM release it runs on",
    )
    f.add_argument("--dest", metavar="DIR", help="where to unpack (default $DCPSIM_CACHE or ~/.cache/dcpsim, /PACKAGE-VERSION)")
    r = sub.add_parser("releases", help="the releases each real engine is bound for, and which code a source tree holds per decision")
    r.add_argument("--engine", choices=sorted(RELEASE_TABLES), help="only this engine (default: every one)")
    r.add_argument("--vllm-source", metavar="DIR", help="bind this vLLM tree (a wheel, a checkout) and say what each decision binds to")
    r.add_argument("--sglang-source", metavar="DIR", help="bind this SGLang tree and say what each decision binds to")
    r.add_argument("--vllm-ascend-source", metavar="DIR", help="bind this vllm-ascend tree (its own decisions) and say what each binds to")
    r.add_argument("--vllm-runner", default="v2", choices=("v2", "v1"), help="the model runner whose slot mapping to bind (default v2)")
    r.add_argument("--json", action="store_true", help="print one JSON document")
    b = sub.add_parser("bisect", help="run one scenario under every release of a real engine in a range and say where the verdict changes")
    b.add_argument("scenario", help="a scenario .toml file or the name of a built-in scenario")
    b.add_argument("--engine", required=True, choices=("sglang", "vllm"), help="the engine whose releases to run")
    b.add_argument("--releases", default="..", metavar="A..B", help="the releases, both ends included (default every known one)")
    add_flags(b, ScenarioOverrides)
    add_flags(b, CheckOptions)
    add_flags(b.add_argument_group("attention check"), AttentionConfig)
    add_flags(b.add_argument_group("engine options"), EngineChoice, skip=("engine", "vllm_source", "sglang_source", "engine_partial"))
    add_flags(b, WorldOptions, only=("in_process", "timeout"))
    b.add_argument("--json", action="store_true", help="print one JSON document")
    i = sub.add_parser("info", help="the engine's version, what it loaded, and what makes each decision")
    add_engine_arguments(i)
    i.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    return {"fetch": _fetch, "releases": _releases, "bisect": _bisect, "info": _info}[args.engine_command](args)


def _fetch(args) -> int:
    core = core_requirement(args.requirement)  # checked before anything is downloaded
    print(fetch(args.requirement, args.dest))
    if core is not None:  # a plugin over vLLM: the release it runs on too, beside it
        print(fetch(core, None if args.dest is None else Path(args.dest).parent / core.replace("==", "-")))
    return EXIT_OK


def _info(args) -> int:
    engine = engine_choice(args).build()  # resolves DCPSIM_VLLM_SOURCE and validates, as a run does
    info = engine_info(engine)
    tree = getattr(engine, "tree", None)
    if tree is not None:
        info["source"] = str(tree.root)
        info["loaded"] = sorted(tree.modules)
        info["stubbed"] = sorted(tree.stubbed)
        info["kernel_launches"] = describe_launches()
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"engine {info['name']}" + (f" {info['version']}" if info.get("version") else ""))
    if info.get("core_version"):
        print(f"  over vLLM {info['core_version']} (its core: --vllm-source)")
    if tree is not None:
        print(f"  source: {info['source']}")
        print(f"  loaded: {', '.join(info['loaded'])}")
        print(f"  stubbed: {plural(len(info['stubbed']), 'module')}")
        print(f"  kernel launches: {info['kernel_launches']}")
    if info.get("partial"):
        print(f"  --engine-partial: the reference makes {', '.join(info['partial'])} (the tree holds them in no known shape)")
    for decision, who in info["decisions"].items():
        print(f"  {decision}: {who}")
    if info.get("scheduler_decisions"):
        print("  scheduler decisions:")
        for decision, who in info["scheduler_decisions"].items():
            print(f"    {decision}: {who}")
    return EXIT_OK


def core_requirement(requirement: str) -> str | None:
    """The vLLM release a vllm-ascend requirement runs on (``vllm==0.23.0``), or None."""
    package, _, version = pinned(requirement).partition("==")
    if package != "vllm-ascend":
        return None
    if version not in VLLM_OF:
        raise ConfigError(f"engine fetch: vllm-ascend {version} is not a release dcpsim knows ({', '.join(VLLM_OF)})")
    return f"vllm=={VLLM_OF[version]}"


def _releases(args) -> int:
    trees = {e: getattr(args, f"{e.replace('-', '_')}_source") for e in RELEASE_TABLES if getattr(args, f"{e.replace('-', '_')}_source")}
    engines = [args.engine] if args.engine else sorted(trees) or sorted(RELEASE_TABLES)
    docs = []
    for engine in engines:
        if engine in trees:
            docs.append(tree_document(engine, trees[engine], args.vllm_runner if engine == "vllm" else ""))
        else:
            docs.append(table_document(engine))
    if args.json:
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
        return EXIT_OK
    for doc in docs:
        print("\n".join(_tree_lines(doc) if "decisions" in doc else _table_lines(doc)))
    return EXIT_OK


def _table_lines(doc: dict) -> list[str]:
    label = RELEASE_TABLES[doc["engine"]].label
    lines = [f"{label} {doc['releases'][0]}..{doc['newest']} ({plural(len(doc['releases']), 'release')}): {', '.join(doc['releases'])}"]
    for variant, decisions in doc["variants"].items():
        for d in decisions:
            if variant and d["decision"] == "write_slots":
                lines.append(f"  {d['decision']} (--vllm-runner {variant}):")
            elif variant and variant != "v2":
                continue
            else:
                lines.append(f"  {d['decision']}:")
            for s in d["shapes"]:
                lines.append(f"    {s['name']}: {s['code']} in {_span(s['releases'])}")
            if d["absent"]:
                lines.append(f"    none in {_span(d['absent'])}: {d['absent_reason']}")
    return lines


def _tree_lines(doc: dict) -> list[str]:
    label = RELEASE_TABLES[doc["engine"]].label
    known = "a known release" if doc["known_release"] else "not a known release: every decision bound by its code alone"
    lines = [f"{label} {doc['version']} at {doc['source']} ({known})"]
    for row in doc["decisions"]:
        lines.append(f"  {row['decision']}: {row['state']}: {row['detail']}")
    bad = [r["decision"] for r in doc["decisions"] if r["state"] == "mismatch"]
    if bad:
        lines.append(
            f"  {plural(len(bad), 'decision')} in no known shape ({', '.join(bad)}): a run is exit 2; "
            "--engine-partial lets the reference make them"
        )
    return lines


def _span(releases: list[str]) -> str:
    return releases[0] if len(releases) == 1 else f"{releases[0]}..{releases[-1]}"


def _bisect(args) -> int:
    releases = release_range(args.engine, args.releases)
    options = {}
    for tree in (ScenarioOverrides, CheckOptions, AttentionConfig, EngineChoice, WorldOptions):
        defaults = {leaf: value for leaf, value in flag_values(tree, build_defaults(tree)).items()}
        options.update({k: v for k, v in flag_values(tree, args).items() if v != defaults.get(k) and k not in ("engine",)})
    prefix = f"{args.engine}_"
    options = {k: v for k, v in options.items() if not k.startswith(("vllm_", "sglang_")) or k.startswith(prefix)}

    def said(row) -> None:
        if not args.json:
            print(row.row(), file=sys.stderr, flush=True)

    report = bisect(args.scenario, args.engine, releases, options=options, fetch=fetch, run=_run_one, on_release=said)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return EXIT_OK


def _run_one(scenario, **options):
    """One release's run, as ``dcpsim run`` makes it (its notes left out of the table)."""
    resolved, report, _ = launch_options(scenario, options)
    if report is None:
        raise ConfigError(f"{resolved.source}: engine bisect runs no P/D scenario yet")
    return report


def build_defaults(tree):
    """A namespace of ``tree``'s leaves at their defaults (what an unset flag parses to)."""
    import argparse

    p = argparse.ArgumentParser()
    add_flags(p, tree)
    return p.parse_args([])
