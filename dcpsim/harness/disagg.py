"""A disaggregated prefill/decode run: two instances in one gloo world, joined by a KV connector.

The world has ``P + D`` processes (each instance's ``pcp * tp``): world ranks ``0 .. P-1``
are the prefill instance, ``P .. P+D-1`` the decode instance, each instance a gloo subgroup
(``dist.new_group``) that its own run (``run_rank``: scheduler, worker, checker) uses for
every collective. An instance's own DCP, PCP and TP groups are made on every process of
the world at the job's start (``harness.groups.make_world_groups``: ``new_group`` is
collective over the whole world), so the instance's run finds them made. One world
rather than two joined by a store: one supervisor (``world.run_world``) sees both
instances, so a crash or a hang on either side is reported with every rank's progress,
and the transfer is plain point-to-point ``send``/``recv`` of the default group.

1. The prefill instance runs every prompt (requests end after the first output token) and
   is verified like any run; as each request finishes, each rank reads the prompt's pages
   through its block table (``engine.connector.read_pages``).
2. The connector transfers every prompt: for each (prefill rank, decode rank) pair, one
   tensor of the entries its routes move (``KVConnector.routes``), sent with ``isend``.
   A route's prefill rank is a shard of the connector layout (``instance_layout``): the
   prefill instance's first DCP group serves the KV (``shard_ranks``; with PCP and several
   DCP groups the others are replicas, and with ``W = 1`` rank 0 alone serves it).
3. The decode instance admits each request with its prompt's KV loaded (all but the last
   prompt token computed), writes the received entries at the slots its own block table
   gives, decodes the rest and is verified like any run. The checker never sees the
   connector's math: it judges the decode stores from the decode instance's scenario.

The decode instance is one DCP group (``require_one_dcp_group``): no PCP, TP = its W.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from dcpsim.engine.connector import (
    CONNECTORS,
    LoadedScheduler,
    gather_entries,
    read_pages,
    write_loaded,
)
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.request import Status
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.harness.collectives import GlooCollectives
from dcpsim.harness.job import Job
from dcpsim.harness.rank import run_rank
from dcpsim.model.kinds import Storage
from dcpsim.model.kv_entry import FIELDS
from dcpsim.model.scenario import Scenario
from dcpsim.scenarios.disagg import ROLES, check_disaggregation, instance_layout, instance_scenario, shard_ranks
from dcpsim.verify.report import RunReport


def require_one_dcp_group(scenario: Scenario) -> None:
    """The decode instance loads each prompt into one DCP group: PCP 1 and TP = its W (exit 2)."""
    layout = instance_scenario(scenario, "decode").config.parallel_layout
    if layout.pcp > 1 or layout.world_size != layout.dcp:
        raise ConfigError(
            f"disaggregated.decode: prefill_context_parallel_size {layout.pcp}, tensor_parallel_size {layout.tp}, "
            f"decode_context_parallel_size {layout.dcp}: the decode instance of a P/D run is one DCP group "
            "(prefill_context_parallel_size 1, tensor_parallel_size = decode_context_parallel_size)"
        )


@dataclass(frozen=True)
class PDJob:
    scenario: Scenario
    inject: str | None = None
    """A P/D fault (``dcpsim.engine.faults.pd``)."""

    def __post_init__(self) -> None:
        from dcpsim.engine.faults import get_pd_fault

        if self.scenario.disaggregated is None:
            raise ConfigError(f"scenario {self.scenario.name!r} has no [disaggregated] table")
        fault = get_pd_fault(self.inject)
        kind = self.scenario.disaggregated.kv_connector
        if self.inject and fault.connector(kind) is not None and fault.kv_connector != kind:
            raise ConfigError(
                f"--inject {self.inject}: the fault is in the {fault.kv_connector} connector; this run uses "
                f"kv_connector = {kind} (--kv-connector {fault.kv_connector})"
            )

    @property
    def sizes(self) -> tuple[int, int]:
        """Each instance's processes (``pcp * tp``)."""
        pd = self.scenario.disaggregated
        return pd.prefill.world_size, pd.decode.world_size

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    def fault(self):
        from dcpsim.engine.faults import get_pd_fault

        return get_pd_fault(self.inject)

    def instance(self, role: str) -> Scenario:
        return instance_scenario(self.scenario, role)

    def connector(self):
        return self.fault().connector(self.scenario.disaggregated.kv_connector) or CONNECTORS[self.scenario.disaggregated.kv_connector]()

    def pairs(self) -> dict[tuple[int, int], list]:
        """(prefill rank, decode rank) -> [(request index, group, Route)], in one order for both sides."""
        src, dst = instance_layout(self.scenario, "prefill"), instance_layout(self.scenario, "decode")
        groups = len(ReferenceEngine().geometries(self.instance("decode").layers, self.instance("decode").config))
        connector = self.connector()
        out: dict[tuple[int, int], list] = {}
        for i, req in enumerate(self.scenario.requests):
            for route in connector.routes(req.prompt_len, src, dst):
                for g in range(groups):
                    out.setdefault((route.src_rank, route.dst_rank), []).append((i, g, route))
        return out


def prepare_pd(job: PDJob) -> dict:
    """Validate a P/D run before any rank starts (exit 2 naming the field); dry-run both
    instances' schedules. Returns their summaries."""
    scenario = job.scenario
    check_disaggregation(scenario)
    require_one_dcp_group(scenario)
    summaries = {}
    for role in ROLES:
        sc = job.instance(role)
        engine = ReferenceEngine()
        geometries = engine.geometries(sc.layers, sc.config)
        for g in geometries:
            if g.storage is not Storage.PAGED or g.tokens_per_state != 1 or g.draft or not (g.sharded or g.dcp_size == 1):
                raise ConfigError(
                    f"disaggregated: group {g.name} ({g.storage}, {'sharded' if g.sharded else 'replicated'}) "
                    "is not supported in P/D runs yet: every KV-cache group must be a sharded, paged, "
                    "uncompressed attention cache of the target model"
                )
        if len({g.block_size for g in geometries}) != 1:
            raise ConfigError("disaggregated: P/D runs need one block size for every KV-cache group")
        scheduler = (LoadedScheduler if role == "decode" else Scheduler)(sc, engine, geometries)
        for _ in scheduler.plans():
            pass
        summaries[role] = scheduler.summary
    return summaries


# ----------------------------------------------------------------------------- rank side


class PrefillInstance:
    """Reads each finished prompt's pages (the connector's source blocks)."""

    scheduler_class = Scheduler

    def __init__(self):
        self.pages: dict[int, dict[int, np.ndarray]] = {}

    def before_write(self, plan, runner) -> None:
        pass

    def after_step(self, plan, runner, scheduler) -> None:
        for req in scheduler.requests:
            if req.status is Status.FINISHED and req.index not in self.pages:
                self.pages[req.index] = {
                    g: read_pages(runner, g, plan.rows_after[g][req.index])
                    for g in range(len(runner.stores))
                    if req.index in plan.rows_after[g]
                }


class DecodeInstance:
    """Writes each admitted prompt's received entries at its own slots."""

    scheduler_class = LoadedScheduler

    def __init__(self, received: dict):
        self.received = received
        self.written = 0

    def before_write(self, plan, runner) -> None:
        if plan.loaded:
            self.written += write_loaded(plan, runner, self.received)

    def after_step(self, plan, runner, scheduler) -> None:
        pass


def _send_prompts(pairs, pages, rank: int, prefill_size: int, shards: list[int]) -> int:
    """``rank``'s routes (``shards``: the instance rank of each source shard)."""
    import torch
    import torch.distributed as dist

    handles, sent = [], 0
    for (p, d), items in sorted(pairs.items()):
        if shards[p] != rank:
            continue
        empty = np.zeros((0, len(FIELDS)), np.int64)
        chunks = [gather_entries(pages.get(i, {}).get(g, empty), route.src_local) for i, g, route in items]
        tensor = torch.from_numpy(np.concatenate(chunks))
        handles.append(dist.isend(tensor, dst=prefill_size + d))
        sent += len(tensor)
    for h in handles:
        h.wait()
    return sent


def _receive_prompts(pairs, rank: int, shards: list[int]) -> dict:
    import torch
    import torch.distributed as dist

    buffers, handles = [], []
    for (p, d), items in sorted(pairs.items()):
        if d != rank:
            continue
        buf = torch.empty((sum(len(route.src_local) for _, _, route in items), len(FIELDS)), dtype=torch.int64)
        handles.append(dist.irecv(buf, src=shards[p]))
        buffers.append((items, buf))
    for h in handles:
        h.wait()
    parts: dict[int, dict[int, list]] = {}
    for items, buf in buffers:
        entries, at = buf.numpy(), 0
        for i, g, route in items:
            n = len(route.dst_local)
            parts.setdefault(i, {}).setdefault(g, []).append((route.dst_local, entries[at : at + n]))
            at += n
    return {
        i: {g: (np.concatenate([a for a, _ in chunks]), np.concatenate([b for _, b in chunks])) for g, chunks in by_group.items()}
        for i, by_group in parts.items()
    }


def pd_rank(job: PDJob, rank: int, world: GlooCollectives):
    """One rank of either instance of ``job``; ``world``: the default world's collectives
    (world ranks past ``job.world_size`` only take part in making the groups, which every
    rank of the world must)."""
    from dcpsim.harness.groups import make_world_groups
    from dcpsim.harness.world import set_progress

    prefill_size = job.sizes[0]
    instances = world.subgroup("pd-instance", [list(range(prefill_size)), list(range(prefill_size, job.world_size))])
    make_world_groups(world, [(0, job.instance("prefill").config), (prefill_size, job.instance("decode").config)])
    if rank >= job.world_size:
        return None
    pairs = job.pairs()
    fault = job.fault()
    shards = shard_ranks(job.scenario, "prefill")
    if rank < prefill_size:
        instance = PrefillInstance()
        report = run_rank(Job(job.instance("prefill")), instances, engine=fault.engine("prefill"), instance=instance)
        set_progress(report.steps, "kv transfer (send)")
        sent = _send_prompts(pairs, instance.pages, rank, prefill_size, shards)
        return "prefill", report, sent
    set_progress(None, "kv transfer (receive)")
    instance = DecodeInstance(_receive_prompts(pairs, rank - prefill_size, shards))
    report = run_rank(Job(job.instance("decode")), instances, engine=fault.engine("decode"), instance=instance)
    return "decode", report, instance.written


def pd_world(jobs: list[PDJob], rank: int, world_size: int) -> list:
    """``world.run_world`` target: the jobs in turn, each on the world's first ranks (their
    process groups shared: gloo groups are never freed)."""
    import torch.distributed as dist

    world = GlooCollectives(rank, world_size)
    out = []
    for job in jobs:
        out.append(pd_rank(job, rank, world))
        dist.barrier()  # the next job's groups start from a quiet world
    return out


# ----------------------------------------------------------------------------- parent side


@dataclass
class PDReport:
    scenario: str
    kv_connector: str
    prefill: RunReport
    decode: RunReport
    entries_sent: int = 0
    entries_written: int = 0
    inject: str | None = None
    wall_time_s: float = 0.0
    layouts: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.prefill.passed and self.decode.passed

    @property
    def failure(self):
        return self.prefill.failure or self.decode.failure

    def to_dict(self) -> dict:
        return dict(
            scenario=self.scenario,
            passed=self.passed,
            kv_connector=self.kv_connector,
            inject=self.inject,
            layouts=self.layouts,
            entries_sent=self.entries_sent,
            entries_written=self.entries_written,
            wall_time_s=round(self.wall_time_s, 3),
            prefill=json.loads(self.prefill.to_json()),
            decode=json.loads(self.decode.to_json()),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def text(self) -> str:
        lay = " -> ".join(
            f"{role} W={v['decode_context_parallel_size']} I={v['cp_kv_cache_interleave_size']} "
            f"B={v['block_size']} PCP={v['prefill_context_parallel_size']} TP={v['tensor_parallel_size']}"
            for role, v in self.layouts.items()
        )
        lines = [
            f"P/D {self.scenario} via {self.kv_connector}: {lay}",
            f"prefill instance: {self.prefill.text()}",
            f"kv transfer: {self.entries_sent} entries sent, {self.entries_written} written on the decode ranks",
            f"decode instance: {self.decode.text()}",
            "P/D PASSED" if self.passed else "P/D FAILED",
        ]
        return "\n".join(lines)


def instance_sizes(scenario: Scenario, role: str) -> dict:
    """An instance's sizes as run (``W`` its DCP group's) and its connector layout's shards."""
    config = instance_scenario(scenario, role).config
    layout = instance_layout(scenario, role)
    return dict(
        decode_context_parallel_size=config.decode_context_parallel_size,
        prefill_context_parallel_size=config.prefill_context_parallel_size,
        tensor_parallel_size=config.parallel_layout.tp,
        cp_kv_cache_interleave_size=layout.cp_kv_cache_interleave_size,
        block_size=layout.block_size,
        kv_shards=layout.cp_size,
    )


def run_pd(job: PDJob, *, timeout: float = 30.0, deadline: float | None = None, on_wait=None) -> PDReport:
    """Validate, run the world of both instances, merge each instance's rank reports."""
    return run_pd_batch([job], timeout=timeout, deadline=deadline, on_wait=on_wait)[0]


def run_pd_batch(jobs: list[PDJob], *, timeout: float = 30.0, deadline: float | None = None, on_wait=None) -> list[PDReport]:
    """Several P/D runs in turn in one world of the largest ``P + D`` (world start-up and
    forks once); each validated first."""
    import time

    from dcpsim.harness.batch import merge_rank_reports
    from dcpsim.harness.world import run_world

    for job in jobs:
        prepare_pd(job)
    start = time.perf_counter()
    if deadline is None:
        deadline = 2 * timeout + 30 + 10 * (len(jobs) - 1)
    per_rank = run_world(
        pd_world,
        jobs,
        world_size=max(j.world_size for j in jobs),
        pg_timeout_s=timeout,
        deadline_s=deadline,
        preload=("dcpsim.harness.disagg",),
        on_wait=on_wait,
    )
    seconds = (time.perf_counter() - start) / len(jobs)
    reports = []
    for k, job in enumerate(jobs):
        results = [ranks[k] for ranks in per_rank if ranks[k] is not None]
        by_role = {role: [r for r in results if r[0] == role] for role in ROLES}
        layouts = {role: instance_sizes(job.scenario, role) for role in ROLES}
        reports.append(
            PDReport(
                scenario=job.scenario.name,
                kv_connector=job.scenario.disaggregated.kv_connector,
                prefill=merge_rank_reports([r[1] for r in by_role["prefill"]]),
                decode=merge_rank_reports([r[1] for r in by_role["decode"]]),
                entries_sent=sum(r[2] for r in by_role["prefill"]),
                entries_written=sum(r[2] for r in by_role["decode"]),
                inject=job.inject,
                wall_time_s=seconds,
                layouts=layouts,
            )
        )
    return reports
