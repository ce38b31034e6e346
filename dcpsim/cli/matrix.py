"""``dcpsim matrix``: the correctness matrix (scenarios x W x I x B), with a closing table."""

from __future__ import annotations

import json
import sys

from dcpsim.cli.options import add_engine_arguments, engine_options
from dcpsim.cli.progress import progress_view
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from dcpsim.harness.job import Job
from dcpsim.plural import plural


def add_arguments(p) -> None:
    add_engine_arguments(p)
    p.add_argument("scenarios", nargs="*", help="scenario names or files (default: every built-in)")
    p.add_argument("--dcp", "--decode-context-parallel-size", dest="dcp", default="1,2,3,4,8",
                   help="comma list of DCP sizes (default 1,2,3,4,8)")
    p.add_argument("--interleave", "--cp-kv-cache-interleave-size", dest="interleave", default="1,2,4,8,16,B",
                   help="comma list of interleave sizes; B = the scenario's page size (default 1,2,4,8,16,B)")
    p.add_argument("--block-size", default="", help="comma list of block sizes (default: each scenario's)")
    p.add_argument("--in-process", action="store_true", help="run ranks as threads (no gloo)")
    p.add_argument("--timeout", type=float, default=30.0, help="process-group timeout in seconds")
    p.add_argument("--json", action="store_true", help="print every cell as JSON")
    p.add_argument("--pd", metavar="P:D,...",
                   help="P/D cells instead: each scenario with a [disaggregated] table at these (prefill W, decode W) "
                        "pairs, e.g. 1:2,2:4,4:2 (default scenarios: the built-ins with a [disaggregated] table)")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected a comma list of integers, got {text!r}") from None


def _run_pd(args) -> int:
    from dcpsim.campaigns.pd_matrix import parse_pairs, pd_table, run_pd_matrix
    from dcpsim.cli.progress import print_waiting
    from dcpsim.scenarios.load import load_scenario
    from dcpsim.scenarios.registry import builtin_scenario_names

    pairs = parse_pairs(args.pd)
    names = args.scenarios or [n for n in builtin_scenario_names() if load_scenario(n).disaggregated is not None]
    cells = run_pd_matrix(names, pairs, timeout=args.timeout, on_wait=print_waiting)
    if args.json:
        print(json.dumps([{"cell": c.id, "status": c.status, "reason": c.reason, "seconds": round(c.seconds, 3),
                           "report": c.report.to_dict() if c.report else None} for c in cells], indent=2, default=str))
    else:
        print(pd_table(cells))
    return EXIT_CHECK_FAILED if any(c.status == "FAIL" for c in cells) else EXIT_OK


def run(args) -> int:
    from dcpsim.campaigns import matrix as mx
    from dcpsim.scenarios.registry import builtin_scenario_names

    if args.pd:
        return _run_pd(args)
    scenarios = args.scenarios or builtin_scenario_names()
    dcps = _int_list(args.dcp, "--dcp")
    interleaves = [x.strip() for x in args.interleave.split(",") if x.strip()]
    block_sizes = _int_list(args.block_size, "--block-size") or [None]
    results = mx.expand(scenarios, dcps, interleaves, block_sizes)
    pending = sum(r.status == mx.CellStatus.PENDING for r in results)
    engine = engine_options(args)
    Job.validate_engine(**engine)
    print(f"matrix: {plural(len(results), 'cell')}, {pending} to run, {len(results) - pending} skipped", file=sys.stderr)
    with progress_view("matrix", pending) as view:
        mx.run_cells(results, in_process=args.in_process, timeout=args.timeout, engine=engine,
                     progress=lambda res: view.done(mx.cell_line(res), ok=not res.status.bad), on_wait=view.waiting)
    if args.json:
        print(json.dumps([
            {"cell": r.cell.id, "status": r.status, "reason": r.reason, "seconds": round(r.seconds, 3),
             "report": json.loads(r.report.to_json()) if r.report else None}
            for r in results
        ], indent=2))
    else:
        print(mx.table(results))
    return EXIT_CHECK_FAILED if any(r.status.bad for r in results) else EXIT_OK
