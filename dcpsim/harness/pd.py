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

Each instance runs the job's engine (``PDJob.engine``: ``--engine``; a P/D fault's own
engine for an instance replaces it), its scheduler the engine's (``Engine.make_scheduler``).

1. The prefill instance runs every prompt (requests end after the first output token) and
   is verified like any run; as each request finishes, each rank reads the prompt's pages
   through its block table (``engine.connector.read_pages``).
2. The connector transfers every prompt: for each (prefill rank, decode rank) pair, one
   tensor of the entries its routes move (``KVConnector.routes``), sent with ``isend``.
   A route's prefill rank is a shard of the connector layout (``instance_layout``): the
   prefill instance's first DCP group serves the KV (``shard_ranks``; with PCP and several
   DCP groups the others are replicas, and with ``W = 1`` rank 0 alone serves it). Each
   route is a pull of the prefill blocks it reads, which the rank holds until their last
   expected pull (``engine.connector.PrefillBlocks``); the first serving rank then notifies
   every decode rank of each prompt's completion (``KVConnector.notices``), which the decode
   rank judges from its own layout (``judge_notices``).
3. The decode instance admits each request with its prompt's KV loaded (all but the last
   prompt token computed; its engine's scheduler is given the connector, ``PromptLoads``,
   so under ``--engine vllm`` vLLM's KV cache manager allocates them), writes the received entries at the slots its own block table
   gives, decodes the rest and is verified like any run. The checker never sees the
   connector's math: it judges the decode stores from the decode instance's scenario.
   With ``[disaggregated] load_steps`` the loads are asynchronous (``engine.async_load``:
   a request waits unscheduled while its entries arrive over later steps; new blocks are
   cleared before use, a load's blocks where it did not write once it completes), and
   every step's running requests' page tails are judged cleared (``verify.page_tail``).

The decode instance is one DCP group (``require_one_dcp_group``): no PCP, TP = its W.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from dcpsim.engine.async_load import AsyncLoadEngine, AsyncLoads
from dcpsim.engine.connector import PrefillBlocks, PrefillRelease, PromptLoads, final_page_entries, read_pages, write_loaded
from dcpsim.engine.loading import forkserver
from dcpsim.engine.scheduler.request import Status
from dcpsim.engine.worker.view import WorkerView
from dcpsim.harness.caller_main import check_plugins
from dcpsim.harness.collectives import GlooCollectives
from dcpsim.harness.groups import make_world_groups
from dcpsim.harness.pd_job import PDJob, instance_sizes, prepare_pd
from dcpsim.harness.pd_report import PDReport
from dcpsim.harness.progress import NO_PROGRESS, Progress
from dcpsim.harness.rank_process import PIPE_PROGRESS
from dcpsim.harness.rank_run import run_rank
from dcpsim.harness.runner import merge_rank_reports
from dcpsim.harness.world import run_world
from dcpsim.harness.world_options import WorldOptions
from dcpsim.model.kv_entry import FIELDS
from dcpsim.scenarios.pd import ROLES, instance_layout, shard_ranks
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.page_tail import judge_page_tails

WORLD = WorldOptions()

# ----------------------------------------------------------------------------- rank side


class PrefillInstance:
    """Reads each finished prompt's pages (the connector's source blocks)."""

    connector = None
    """The scheduler's KV connector (``Engine.make_scheduler``): none, the prompts are computed here."""

    def __init__(self):
        self.pages: dict[int, dict[int, np.ndarray]] = {}
        self.rows: dict[int, dict[int, np.ndarray]] = {}
        """request -> group -> the block ids its pages were read through."""
        self.names: dict[int, str] = {}
        self.page_sizes: list[int] = []

    def before_write(self, plan, runner) -> None:
        pass

    def after_step(self, plan, runner, scheduler) -> None:
        for req in scheduler.requests:
            if req.status is Status.FINISHED and req.index not in self.pages:
                held = [g for g in range(len(runner.stores)) if req.index in plan.rows_after[g]]
                self.rows[req.index] = {g: np.asarray(plan.rows_after[g][req.index], np.int64) for g in held}
                self.pages[req.index] = {g: read_pages(runner, g, self.rows[req.index][g]) for g in held}
                self.names[req.index] = req.spec.request_id
        self.page_sizes = [store.states_per_page for store in runner.stores]


class DecodeInstance:
    """Writes each admitted prompt's received entries at its own slots (or at the blocks the
    engine's own connector scheduler chose, ``PromptLoads.pulls``). With asynchronous loads
    (``PromptLoads.load_steps``, ``engine.async_load``) it clears each step's new blocks and writes
    the loads' parts as they arrive instead, and the checker judges the running requests' page
    tails after every step (``verify.page_tail``; ``page_tails``: what it found)."""

    def __init__(self, received: dict, connector: PromptLoads | None = None, clear=None, scenario=None, rank: int = 0):
        self.received = received
        self.written = 0
        self.connector = connector or PromptLoads()
        """The scheduler's KV connector: prompts arrive with their KV (the engine's own scheduler takes it)."""
        self.loads = AsyncLoads(self.connector, received, clear) if self.connector.load_steps else None
        self.groups = expected_groups(scenario) if self.loads is not None else []
        """The checker's groups of the decode instance (from its scenario alone)."""
        self.names = {i: r.request_id for i, r in enumerate(scenario.requests)} if scenario is not None else {}
        self.rank = rank
        self.page_tails: list[str] = []

    def before_write(self, plan, runner) -> None:
        if self.loads is not None:
            self.written += self.loads.before_write(plan, runner)
        elif plan.loaded:
            self.written += write_loaded(plan, runner, self.received, self.connector.pulls)

    def after_step(self, plan, runner, scheduler) -> None:
        if self.loads is not None and not self.page_tails:  # the first step that fails is reported
            found = judge_page_tails(self.groups, WorkerView(runner), plan.views, self.rank, self.names)
            self.page_tails = [f"step {plan.step}: {line}" for line in found]


def _send_prompts(pairs, blocks: PrefillBlocks, rank: int, prefill_size: int, shards: list[int]) -> tuple[int, list[str]]:
    """``rank``'s routes (``shards``: the instance rank of each source shard), each a pull of the
    blocks it reads (``blocks``: held until their last pull); the entries sent and what went wrong
    with the blocks' release."""
    mine = [(d, items) for (p, d), items in sorted(pairs.items()) if shards[p] == rank]
    for _, items in mine:
        for i, g, route in items:
            blocks.expect(i, g, route.src_local)
    handles, sent = [], 0
    empty = np.zeros((0, len(FIELDS)), np.int64)
    for d, items in mine:
        chunks = [blocks.pull(i, g, route.src_local, empty) for i, g, route in items]
        tensor = torch.from_numpy(np.concatenate(chunks))
        handles.append(dist.isend(tensor, dst=prefill_size + d))
        sent += len(tensor)
    for h in handles:
        h.wait()
    return sent, blocks.finish()


def _receive_prompts(pairs, rank: int, shards: list[int]) -> dict:
    """The entries the prefill ranks send ``rank``: request -> group -> (local indices, entries)."""
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


NOTICE_TAG = 1
"""The tag of the completion notices (``KVConnector.notices``), apart from the entries."""


def _send_notices(notices: np.ndarray, prefill_size: int) -> None:
    """The prefill instance's leader tells every decode rank the completion of each prompt."""
    handles = [dist.isend(torch.from_numpy(notices[d].copy()), dst=prefill_size + d, tag=NOTICE_TAG) for d in range(len(notices))]
    for h in handles:
        h.wait()


def _receive_notices(num_requests: int, leader: int) -> np.ndarray:
    buf = torch.empty((num_requests, 2), dtype=torch.int64)
    dist.irecv(buf, src=leader, tag=NOTICE_TAG).wait()
    return buf.numpy()


ROWS_TAG = 2
"""The tag of the prefill instance's block ids (header, then the ids), for a connector's scheduler
side on the decode instance (vLLM's NIXL scheduler reads them from ``kv_transfer_params``)."""


def _send_rows(rows: dict, num_requests: int, num_groups: int, prefill_size: int, decode_size: int) -> None:
    """The prefill leader's block ids of every prompt, per group (``-1``: none), to every decode rank."""
    width = max((len(r) for by_g in rows.values() for r in by_g.values()), default=0)
    table = np.full((num_requests, num_groups, width), -1, np.int64)
    for i, by_g in rows.items():
        for g, row in by_g.items():
            table[i, g, : len(row)] = row
    header = torch.tensor([num_groups, width], dtype=torch.int64)
    for d in range(decode_size):
        dist.isend(header, dst=prefill_size + d, tag=ROWS_TAG).wait()
        dist.isend(torch.from_numpy(table), dst=prefill_size + d, tag=ROWS_TAG).wait()


def _receive_rows(num_requests: int, leader: int) -> dict:
    """Request -> the prefill instance's block ids per group."""
    header = torch.empty(2, dtype=torch.int64)
    dist.irecv(header, src=leader, tag=ROWS_TAG).wait()
    table = torch.empty((num_requests, int(header[0]), int(header[1])), dtype=torch.int64)
    dist.irecv(table, src=leader, tag=ROWS_TAG).wait()
    t = table.numpy()
    return {i: [row[row >= 0].tolist() for row in t[i]] for i in range(num_requests) if (t[i] >= 0).any()}


def judge_notices(scenario, rank: int, notices: np.ndarray) -> list[str]:
    """What is wrong with the completions decode rank ``rank`` was notified of (``[request, 2]``,
    -1: none), judged from the decode instance's layout alone: every prompt needs one, with the
    entries the rank owns of it and those on its final page, a rank owning none of it too."""
    layout = instance_layout(scenario, "decode")
    problems = []
    for i, req in enumerate(scenario.requests):
        owned = len(layout.positions_on(rank, req.prompt_len))
        want = (owned, final_page_entries(owned, layout.block_size))
        got = tuple(int(v) for v in notices[i])
        if got[0] < 0:
            problems.append(f"decode rank {rank}: request {req.request_id} never notified of its transfer (it owns {owned} of its entries)")
        elif got != want:
            problems.append(
                f"decode rank {rank}: request {req.request_id} notified of {got[0]} entries, {got[1]} on the final page; "
                f"it owns {want[0]}, {want[1]} on the final page"
            )
    return problems


def pd_rank(job: PDJob, rank: int, world: GlooCollectives, progress: Progress = NO_PROGRESS):
    """One rank of either instance of ``job``; ``world``: the default world's collectives
    (world ranks past ``job.world_size`` only take part in making the groups, which every
    rank of the world must)."""
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
        report = run_rank(job.instance_job("prefill"), instances, engine=fault.engine("prefill"), instance=instance, progress=progress)
        progress.set(report.steps, "kv transfer (send)")
        release = fault.release() or PrefillRelease()
        blocks = PrefillBlocks(rank, instance.pages, instance.rows, instance.page_sizes, instance.names, release)
        sent, problems = _send_prompts(pairs, blocks, rank, prefill_size, shards)
        if rank == shards[0]:
            _send_notices(job.notices(), prefill_size)
            if job.scenario.disaggregated.kv_connector == "nixl":
                rows = {i: instance.rows[i] for i in instance.rows}
                _send_rows(rows, len(job.scenario.requests), len(instance.page_sizes), prefill_size, job.world_size - prefill_size)
        return "prefill", report, sent, problems
    progress.set(None, "kv transfer (receive)")
    received = _receive_prompts(pairs, rank - prefill_size, shards)
    notices = _receive_notices(len(job.scenario.requests), shards[0])
    kind = job.scenario.disaggregated.kv_connector
    remote = _receive_rows(len(job.scenario.requests), shards[0]) if kind == "nixl" else {}
    sizes = job.instance("prefill").config
    prefill = dict(dcp_size=sizes.decode_context_parallel_size, tp_size=max(sizes.parallel_layout.tp, sizes.decode_context_parallel_size))
    load_steps = job.scenario.disaggregated.load_steps
    decode = job.instance("decode")
    instance = DecodeInstance(received, PromptLoads(kind, remote, prefill, load_steps), fault.load_clear(), decode, rank - prefill_size)
    engine = fault.engine("decode") or (AsyncLoadEngine() if load_steps else None)
    report = run_rank(job.instance_job("decode"), instances, engine=engine, instance=instance, progress=progress)
    problems = judge_notices(job.scenario, rank - prefill_size, notices)
    return "decode", report, instance.written, problems, instance.page_tails


def pd_world(jobs: list[PDJob], rank: int, world_size: int) -> list:
    """``world.run_world`` target: the jobs in turn, each on the world's first ranks (their
    process groups shared: gloo groups are never freed)."""
    world = GlooCollectives(rank, world_size)
    out = []
    for job in jobs:
        out.append(pd_rank(job, rank, world, PIPE_PROGRESS))
        dist.barrier()  # the next job's groups start from a quiet world
    return out


# ----------------------------------------------------------------------------- parent side


def run_pd(job: PDJob, *, world: WorldOptions = WORLD, on_wait=None) -> PDReport:
    """Validate, run the world of both instances, merge each instance's rank reports."""
    return run_pd_batch([job], world=world, on_wait=on_wait)[0]


def run_pd_batch(jobs: list[PDJob], *, world: WorldOptions = WORLD, on_wait=None) -> list[PDReport]:
    """Several P/D runs in turn in one gloo world of the largest ``P + D`` (world start-up
    and forks once; ``world``'s timeout and deadline); each validated first."""
    for job in jobs:
        prepare_pd(job)
    check_plugins(j.engine.name for j in jobs)
    preload: tuple[str, ...] = ("dcpsim.harness.pd",)
    engines = [choice for choice in dict.fromkeys(j.engine for j in jobs) if not choice.is_reference]
    if engines:  # Triton imported and the engines built once, in the forkserver
        preload += ("dcpsim.engine.loading.preload",)
        forkserver.ask([choice.forkserver_build() for choice in engines])
    start = time.perf_counter()
    per_rank = run_world(
        pd_world,
        jobs,
        world_size=max(j.world_size for j in jobs),
        pg_timeout_s=world.timeout,
        deadline_s=world.deadline_for(len(jobs)),
        preload=preload,
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
                block_release=[line for r in by_role["prefill"] for line in r[3]],
                notices=[line for r in by_role["decode"] for line in r[3]],
                page_tails=[line for r in by_role["decode"] for line in r[4]],
                inject=job.inject,
                wall_time_s=seconds,
                layouts=layouts,
            )
        )
    return reports
