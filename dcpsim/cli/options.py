"""What ``run``, ``worker`` and ``replay`` share: scenario flags, resolving a scenario,
building a ``Job``, running it and ending with the verdict's exit code.

Exit codes: 0 every check passed, 1 a check failed, 2 usage or scenario error,
3 harness failure (rank crash, timeout, rendezvous).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError, DcpsimError, HarnessError
from dcpsim.model.attention_config import DEFAULT_MAX_STEP_KEYS
from dcpsim.model.scenario import Scenario


def add_scenario_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="a scenario .toml file or the name of a built-in scenario")
    p.add_argument(
        "--decode-context-parallel-size",
        "--dcp",
        dest="dcp",
        type=int,
        metavar="W",
        help="DCP world size (default: the scenario's; for worker: the torchrun world size)",
    )
    p.add_argument(
        "--prefill-context-parallel-size",
        "--pcp",
        dest="pcp",
        type=int,
        metavar="P",
        help="prefill context parallel size: prefills are split over P ranks and their KV "
        "all-gathered; the world is P x TP processes (default: the scenario's, else 1)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp",
        type=int,
        metavar="T",
        help="tensor parallel size (default: the scenario's, else W without PCP and the smallest that fits with it)",
    )
    p.add_argument(
        "--cp-kv-cache-interleave-size",
        "--interleave",
        dest="interleave",
        type=int,
        metavar="I",
        help="positions per rank before moving to the next one",
    )
    p.add_argument("--block-size", type=int, metavar="B", help="states per page of every paged layer (B tokens, B*R for compressed layers)")
    p.add_argument("--kernel-block-size", type=int, metavar="Bk", help="attention-kernel block size in states (must divide B)")
    p.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        metavar="N",
        help="pad uniform decode steps of at most N tokens to a captured CUDA-graph size "
        "(dummy requests that must write nothing; default: the scenario's, 0 = off)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        default=None,
        help="two batches in flight: sliding-window and chunked-local caps reserve for both",
    )
    p.add_argument(
        "--mamba-cache-mode",
        choices=("none", "align"),
        help="every Mamba layer's state layout: none (one block holds the state) or align "
        "(position-indexed state blocks of the cache block size)",
    )
    p.add_argument("--seed", type=int, help="changes token contents and acceptance patterns")
    p.add_argument("--verify-every", type=int, metavar="N", help="verify every N steps (and at the end)")
    add_verify_argument(p)
    p.add_argument("--paranoid", action="store_true", help="also gather raw read views and reassemble them explicitly")
    p.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    p.add_argument(
        "--inject", metavar="FAULT", help="switch on a known DCP bug in the engine under test (see selftest --list); the run must then fail"
    )
    p.add_argument(
        "--simulate-rank-failure",
        metavar="KIND:RANK:STEP",
        help="make one rank raise, hang or exit (os._exit(17)) at a step, to check how the harness reports a broken world (exit 3)",
    )
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="process-group timeout in seconds (default 30)")
    add_force_argument(p)
    add_engine_arguments(p)
    a = p.add_argument_group("attention check")
    a.add_argument(
        "--attention",
        action="store_true",
        help="also store K/V vectors and check every step's decode attention: per-rank "
        "attention over the local shard, LSE merge across ranks, full-context reference",
    )
    a.add_argument("--lse-base", choices=("e", "2"), default="e", help="base of the log-sum-exp the ranks compute and merge (default e)")
    a.add_argument(
        "--attention-merge",
        choices=("allgather", "alltoall", "alternate"),
        default="alternate",
        help="allgather: all-gather LSEs, reduce-scatter outputs over heads, gather the slices; "
        "alltoall: all-to-all over heads; alternate (default): allgather on even steps, "
        "alltoall on odd ones",
    )
    a.add_argument(
        "--attention-heads", type=int, default=8, metavar="H", help="query heads (one shared latent KV head per group; default 8)"
    )
    a.add_argument("--attention-head-dim", type=int, default=16, metavar="D", help="width of K and of V vectors (default 16)")
    a.add_argument(
        "--attention-max-step-keys",
        type=int,
        default=DEFAULT_MAX_STEP_KEYS,
        metavar="N",
        help="the step rule: a (group, request) whose context is at most N keys is checked every "
        "step; a longer one on its first and last step and every ceil(keys / N)-th step "
        f"(default {DEFAULT_MAX_STEP_KEYS})",
    )


def add_force_argument(p: argparse.ArgumentParser) -> None:
    """``--force``: run even where the estimate of the run's memory says it does not fit."""
    p.add_argument(
        "--force",
        action="store_true",
        help="run even if the estimate of the run's memory (ranks, KV stores, block tables, "
        "schedule) exceeds what the machine has available",
    )


def check_seconds(flag: str, value: float | None) -> None:
    """A time limit must be a positive number of seconds (exit 2 before any rank starts)."""
    if value is not None and not (value > 0 and value != float("inf")):
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value:g}")


def check_run_budget(
    scenario: Scenario, args, *, in_process: bool = False, attention_width: int = 0, local_ranks: int | None = None, say: bool = True
) -> None:
    """Refuse (exit 2, with the figures) a run the machine cannot hold, before the parent's
    dry run allocates anything; one warning line (if ``say``) when the ranks outnumber the CPUs."""
    from dcpsim.harness.budget import check_budget, cpu_warning

    try:
        check_budget(
            scenario, in_process=in_process, force=getattr(args, "force", False), attention_width=attention_width, local_ranks=local_ranks
        )
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None
    ranks = scenario.config.world_size if local_ranks is None else local_ranks
    warning = None if in_process else cpu_warning(ranks)
    if warning and say:
        print(warning, file=sys.stderr)


def add_verify_argument(p: argparse.ArgumentParser, default: str | None = "incremental") -> None:
    """``--verify``: what each check re-reads (run, worker, matrix, replay)."""
    p.add_argument(
        "--verify",
        choices=("incremental", "full"),
        default=default,
        help="incremental (default): each check re-reads what the KV stores' and block tables' "
        "change records say can have changed, with a full sweep as each request finishes "
        "and at the end; full: every check re-reads every live index",
    )


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--engine`` and the vLLM engine's options (run, worker, matrix, selftest, fuzz)."""
    e = p.add_argument_group("engine under test")
    e.add_argument(
        "--engine",
        default="reference",
        metavar="NAME",
        help="reference (default), vllm (vLLM's own DCP code from --vllm-source), or MODULE:ATTR "
        "for a plugin implementing dcpsim.engine.interface.Engine",
    )
    e.add_argument(
        "--vllm-source",
        metavar="DIR",
        help="--engine vllm: a directory holding vllm/ (an unpacked wheel, a site-packages, a checkout); default $DCPSIM_VLLM_SOURCE",
    )
    e.add_argument(
        "--vllm-runner",
        choices=("v2", "v1"),
        default="v2",
        help="--engine vllm: the slot mapping kernel of model runner v2 (default) or v1",
    )
    e.add_argument(
        "--vllm-merge",
        action="store_true",
        help="--engine vllm with --attention: merge with vLLM's DCP correction kernel too (slow under "
        "Triton's interpreter: one program per token and head)",
    )


def engine_options(args) -> dict:
    """The ``Job`` fields of the engine flags."""
    return dict(engine=args.engine, vllm_source=args.vllm_source, vllm_runner=args.vllm_runner, vllm_merge=args.vllm_merge)


def add_world_arguments(p: argparse.ArgumentParser, *, timeout: bool = False) -> None:
    """The flags of a world started here (``run`` and ``replay``)."""
    if timeout:
        p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="process-group timeout in seconds")
    p.add_argument("--deadline", type=float, metavar="S", help="kill the world after S seconds (default: 2 * timeout + 30)")
    p.add_argument("--in-process", action="store_true", help="run the ranks as threads of this process (no gloo; for quick debugging)")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write a Chrome trace-event JSON timeline of every rank (steps, writes per group, "
        "verification, collectives and their bytes, the first failure) to FILE; open it in "
        "ui.perfetto.dev",
    )


def resolve_scenario(args, world_size: int | None = None) -> Scenario:
    from dcpsim.scenarios.load import load_scenario

    if args.seed is not None and args.seed < 0:  # as a file's seed
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    scenario = load_scenario(args.scenario)
    dcp = args.dcp
    pcp, tp = getattr(args, "pcp", None), getattr(args, "tp", None)
    if world_size is not None and (pcp or tp or scenario.config.prefill_context_parallel_size > 1):
        world_size = None  # checked against PCP x TP below
    elif world_size is not None:
        if dcp is not None and dcp != world_size:
            raise ConfigError(f"--decode-context-parallel-size {dcp} does not match the torchrun world size {world_size}")
        dcp = world_size
    try:
        return scenario.with_overrides(
            decode_context_parallel_size=dcp,
            cp_kv_cache_interleave_size=args.interleave,
            block_size=args.block_size,
            kernel_block_size=args.kernel_block_size,
            max_cudagraph_capture_size=getattr(args, "max_cudagraph_capture_size", None),
            async_scheduling=getattr(args, "async_scheduling", None),
            mamba_cache_mode=getattr(args, "mamba_cache_mode", None),
            prefill_context_parallel_size=pcp,
            tensor_parallel_size=tp,
            seed=args.seed,
            verify_every=args.verify_every,
        )
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None


def make_job(args, scenario: Scenario):
    """The run's ``Job``; every option is validated here, before any rank starts."""
    from dcpsim.harness.job import Job, parse_rank_failure

    failure = None
    if args.simulate_rank_failure is not None:
        failure = parse_rank_failure(args.simulate_rank_failure, scenario.config.world_size)
    return Job(
        scenario,
        paranoid=args.paranoid,
        inject=args.inject,
        rank_failure=failure,
        verify=args.verify,
        attention=args.attention,
        lse_base=args.lse_base,
        attention_merge=args.attention_merge,
        attention_heads=args.attention_heads,
        attention_head_dim=args.attention_head_dim,
        attention_max_step_keys=args.attention_max_step_keys,
        **engine_options(args),
    )


def finish(report, as_json: bool) -> int:
    print(report.to_json() if as_json else report.text())
    return EXIT_OK if report.passed else EXIT_CHECK_FAILED


def error_json(exc: DcpsimError) -> str:
    return json.dumps({"error": {"kind": type(exc).__name__, "message": str(exc)}, "exit_code": exc.exit_code})


@contextlib.contextmanager
def json_errors(as_json: bool):
    """``with json_errors(args.json): ...``: a ``DcpsimError`` inside also prints one JSON
    error document on stdout under ``--json`` (then propagates to the exit code)."""
    try:
        yield
    except DcpsimError as exc:
        if as_json and not getattr(exc, "json_printed", False):
            print(error_json(exc))
            exc.json_printed = True  # main() prints none of its own
        raise


def check_dry_run(job, args, say: bool = True) -> None:
    """The parent's dry run of the schedule: a bad scenario is exit 2; so is a
    ``--simulate-rank-failure`` step the schedule never reaches. A forced preemption that
    never fires, and a pool larger than ``kv_cache_tokens`` asked for, are one note each."""
    from dcpsim.harness.budget import pool_note
    from dcpsim.harness.rank import dry_run

    scenario = job.scenario
    try:
        found = dry_run(scenario)
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None
    if job.rank_failure is not None and job.rank_failure[2] >= found.steps:
        kind, rank, step = job.rank_failure
        raise ConfigError(
            f"--simulate-rank-failure {kind}:{rank}:{step}: the schedule of {scenario.name} has "
            f"{found.steps} steps (0-{found.steps - 1}), so the failure would never happen"
        )
    notes = [
        f"request {rid!r}: preempt_at_steps {step} never fires (the request is not running at step "
        f"{step}; the schedule has {found.steps} steps)"
        for rid, step in found.unfired_preemptions
    ]
    note = pool_note(scenario)
    for line in (notes + ([note] if note else [])) if say else ():
        print(f"dcpsim: note: {scenario.source}: {line}", file=sys.stderr)


def run_job(job, args) -> int:
    """Validate, start a world (or threads), verify, print; the exit code of the verdict."""
    from dcpsim.cli.progress import print_waiting
    from dcpsim.harness.batch import run_jobs
    from dcpsim.harness.replay import replay_record
    from dcpsim.harness.trace_file import Trace, check_trace_path

    scenario = job.scenario
    with json_errors(args.json):
        trace_path = check_trace_path(args.trace) if args.trace else None
        check_seconds("--timeout", args.timeout)
        check_seconds("--deadline", args.deadline)
        check_run_budget(scenario, args, in_process=args.in_process, attention_width=job.attention_config.kv_width if job.attention else 0)
        check_dry_run(job, args)
        trace = Trace(trace_path) if trace_path else None
        start = time.perf_counter()
        (report,) = run_jobs(
            [job], in_process=args.in_process, timeout=args.timeout, deadline=args.deadline, trace=trace, on_wait=print_waiting
        )
        report.wall_time_s = time.perf_counter() - start
        report.replay = replay_record(job)
    code = finish(report, args.json)
    if trace is not None:
        write_trace(trace, report)
    return code


def write_trace(trace, report) -> None:
    """Write ``--trace``'s file after the report; a write that fails now is exit 3."""
    try:
        count = trace.write(
            dict(
                scenario=report.scenario,
                decode_context_parallel_size=report.dcp_size,
                cp_kv_cache_interleave_size=report.interleave_size,
                passed=report.passed,
                steps=report.steps,
            )
        )
    except OSError as exc:
        raise HarnessError(f"--trace {trace.path}: could not write the trace: {exc}") from None
    print(f"dcpsim: trace of {count} events written to {trace.path} (open it in ui.perfetto.dev)", file=sys.stderr)
