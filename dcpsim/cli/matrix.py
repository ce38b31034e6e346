"""``dcpsim matrix``: the correctness matrix (scenarios x W x I x B), with a closing table."""

from __future__ import annotations

import json
import sys

from dcpsim.cli.options import add_engine_arguments, add_verify_argument, engine_options
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
    add_verify_argument(p)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected a comma list of integers, got {text!r}") from None


def run(args) -> int:
    from dcpsim.campaigns import matrix as mx
    from dcpsim.scenarios.registry import builtin_scenario_names

    scenarios = args.scenarios or builtin_scenario_names()
    dcps = _int_list(args.dcp, "--dcp")
    interleaves = [x.strip() for x in args.interleave.split(",") if x.strip()]
    block_sizes = _int_list(args.block_size, "--block-size") or [None]
    results = mx.expand(scenarios, dcps, interleaves, block_sizes)
    pending = sum(r.status == mx.CellStatus.PENDING for r in results)
    engine = engine_options(args)
    Job.validate_engine(**engine)
    engine["verify"] = args.verify
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
