"""``dcpsim selftest``: inject every known DCP bug where it applies; each must be caught,
and the correct engine must pass every baseline (``dcpsim.campaigns.selftest``)."""

from __future__ import annotations

import json

from dcpsim.campaigns.pd_selftest import PD_SCENARIO
from dcpsim.campaigns.selftest import bug_class_legend, format_table, row_line
from dcpsim.campaigns.selftest_options import canonical_options, options_text
from dcpsim.campaigns.selftest_plan import DETECTED, PASS, Plan
from dcpsim.campaigns.selftest_run import plan_of, run_selftest, runs_of
from dcpsim.cli.flags import add_flags, options_from
from dcpsim.cli.options import add_engine_arguments, engine_choice
from dcpsim.cli.progress import progress_view
from dcpsim.engine.faults import FAULTS, PD_FAULTS
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK
from dcpsim.harness.world_options import WorldOptions
from dcpsim.plural import plural


def add_arguments(p) -> None:
    add_engine_arguments(p)
    p.add_argument("--list", action="store_true", help="list every fault, the bug class it stands for and where it runs; run nothing")
    p.add_argument("--fault", action="append", metavar="NAME", help="only this fault (repeatable)")
    p.add_argument("--scenario", action="append", metavar="NAME", help="only this built-in scenario, for faults and baselines (repeatable)")
    add_flags(p, WorldOptions, only=("in_process", "timeout"))
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _list(plan: Plan, as_json: bool, pd_names: list[str]) -> int:
    entries = []
    for name in plan.faults:
        fault = FAULTS[name]
        runs = [dict(scenario=c.scenario, config=plan.resolved[(c.scenario, c.options)][2]) for c in plan.cases if c.fault == name]
        entries.append(
            dict(
                name=name,
                bug_class=fault.bug_class,
                description=fault.description,
                needs=dict(fault.needs),
                configs=[dict(c) for c in fault.configs],
                scenarios=list(fault.scenarios) if fault.scenarios else None,
                runs=runs,
                applicable=bool(runs),
                why_not=next((r.report for r in plan.rows if r.fault == name), None) if not runs else None,
            )
        )
    entries += _pd_entries(pd_names)
    if as_json:
        print(json.dumps({"faults": entries}, indent=2, default=str))
        return EXIT_OK
    for e in entries:
        print(e["name"])
        print(f"  bug class:   {e['bug_class']}")
        print(f"  what:        {e['description']}")
        if e["needs"]:
            print(f"  needs:       {options_text(canonical_options(e['needs']))}")
        where = ", ".join(f"{r['scenario']} ({r['config']})" for r in e["runs"]) or "-"
        print(f"  runs on:     {where}")
        if e["why_not"]:
            print(f"  not run:     {e['why_not']}")
    return EXIT_OK


def _pd_entries(names: list[str]) -> list[dict]:
    """``--list`` entries of the P/D faults: where selftest runs each (``campaigns.pd_selftest``)."""
    out = []
    for name in names:
        fault = PD_FAULTS[name]
        how = "nixl P/D run, prefill PCP = 2" if fault.needs_pcp else f"{fault.kv_connector} P/D run"
        out.append(
            dict(
                name=name,
                bug_class=fault.bug_class,
                description=fault.description,
                needs={},
                configs=[],
                scenarios=[fault.scenario or PD_SCENARIO],
                runs=[dict(scenario=fault.scenario or PD_SCENARIO, config=how)],
                applicable=True,
                why_not=None,
            )
        )
    return out


def pd_bug_class_legend(names: list[str]) -> list[str]:
    width = max(len(n) for n in names)
    return [f"  {n:<{width}}  {PD_FAULTS[n].bug_class}" for n in names]


def run(args) -> int:
    world = options_from(WorldOptions, args)
    plan, pd_chosen = plan_of(args.fault, args.scenario, dry_run=not args.list)
    if args.list:
        return _list(plan, args.json, pd_chosen)
    engine = engine_choice(args)
    with progress_view("selftest", runs_of(plan, pd_chosen)) as view:

        def progress(row):
            view.done(row_line(row), ok=row.outcome in (DETECTED, PASS))

        result = run_selftest(plan, pd_chosen, engine=engine, world=world, progress=progress, on_wait=view.waiting)
    if args.json:
        print(json.dumps(result.document(), indent=2, default=str))
    else:
        print(format_table(result.rows))
        print()
        print("bug classes (docs/dcp-semantics.md section 8):")
        print("\n".join(bug_class_legend(plan.faults)))
        if pd_chosen:
            print("\n".join(pd_bug_class_legend(pd_chosen)))
        if plan.skipped:
            print(
                f"({plural(len(plan.skipped), 'combination')} skipped: config invalid for the scenario, or a "
                "baseline identical to another one; see --json)"
            )
        print()
        print("\n".join(result.summary) + f" ({result.seconds:.1f} s)")
    return EXIT_OK if result.passed else EXIT_CHECK_FAILED
