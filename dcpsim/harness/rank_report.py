"""A rank's ``RunReport``, built in one constructor from a finished ``RankRun``: the verdict,
the configuration as the checker sees it, what the engine decided, and the rank's figures."""

from __future__ import annotations

import resource
import time
from typing import TYPE_CHECKING

from dcpsim.engine.registry import engine_info
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.report import Failure, RunReport

if TYPE_CHECKING:
    from dcpsim.harness.rank_run import RankRun


def group_info(groups: list[ExpectedGroup]) -> list[dict]:
    """The report's description of each group (the checker's view: the truth)."""
    return [
        dict(
            name=g.name,
            layers=len(g.layer_names),
            storage=g.storage,
            retention=g.retention,
            block_size=g.block_size,
            states_per_page=g.page_states,
            sharded=g.sharded,
            manager_block_size=g.manager_block_size,
        )
        for g in groups
    ]


def engine_groups(run: RankRun) -> list[dict]:
    """What the engine made of each group (its geometry)."""
    return [
        dict(
            name=g.name,
            sharded=g.sharded,
            manager_block_size=g.manager_block_size,
            block_table_width=g.block_table_width,
            page_size_bytes=g.page_size_bytes,
            max_memory_usage_bytes=g.max_memory_usage_bytes,
        )
        for g in run.geometries
    ]


def rank_figures(run: RankRun, bytes_sent: int) -> dict:
    """This rank's figures: where it sits in the grid, its memory, CPU and traffic."""
    par, coords = run.par, run.par.coords
    grid = {} if par.num_dcp_groups == 1 and par.layout.pcp == 1 else dict(
        pcp_rank=coords.pcp_rank, tp_rank=coords.tp_rank, dcp_group=coords.dcp_group, dcp_rank=coords.dcp_rank
    )  # fmt: skip
    return dict(
        rank=run.world.rank,
        **grid,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        cpu_seconds=time.process_time(),  # since the rank's process started (all its threads)
        kv_store_mb=run.view.kv_store_bytes / 2**20,
        bytes_sent=bytes_sent,
    )


def attention_figures(run: RankRun) -> dict:
    """The attention check's fields of the report (none without ``--attention``)."""
    if not run.attention_on:
        return {}
    v = run.verifier
    return dict(
        attention=run.job.attention.summary(),
        attention_checks=v.checks,
        attention_query_tokens=v.query_tokens,
        attention_sampled_checks=v.sampled,
        attention_skipped_checks=v.skipped,
        attention_checked_steps=v.checked_steps,
        attention_max_error=v.max_error if v.checks else None,
        attention_bytes=run.attention_bytes,
        attention_merges=dict(run.shard_attention.merges),
        attention_merged_by={code: dict(merges=m, rows=rows, of=of) for code, (m, rows, of) in run.shard_attention.merged_by.items()},
    )


def rank_report(run: RankRun, failure: Failure | None) -> RunReport:
    """The report of ``run`` on this rank, ending in ``failure`` (None: it passed)."""
    config, layout, checker, par = run.job.scenario.config, run.par.layout, run.checker, run.par
    bytes_sent = par.bytes_sent - run.bytes_before
    pcp_bytes = par.pcp.bytes_sent - run.pcp_bytes_before if par.pcp is not None else 0
    attention = attention_figures(run)
    return RunReport(
        scenario=run.job.scenario.name,
        source=run.job.scenario.source,
        dcp_size=config.decode_context_parallel_size,
        interleave_size=config.cp_kv_cache_interleave_size,
        kernel_block_size=config.kernel_block_size,
        groups=group_info(run.groups),
        passed=failure is None,
        prefill_context_parallel_size=layout.pcp,
        tensor_parallel_size=None if layout.world_size == layout.dcp and layout.pcp == 1 else layout.tp,
        steps=run.scheduler.step_index,
        verifications=checker.verifications,
        verified_indices=checker.verified_indices,
        verify_mode="incremental" if checker.incremental else "full",
        full_sweeps=checker.full_sweeps,
        metadata_checks=checker.metadata.checks if checker.metadata is not None else 0,
        bytes_gathered=bytes_sent - attention.get("attention_bytes", 0) - pcp_bytes,
        pcp_gather_bytes=pcp_bytes,
        schedule=run.scheduler.summary,
        failure=failure,
        ranks=[rank_figures(run, bytes_sent)],
        engine=dict(engine_info(run.engine, run.job.scenario), groups=engine_groups(run)),
        **attention,
    )
