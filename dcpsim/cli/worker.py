"""``dcpsim worker``: one rank of a world started by torchrun (``env://``); rank 0 prints
the report. The same rank code as ``run``, and the same merge of the ranks' reports."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from dcpsim.cli.launch import attention_width, check_dry_run, check_run_budget
from dcpsim.cli.options import add_scenario_arguments, job_from_args, scenario_from_args
from dcpsim.cli.outcome import finish, json_errors
from dcpsim.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from dcpsim.harness.collectives import GlooCollectives
from dcpsim.harness.rank_process import init_env_process_group
from dcpsim.harness.replay import replay_record
from dcpsim.harness.runner import merge_rank_reports, run_batch
from dcpsim.harness.world_options import WorldOptions


def add_arguments(p) -> None:
    add_scenario_arguments(p)


def run(args) -> int:
    with json_errors(args.json):
        WorldOptions(timeout=args.timeout)  # a bad --timeout is exit 2 before the rendezvous
        rank, world = init_env_process_group(args.timeout)
    try:
        with json_errors(args.json and rank == 0):
            scenario = scenario_from_args(args, world_size=world)
            if scenario.config.world_size != world:
                raise ConfigError(
                    f"prefill_context_parallel_size {scenario.config.prefill_context_parallel_size} x "
                    f"tensor_parallel_size {scenario.config.tp_size} = {scenario.config.world_size} "
                    f"processes, but the torchrun world size is {world}"
                )
            job = job_from_args(args, scenario)
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            check_run_budget(
                scenario,
                force=args.force,
                local_ranks=int(local) if local.isdigit() else None,
                say=rank == 0,
                attention_width=attention_width(job),
            )
            check_dry_run(job, say=rank == 0)
            start = time.perf_counter()
            (mine,) = run_batch([job], GlooCollectives(rank, world))
            reports = [None] * world
            dist.all_gather_object(reports, mine)
            report = merge_rank_reports(reports)
            report.wall_time_s = time.perf_counter() - start
            report.replay = replay_record(job)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return EXIT_OK if report.passed else EXIT_CHECK_FAILED
    sys.stdout.flush()
    return finish(report, args.json)
