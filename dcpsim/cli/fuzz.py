"""``dcpsim fuzz``: search random schedules for a failure, shrink it, save it, rerun it on gloo."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from dcpsim.campaigns.fuzz import describe, find_failure
from dcpsim.campaigns.fuzz_pd import check_pd
from dcpsim.cli.flags import add_flags, flag_args, options_from
from dcpsim.cli.options import add_engine_arguments, engine_choice
from dcpsim.cli.progress import print_waiting, progress_view
from dcpsim.engine.faults import get_fault, get_pd_fault
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from dcpsim.harness.world_options import WorldOptions
from dcpsim.plural import plural
from dcpsim.scenarios.dump import scenario_to_toml


def add_arguments(p) -> None:
    add_engine_arguments(p)
    p.add_argument("--inject", metavar="FAULT", help="search with a known DCP bug switched on (with --pd: a P/D fault)")
    p.add_argument(
        "--pd",
        action="store_true",
        help="draw disaggregated prefill/decode runs ([disaggregated]: a connector, prefill and decode instances), each on a gloo world",
    )
    p.add_argument("--examples", type=int, default=200, help="random schedules to try (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search")
    p.add_argument("--out", default=".", help="folder for the shrunk scenario (default: here)")
    add_flags(p, WorldOptions, only=("in_process", "timeout"))  # of the shrunk scenario's rerun


class _Watch:
    """Progress of the search (one line per example) and of the shrinking (one line per
    smaller failing schedule; the attempts in the status)."""

    def __init__(self, view):
        self.view = view
        self.searched = self.attempts = 0
        self.shrinking = False

    def example(self, scenario, report, seconds: float) -> None:
        verdict = "pass" if report.passed else "FAIL"
        if not self.shrinking:
            self.searched += 1
            self.view.done(f"{describe(scenario)}: {verdict} ({seconds:.2f} s)", ok=report.passed)
            if not report.passed:
                self.shrinking = True
                self.view.note(f"fuzz: example {self.searched} fails; shrinking it")
                self.view.restart("fuzz: shrinking", None)
            return
        self.attempts += 1
        if not report.passed:
            self.view.done(f"shrunk to {describe(scenario)} (attempt {self.attempts})", ok=False)
        else:
            self.view.status(f"{plural(self.attempts, 'attempt')}")


def run(args) -> int:

    if args.examples < 1:
        raise ConfigError(f"--examples must be an integer >= 1, got {args.examples}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    world = options_from(WorldOptions, args)
    (get_pd_fault if args.pd else get_fault)(args.inject)
    start = time.perf_counter()
    engine = engine_choice(args)
    if args.inject and not engine.is_reference:
        raise ConfigError(f"--inject switches on a fault of the reference engine; not with --engine {args.engine}")
    with progress_view("fuzz: searching", args.examples) as view:
        watch = _Watch(view)
        found = find_failure(args.inject, max_examples=args.examples, seed=args.seed, engine=engine, on_example=watch.example, pd=args.pd)
    searched = time.perf_counter() - start
    if found is None:
        print(f"fuzz: no failing schedule in {plural(watch.searched, 'random example')} ({searched:.1f} s)")
        return EXIT_OK
    name = f"fuzz-{args.inject or 'nofault'}-seed{args.seed}.toml"
    path = Path(args.out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    rerun = f"python -m dcpsim run {path}" + (f" --inject {args.inject}" if args.inject else "")
    if not engine.is_reference:
        rerun += " " + " ".join(shlex.quote(a) for a in flag_args(engine))
    header = (
        f"Shrunk failing schedule found by dcpsim fuzz in {searched:.1f} s "
        f"(--seed {args.seed}, --examples {args.examples}).\nRerun: {rerun}"
    )
    path.write_text(scenario_to_toml(found, header=header), encoding="utf-8")
    print(f"fuzz: shrunk failing schedule written to {path}", file=sys.stderr)
    if args.pd:  # P/D runs need a gloo world (process subgroups per instance)
        print("fuzz: rerunning it on a gloo world", file=sys.stderr)
        report = check_pd(found, args.inject, engine)
    else:
        print(f"fuzz: rerunning it on {'threads' if args.in_process else 'a gloo world'}", file=sys.stderr)
        (report,) = run_jobs([Job(found, engine=engine, inject=args.inject, world=world)], on_wait=print_waiting)
    print(report.text())
    print(f"rerun with: {rerun}")
    return EXIT_CHECK_FAILED
