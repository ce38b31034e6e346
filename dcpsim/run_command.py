"""``dcpsim run`` (a world of gloo ranks started here) and ``dcpsim worker`` (one rank under torchrun).

Both resolve the scenario the same way, validate it completely before any
rank starts, and end with the same verdict and exit code:
0 every check passed, 1 a check failed, 2 usage or scenario error,
3 harness failure (rank crash, timeout, rendezvous).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dcpsim.faults import get_fault
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError, DcpsimError
from dcpsim.scenario import Scenario


def add_scenario_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="a scenario .toml file or the name of a built-in scenario")
    p.add_argument("--decode-context-parallel-size", "--dcp", dest="dcp", type=int, metavar="W",
                   help="DCP world size (default: the scenario's; for worker: the torchrun world size)")
    p.add_argument("--cp-kv-cache-interleave-size", "--interleave", dest="interleave", type=int,
                   metavar="I", help="positions per rank before moving to the next one")
    p.add_argument("--block-size", type=int, metavar="B",
                   help="states per page of every paged layer (B tokens, B*R for compressed layers)")
    p.add_argument("--kernel-block-size", type=int, metavar="Bk",
                   help="attention-kernel block size in states (must divide B)")
    p.add_argument("--seed", type=int, help="changes token contents and acceptance patterns")
    p.add_argument("--verify-every", type=int, metavar="N", help="verify every N steps (and at the end)")
    p.add_argument("--paranoid", action="store_true",
                   help="also gather raw read views and reassemble them explicitly")
    p.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    p.add_argument("--inject", metavar="FAULT",
                   help="switch on a known DCP bug in the simulated engine (see dcpsim.faults); "
                        "the run must then fail")
    p.add_argument("--simulate-rank-failure", metavar="KIND:RANK:STEP",
                   help="make one rank raise, hang or exit (os._exit(17)) at a step, to check how "
                        "the harness reports a broken world (exit 3)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="process-group timeout in seconds (default 30)")
    a = p.add_argument_group("attention check")
    a.add_argument("--attention", action="store_true",
                   help="also store K/V vectors and check every step's decode attention: per-rank "
                        "attention over the local shard, LSE merge across ranks, full-context reference")
    a.add_argument("--lse-base", choices=("e", "2"), default="e",
                   help="base of the log-sum-exp the ranks compute and merge (default e)")
    a.add_argument("--attention-merge", choices=("allgather", "alltoall", "alternate"), default="alternate",
                   help="allgather: all-gather LSEs, reduce-scatter outputs over heads, gather the slices; "
                        "alltoall: all-to-all over heads; alternate (default): allgather on even steps, "
                        "alltoall on odd ones")
    a.add_argument("--attention-heads", type=int, default=8, metavar="H",
                   help="query heads (one shared latent KV head per group; default 8)")
    a.add_argument("--attention-head-dim", type=int, default=16, metavar="D",
                   help="width of K and of V vectors (default 16)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_scenario_arguments(p)
    p.add_argument("--deadline", type=float, metavar="S",
                   help="kill the world after S seconds (default: 2 * timeout + 30)")
    p.add_argument("--in-process", action="store_true",
                   help="run the ranks as threads of this process (no gloo; for quick debugging)")


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", help="a report written by run, worker or matrix with --json")
    p.add_argument("--cell", metavar="ID", help="with a matrix report: the cell to rerun (default: the first that failed)")
    p.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="process-group timeout in seconds")
    p.add_argument("--deadline", type=float, metavar="S", help="kill the world after S seconds")
    p.add_argument("--in-process", action="store_true", help="run the ranks as threads of this process")


def resolve_scenario(args, world_size: int | None = None) -> Scenario:
    from dcpsim.scenario_file import load_scenario

    scenario = load_scenario(args.scenario)
    dcp = args.dcp
    if world_size is not None:
        if dcp is not None and dcp != world_size:
            raise ConfigError(
                f"--decode-context-parallel-size {dcp} does not match the torchrun world size {world_size}"
            )
        dcp = world_size
    try:
        return scenario.with_overrides(
            decode_context_parallel_size=dcp,
            cp_kv_cache_interleave_size=args.interleave,
            block_size=args.block_size,
            kernel_block_size=args.kernel_block_size,
            seed=args.seed,
            verify_every=args.verify_every,
        )
    except ConfigError as exc:
        raise ConfigError(f"{scenario.source}: {exc}") from None


def make_job(args, scenario: Scenario):
    from dcpsim.simulation import Job, parse_rank_failure

    get_fault(args.inject)
    failure = None
    if args.simulate_rank_failure:
        failure = parse_rank_failure(args.simulate_rank_failure, scenario.config.decode_context_parallel_size)
    from dcpsim.attention.config import AttentionConfig

    attention = dict(
        attention=getattr(args, "attention", False),
        lse_base=getattr(args, "lse_base", "e"),
        attention_merge=getattr(args, "attention_merge", "alternate"),
        attention_heads=getattr(args, "attention_heads", 8),
        attention_head_dim=getattr(args, "attention_head_dim", 16),
    )
    AttentionConfig(heads=attention["attention_heads"], head_dim=attention["attention_head_dim"],
                    value_dim=attention["attention_head_dim"], lse_base=attention["lse_base"],
                    merge=attention["attention_merge"])  # validates before any rank starts
    return Job(scenario, paranoid=args.paranoid, inject=args.inject, rank_failure=failure, **attention)


def _finish(report, as_json: bool) -> int:
    print(report.to_json() if as_json else report.text())
    return EXIT_OK if report.passed else EXIT_CHECK_FAILED


def error_json(exc: DcpsimError) -> str:
    return json.dumps({"error": {"kind": type(exc).__name__, "message": str(exc)}, "exit_code": exc.exit_code})


def run(args) -> int:
    try:
        scenario = resolve_scenario(args)
        job = make_job(args, scenario)
    except DcpsimError as exc:
        if args.json:
            print(error_json(exc))
        raise
    return run_job(job, args)


def replay(args) -> int:
    """Rerun exactly the configuration and schedule recorded in a JSON report."""
    from dcpsim.replay import load_replay

    try:
        job = load_replay(args.report, args.cell)
    except DcpsimError as exc:
        if args.json:
            print(error_json(exc))
        raise
    return run_job(job, args)


def run_job(job, args) -> int:
    """Validate, start a world (or threads), verify, print; the exit code of the verdict."""
    from dcpsim.replay import replay_record
    from dcpsim.simulation import prepare, run_jobs

    scenario = job.scenario
    try:
        try:
            prepare(scenario)
        except ConfigError as exc:
            raise ConfigError(f"{scenario.source}: {exc}") from None
        start = time.perf_counter()
        (report,) = run_jobs([job], in_process=args.in_process, timeout=args.timeout, deadline=args.deadline)
        report.wall_time_s = time.perf_counter() - start
        report.replay = replay_record(job)
    except DcpsimError as exc:
        if args.json:
            print(error_json(exc))
        raise
    return _finish(report, args.json)


def worker(args) -> int:
    """One rank of a world started by torchrun (env://); rank 0 prints the report."""
    import torch.distributed as dist

    from dcpsim.launch import init_env_process_group
    from dcpsim.simulation import prepare, run_rank
    from dcpsim.runtime.collectives import GlooCollectives

    rank, world = init_env_process_group(args.timeout)
    try:
        scenario = resolve_scenario(args, world_size=world)
        prepare(scenario)
        start = time.perf_counter()
        report = run_rank(make_job(args, scenario), GlooCollectives(rank, world))
        ranks = [None] * world
        dist.all_gather_object(ranks, report.ranks[0])
        report.ranks = ranks
        report.wall_time_s = time.perf_counter() - start
        from dcpsim.replay import replay_record

        report.replay = replay_record(make_job(args, scenario))
    except DcpsimError as exc:
        if args.json and rank == 0:
            print(error_json(exc))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return EXIT_OK if report.passed else EXIT_CHECK_FAILED
    sys.stdout.flush()
    return _finish(report, args.json)
