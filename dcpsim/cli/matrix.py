"""``dcpsim matrix``: the correctness matrix (scenarios x W x I x B), with a closing table.

``--full`` takes the full grid (``campaigns.grid``); ``--shard K/N`` runs one shard of the
cell list (``campaigns.shard``), and ``dcpsim merge`` joins the shards' reports.
"""

from __future__ import annotations

import json
import sys

from dcpsim.campaigns import junit
from dcpsim.campaigns import matrix as mx
from dcpsim.campaigns import shard as sh
from dcpsim.campaigns.matrix_plan import entries as cell_entries
from dcpsim.campaigns.matrix_plan import matrix_cells, shard_indices
from dcpsim.campaigns.pd_matrix import parse_pairs, pd_table, run_pd_matrix
from dcpsim.cli.flags import add_flags, options_from
from dcpsim.cli.lists import size_list
from dcpsim.cli.options import add_engine_arguments, add_force_argument, add_verify_argument, engine_choice
from dcpsim.cli.progress import print_waiting, progress_view
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from dcpsim.harness.budget import cpu_warning
from dcpsim.harness.world_options import WorldOptions
from dcpsim.plural import plural
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names
from dcpsim.verify.options import CheckOptions

DEFAULT_DCP = "1,2,3,4,8"
DEFAULT_INTERLEAVE = "1,2,4,8,16,B"


def add_arguments(p) -> None:
    add_engine_arguments(p)
    p.add_argument("scenarios", nargs="*", help="scenario names or files (default: every built-in)")
    p.add_argument("--dcp", "--decode-context-parallel-size", dest="dcp", help=f"comma list of DCP sizes (default {DEFAULT_DCP})")
    p.add_argument(
        "--interleave",
        "--cp-kv-cache-interleave-size",
        dest="interleave",
        help=f"comma list of interleave sizes; B = the scenario's page size (default {DEFAULT_INTERLEAVE})",
    )
    p.add_argument("--block-size", help="comma list of block sizes (default: each scenario's)")
    p.add_argument(
        "--full",
        action="store_true",
        help="the full grid: W 1..8 x every I dividing B, W 1,2,3,4,8 x every I dividing B/2 at block "
        "size B/2, Bk = B/2 cells, and attention cells (not with --dcp, --interleave, --block-size)",
    )
    p.add_argument(
        "--shard",
        metavar="K/N",
        help="run only shard K of N (1-based): a balanced share of the runs of at most 12 cells of "
        "one world; join the shards' --json or --junit reports with dcpsim merge",
    )
    p.add_argument("--junit", metavar="FILE", help="also write a JUnit XML report, one testcase per cell")
    p.add_argument(
        "--pcp",
        "--prefill-context-parallel-size",
        dest="pcp",
        help="comma list of PCP sizes (default: each scenario's); a cell's world is PCP x TP processes, TP the smallest that fits its W",
    )
    add_flags(p, WorldOptions, only=("in_process", "timeout"))
    p.add_argument("--json", action="store_true", help="print every cell as JSON")
    p.add_argument(
        "--pd",
        metavar="P:D,...",
        help="P/D cells instead: each scenario with a [disaggregated] table at these (prefill W, decode W) "
        "pairs, e.g. 1:2,2:4,4:2 (default scenarios: the built-ins with a [disaggregated] table)",
    )
    add_force_argument(p)
    add_verify_argument(p)


def _run_pd(args) -> int:
    pairs = parse_pairs(args.pd)
    names = args.scenarios or [n for n in builtin_scenario_names() if load_scenario(n).disaggregated is not None]
    cells = run_pd_matrix(names, pairs, world=options_from(WorldOptions, args), on_wait=print_waiting)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "cell": c.id,
                        "status": c.status,
                        "reason": c.reason,
                        "seconds": round(c.seconds, 3),
                        "report": c.report.to_dict() if c.report else None,
                    }
                    for c in cells
                ],
                indent=2,
                default=str,
            )
        )
    else:
        print(pd_table(cells))
    return EXIT_CHECK_FAILED if any(c.status == "FAIL" for c in cells) else EXIT_OK


def cells_of(args) -> list:
    """The matrix's full cell list, from the scenarios and the grid flags."""
    lists = dict(
        dcps=size_list(args.dcp, "--dcp", "decode_context_parallel_size") if args.dcp is not None else None,
        interleaves=[str(i) for i in size_list(args.interleave, "--interleave", "cp_kv_cache_interleave_size", page=True)]
        if args.interleave is not None
        else None,
        block_sizes=size_list(args.block_size, "--block-size", "block_size") if args.block_size is not None else None,
        pcps=size_list(args.pcp, "--pcp", "prefill_context_parallel_size") if args.pcp is not None else None,
    )
    if args.full:
        flags = {"dcps": "--dcp", "interleaves": "--interleave", "block_sizes": "--block-size", "pcps": "--pcp"}
        given = [flags[key] for key, value in lists.items() if value is not None]
        if given:
            raise ConfigError(f"--full fixes the grid: drop {', '.join(given)}")
    elif lists["dcps"] == []:
        raise ConfigError(f"--dcp: expected a comma list of integers, got {args.dcp!r}")
    return matrix_cells(args.scenarios, full=args.full, force=args.force, **{k: v for k, v in lists.items() if not args.full})


def run(args) -> int:
    if args.pd:
        if args.full or args.shard is not None:
            raise ConfigError("--pd runs its own P/D cells: drop --full and --shard")
        return _run_pd(args)
    shard = sh.parse_shard(args.shard) if args.shard is not None else None
    world = options_from(WorldOptions, args)
    engine = engine_choice(args)
    check = options_from(CheckOptions, args)
    everything = cells_of(args)
    indices = shard_indices(everything, shard)
    results = [everything[i] for i in indices]
    pending = sum(r.status == mx.CellStatus.PENDING for r in results)
    if not pending:
        reasons = sorted({r.reason for r in results if r.reason})
        raise ConfigError(f"no cell can run ({plural(len(results), 'cell')}, every one skipped)" + (f": {reasons[0]}" if reasons else ""))
    warning = (
        None if args.in_process else cpu_warning(max(r.scenario.config.world_size for r in results if r.status == mx.CellStatus.PENDING))
    )
    if warning:
        print(warning, file=sys.stderr)
    where = f" (shard {shard[0]}/{shard[1]} of {plural(len(everything), 'cell')})" if shard else ""
    print(f"matrix: {plural(len(results), 'cell')}{where}, {pending} to run, {len(results) - pending} skipped", file=sys.stderr)
    with progress_view("matrix", pending) as view:
        mx.run_cells(
            results,
            engine=engine,
            check=check,
            world=world,
            progress=lambda res: view.done(mx.cell_line(res), ok=not res.status.bad),
            on_wait=view.waiting,
        )
    entries = cell_entries(results, everything, indices, shard=shard, engine=engine, check=check)
    if args.junit:
        junit.write(
            entries, args.junit, details={r.cell.id: r.report.text() for r in results if r.report is not None and not r.report.passed}
        )
    if args.json:
        print(json.dumps(entries, indent=2))
    else:
        print(mx.table(results))
    return EXIT_CHECK_FAILED if any(r.status.bad for r in results) else EXIT_OK
