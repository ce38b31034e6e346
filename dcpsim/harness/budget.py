"""What a run will need, estimated by arithmetic before anything is allocated, against
what the machine has: processes, per-rank KV-store and block-table bytes, the
schedulers' pools, the workload's token arrays and the schedule's size (steps x tokens).

``check_budget(scenario)`` refuses (``ConfigError``, exit 2, with the figures) a run
that cannot fit: more memory than the machine has available, or a schedule that
cannot end within ``max_steps``; ``cpu_warning`` says (one line) when the ranks
outnumber the CPUs, which only slows a run down. ``force=True`` (``--force``) skips
the memory refusal, for people who mean it.

The figures are deliberately rough upper estimates of what the harness allocates,
calibrated on a 2-core machine: a rank process with torch imported holds ~175 MiB
before any data, a parent ~230 MiB; a workload token costs ~100 bytes in each
scheduler (its tokens, fingerprints and hashes, the checker's expectation); a token
of a step ~1 KiB per group on its way through the write path.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from dcpsim.engine.attention.heads import has_kv_heads
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import pool_sizes
from dcpsim.errors import ConfigError
from dcpsim.model.arith import cdiv
from dcpsim.model.heads import kv_heads
from dcpsim.model.kinds import Storage
from dcpsim.model.kv_entry import FIELDS
from dcpsim.model.scenario import Scenario
from dcpsim.plural import plural

GIB = 2**30
PROCESS_BYTES = 175 * 2**20
"""A rank process (forked from a forkserver that has imported torch) before any data."""
PARENT_BYTES = 230 * 2**20
"""The launching process, torch and dcpsim imported."""
POOL_BLOCK_BYTES = 160
"""One block of a scheduler's pool: ref count, free-queue entry, ever-used flag."""
WORKLOAD_TOKEN_BYTES = 100
"""One token of a request, in one scheduler and its checker."""
STEP_TOKEN_BYTES = 1024
"""One token of one step, in one group's write path (slots, indices, entries, contents)."""
ENTRY_BYTES = 8 * len(FIELDS)
"""One stored state: a fingerprint row of int64 fields."""


@dataclass(frozen=True)
class RunEstimate:
    """The estimate of one run (one world of ``ranks`` ranks)."""

    ranks: int
    processes: int
    """Processes of the world: one per rank plus the parent (1 with ``in_process``)."""
    store_bytes: int
    """KV stores of one rank, every group (block 0 included)."""
    table_bytes: int
    """Block tables of one rank: ``max_num_reqs x block_table_width`` int64 per group."""
    pool_blocks: int
    """Blocks in the pools of every group (one scheduler)."""
    workload_tokens: int
    """Tokens of every request (prompt + output)."""
    step_tokens: int
    """Most tokens one step can schedule."""
    min_steps: int
    """A lower bound on the schedule's steps."""
    max_steps: int
    groups: int

    @property
    def scheduler_bytes(self) -> int:
        """One scheduler (the parent's dry run, or a rank's): pools, tokens, a step."""
        return (
            self.pool_blocks * POOL_BLOCK_BYTES
            + self.workload_tokens * WORKLOAD_TOKEN_BYTES
            + self.step_tokens * STEP_TOKEN_BYTES * self.groups
        )

    @property
    def rank_bytes(self) -> int:
        """The data of one rank: its stores, block tables and scheduler."""
        return self.store_bytes + self.table_bytes + self.scheduler_bytes

    @property
    def parent_bytes(self) -> int:
        """The parent's dry run of the schedule (``harness.rank.prepare``)."""
        return self.scheduler_bytes

    local_ranks: int | None = None
    """Ranks on this machine, when fewer than ``ranks`` (torchrun across several nodes)."""

    def total_bytes(self, in_process: bool = False) -> int:
        """The whole run on this machine: the parent and every rank (threads of the parent
        with ``in_process``)."""
        ranks = self.ranks if self.local_ranks is None else self.local_ranks
        if in_process:
            return PARENT_BYTES + self.parent_bytes + ranks * self.rank_bytes
        return PARENT_BYTES + self.parent_bytes + ranks * (PROCESS_BYTES + self.rank_bytes)

    def process_bytes(self, in_process: bool = False) -> int:
        """The largest process of the run: the parent, or a rank (everything with ``in_process``)."""
        if in_process:
            return self.total_bytes(in_process=True)
        return max(PARENT_BYTES + self.parent_bytes, PROCESS_BYTES + self.rank_bytes)

    def figures(self, in_process: bool = False) -> str:
        """``~X GiB across N ranks (per rank: ... of KV stores, ... of block tables, ...)``."""
        ranks = self.ranks if self.local_ranks is None else self.local_ranks
        return (
            f"~{gib(self.total_bytes(in_process))} GiB across {plural(ranks, 'rank')} (per rank: "
            f"{size(self.store_bytes)} of KV stores, {size(self.table_bytes)} of block tables, "
            f"{size(self.scheduler_bytes)} of scheduler for {self.pool_blocks:,} pool blocks, "
            f"{self.workload_tokens:,} request tokens and steps of up to {self.step_tokens:,} tokens)"
        )


def gib(n: int) -> str:
    """Bytes as GiB for messages: ``0.17``, ``4.4``, ``176``, ``8.4e+09``."""
    g = n / GIB
    if g >= 1e6:
        return f"{g:.2g}"
    return f"{g:.2f}" if g < 1 else f"{g:.1f}" if g < 100 else f"{g:.0f}"


def size(n: int) -> str:
    """Bytes in the unit that suits them: ``640 B``, ``12.5 KiB``, ``3.0 MiB``, ``74.5 GiB``."""
    for unit, scale in (("B", 1), ("KiB", 2**10), ("MiB", 2**20)):
        if n < 1024 * scale:
            return f"{n} B" if scale == 1 else f"{n / scale:.1f} {unit}"
    return f"{gib(n)} GiB"


def estimate(
    scenario: Scenario, *, in_process: bool = False, attention_width: int = 0, local_ranks: int | None = None, geometries=None
) -> RunEstimate:
    """The estimate of a validated scenario, by arithmetic only (no pool, table or store
    is built). ``attention_width``: the K/V width of the attention check (0: off);
    ``local_ranks``: the ranks on this machine, if not all of them; ``geometries``: the
    reference engine's geometries of the scenario, if the caller has them already."""
    engine = ReferenceEngine()
    config = scenario.config
    if geometries is None:
        geometries = engine.geometries(scenario.layers, config)
    pools = pool_sizes(scenario, engine, geometries)
    store = table = 0
    requests = scenario.requests
    held = 1 if config.num_key_value_heads is None else len(kv_heads(0, config.tp_size, config.num_key_value_heads))
    for g, blocks in zip(geometries, pools):
        vectors = attention_width * (held if held > 1 and has_kv_heads(g) else 1)  # one K/V vector per KV head held
        per_state = ENTRY_BYTES + (4 * vectors if g.storage not in (Storage.RING, Storage.STATE) else 0)
        store += (blocks + 1) * g.states_per_page * per_state
        table += len(requests) * g.block_table_width * 8
    k = config.num_speculative_tokens
    workload = sum(r.prompt_len + r.output_len for r in requests)
    computed = sum(r.prompt_len - r.shared_prefix_len + r.output_len for r in requests)
    step_cap = config.max_num_batched_tokens + max(config.max_cudagraph_capture_size, 0)
    min_steps = max(cdiv(computed, config.max_num_batched_tokens), max(r.arrival_step + cdiv(r.output_len, 1 + k) for r in requests))
    return RunEstimate(
        ranks=config.world_size,
        processes=1 if in_process else config.world_size + 1,
        store_bytes=store,
        table_bytes=table,
        pool_blocks=sum(pools),
        workload_tokens=workload,
        step_tokens=min(step_cap, workload),
        min_steps=min_steps,
        max_steps=scenario.max_steps,
        groups=len(geometries),
        local_ranks=local_ranks,
    )


def available_memory() -> int:
    """Bytes the machine can give without swapping: ``MemAvailable`` of ``/proc/meminfo``,
    else the free physical pages."""
    return _machine_memory()


def address_space_limit() -> int | None:
    """This process's address-space limit (``RLIMIT_AS``, ``ulimit -v``; inherited by the
    ranks), or None."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def _machine_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 2**62  # unknown: refuse nothing on memory


def check_budget(
    scenario: Scenario,
    *,
    in_process: bool = False,
    force: bool = False,
    attention_width: int = 0,
    available: int | None = None,
    local_ranks: int | None = None,
    hint: str = "; --force to run anyway",
    geometries=None,
) -> RunEstimate:
    """The run's ``RunEstimate``, or a ``ConfigError`` with its figures if the schedule cannot end
    within ``max_steps`` or (unless ``force``) the run needs more memory than ``available``
    (default: the machine's ``available_memory``)."""
    budget = estimate(scenario, in_process=in_process, attention_width=attention_width, local_ranks=local_ranks, geometries=geometries)
    if budget.min_steps > budget.max_steps:
        raise ConfigError(
            f"the schedule needs at least {budget.min_steps:,} steps (the requests' "
            f"{budget.workload_tokens:,} tokens at max_num_batched_tokens = {scenario.config.max_num_batched_tokens:,} "
            f"a step, and their decodes), more than max_steps = {budget.max_steps:,}; shorten the requests "
            f"or raise max_num_batched_tokens or max_steps"
        )
    have = available_memory() if available is None else available
    if not force and budget.total_bytes(in_process) > have:
        raise ConfigError(f"the run needs {budget.figures(in_process)}; the machine has {gib(have)} GiB available{hint}")
    limit = address_space_limit() if available is None else None
    if not force and limit is not None and budget.process_bytes(in_process) > limit:
        raise ConfigError(
            f"the run needs ~{gib(budget.process_bytes(in_process))} GiB in one process "
            f"({budget.figures(in_process)}); the address-space limit (ulimit -v) is "
            f"{gib(limit)} GiB{hint}"
        )
    return budget


def check_pd_budget(
    instances: dict[str, Scenario], *, force: bool = False, available: int | None = None, hint: str = "; --force to run anyway"
) -> int:
    """A disaggregated run: one world of every instance's rank processes and one parent that
    dry-runs each instance's schedule. Returns the bytes it needs, or a ``ConfigError``
    with each instance's figures (the steps check applies to each instance)."""
    budgets = {role: check_budget(sc, force=True, available=available, hint=hint) for role, sc in instances.items()}
    need = PARENT_BYTES + sum(b.parent_bytes + b.ranks * (PROCESS_BYTES + b.rank_bytes) for b in budgets.values())
    have = available_memory() if available is None else available
    if not force and need > have:
        per = "; ".join(f"{role}: {b.figures()}" for role, b in budgets.items())
        raise ConfigError(f"the P/D run needs ~{gib(need)} GiB ({per}); the machine has {gib(have)} GiB available{hint}")
    return need


def check_scheduler_fits(scenario: Scenario, *, available: int | None = None) -> RunEstimate:
    """For commands that build one scheduler and no stores (``capacity``): refuse a
    scheduler (its pools and requests) larger than the memory ``available``."""
    budget = estimate(scenario, in_process=True)
    have = available_memory() if available is None else available
    if available is None and address_space_limit() is not None:
        have = min(have, address_space_limit())
    if PARENT_BYTES + budget.scheduler_bytes > have:
        raise ConfigError(
            f"its scheduler alone needs ~{gib(PARENT_BYTES + budget.scheduler_bytes)} GiB "
            f"({budget.pool_blocks:,} pool blocks, {budget.workload_tokens:,} request tokens); "
            f"the machine has {gib(have)} GiB available"
        )
    return budget


def cpu_warning(ranks: int, cpus: int | None = None) -> str | None:
    """One line when ``ranks`` rank processes outnumber the CPUs (a slower run, not a
    wrong one), else None."""
    cpus = os.cpu_count() if cpus is None else cpus
    if cpus and ranks > cpus:
        return (
            f"dcpsim: warning: {plural(ranks, 'rank')} on {plural(cpus, 'CPU')}: the ranks share them, "
            f"so the run is slower (timeouts count wall time)"
        )
    return None


def pool_note(scenario: Scenario) -> str | None:
    """One line when ``kv_cache_tokens`` is less than the largest request needs, so the
    pools were sized up to hold it (what pool was used), else None."""
    if scenario.kv_cache_tokens is None:
        return None
    engine = ReferenceEngine()
    geometries = engine.geometries(scenario.layers, scenario.config)
    grown = [
        f"{g.name} {plural(n, 'block')} ({n * g.manager_block_size:,} tokens)"
        for g, n in zip(geometries, pool_sizes(scenario, engine, geometries))
        if g.storage not in (Storage.RING, Storage.STATE) and n > engine.blocks_needed(g, scenario.kv_cache_tokens)
    ]
    if not grown:
        return None
    return f"kv_cache_tokens = {scenario.kv_cache_tokens:,} does not hold the largest request, so the pools hold it instead: " + ", ".join(
        grown
    )
