"""The capacity planner's arithmetic: per KV-cache group and per rank, what one DCP size
costs and holds.

Every figure comes from the spec model (``dcpsim.model.specs``: ``page_size_bytes``,
``max_memory_usage_bytes``, ``max_num_blocks_per_req``) and the scenario's pool settings,
for one ``decode_context_parallel_size`` at a time:

* the pool is either the scenario's (``kv_cache_tokens`` or ``num_gpu_blocks``, one pool
  per group, sized as the scheduler sizes it; ``scenario_pool_blocks``) or a per-rank
  byte budget divided the way vLLM 0.33.0 divides memory (``budget_pool``): one block
  pool shared by every group, each block as large as the largest group page;
* a request at ``max_model_len`` needs ``cdiv(max_memory_usage_bytes, page_size_bytes)``
  blocks of a group (vLLM's ``get_max_concurrency_for_kv_cache_config``), and the context
  a pool holds is ``int(concurrency * max_model_len)`` tokens (vLLM's
  ``get_kv_cache_capacity``).

Pure: no torch, no I/O. The config must be valid for the DCP size (the caller validates
it the way ``run`` does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dcpsim.model.arith import cdiv
from dcpsim.model.grouping import KVCacheGroupSpec, group_layer_specs
from dcpsim.model.kinds import Storage, records_per_state, storage_of
from dcpsim.model.scenario import Scenario
from dcpsim.model.specs import FullAttentionSpec, KVCacheSpec, UniformTypeKVCacheSpecs

GIB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

NOTES_COMMON = (
    "page bytes, bytes per token and memory are per rank: every rank holds one page per block of every layer of the group",
    "blocks per request at max_model_len = cdiv(max_memory_usage_bytes, page_size_bytes) of the "
    "group spec (vLLM 0.33.0 get_max_concurrency_for_kv_cache_config); for a sliding window "
    "that is its admission cap, for a ring one block",
    "context the DCP group holds = int(concurrency * max_model_len) tokens (vLLM's get_kv_cache_capacity), all W ranks together",
    "a replicated group 'if sharded': full attention through the spec model with "
    "dcp_replicated off; sliding windows and chunks (which vLLM cannot shard, semantics "
    "section 3) at an ideal 1/W share; a ring stays one block a request",
    "groups are the run's: one per spec kind (dcpsim.model.grouping), not split into groups "
    "of equal layer counts as vLLM's _get_kv_cache_groups_uniform_page_size does",
)
NOTES_SCENARIO = (
    "pool = the scenario's: one pool per group, sized as the scheduler sizes it "
    "(dcpsim.engine.scheduler.scheduler.pool_sizes); concurrency = the smallest over groups "
    "of pool blocks / blocks per request",
)
NOTES_BUDGET = (
    "budget per rank = gpu_memory_gib * gpu_memory_utilization GiB, all of it for the KV "
    "cache: no weights, activations or CUDA graphs are subtracted",
    "one block pool shared by every group (vLLM 0.33.0 get_kv_cache_config_from_groups): a "
    "block is as large as the largest group page, num_blocks = budget // block bytes, and a "
    "group with a smaller page leaves the rest of each block it holds unused (padding); "
    "concurrency = num_blocks / sum over groups of blocks per request (the null block "
    "included, as vLLM counts it)",
    "a group's pool blocks = its share of the shared pool at that concurrency",
    "'without padding': the budget over the bytes one request's blocks take at their own page "
    "sizes; vLLM gets there when it can split the layers into groups of equal pages "
    "(_get_kv_cache_groups_uniform_page_size), which these groups are not",
)


@dataclass(frozen=True)
class Budget:
    """A per-rank memory budget for the KV cache (``--gpu-memory-gib``)."""

    gpu_memory_gib: float
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION

    @property
    def bytes_per_rank(self) -> int:
        return int(self.gpu_memory_gib * self.gpu_memory_utilization * GIB)


@dataclass(frozen=True)
class GroupCapacity:
    """One KV-cache group at one DCP size, per rank."""

    name: str
    kind: str
    layers: int
    sharded: bool
    dcp_replicated: bool
    """The group's specs are marked ``dcp_replicated`` (held whole on every rank)."""
    block_size: int
    """Tokens per page (``B``; a compressed page holds ``B / R`` records), or a ring's capacity."""
    states_per_page: int
    tokens_per_block_entry: int | None
    """Context tokens one block-table entry covers on all ranks together (``B * W`` sharded,
    ``B`` replicated); None for a ring."""
    layer_page_size_bytes: int
    """``page_size_bytes`` of the group's representative layer spec."""
    layer_max_memory_usage_bytes: int
    page_size_bytes: int
    """Of the group: the sum of its layers' pages (what one block costs a rank)."""
    max_memory_usage_bytes: int
    """Of the group (the sum over its layers): the worst case of one request at
    ``max_model_len``, per rank."""
    bytes_per_token: float | None
    """Per rank and per token of a request's context; None for a ring (a fixed cost)."""
    blocks_per_request: int
    pool_blocks: int
    pool_tokens: int | None
    pool_bytes: int
    concurrency: float
    if_sharded_bytes: int | None = None
    """Replicated groups: ``max_memory_usage_bytes`` if the group were sharded."""
    if_sharded_rule: str | None = None
    padding_bytes_per_block: int = 0


@dataclass(frozen=True)
class CapacityColumn:
    """Every group at one DCP size, and the totals of a rank."""

    decode_context_parallel_size: int
    groups: tuple[GroupCapacity, ...] = ()
    error: str | None = None
    max_memory_per_request: int = 0
    """Sum over groups of ``max_memory_usage_bytes``: one ``max_model_len`` request, per rank."""
    replicated_per_request: int = 0
    replicated_if_sharded: int = 0
    pool_bytes: int = 0
    concurrency: float = 0.0
    context_tokens: int = 0
    block_bytes: int | None = None
    num_blocks: int | None = None
    concurrency_without_padding: float | None = None
    """Budget mode: the budget over the blocks one request takes at their own page sizes,
    what vLLM reaches when it can split the layers into groups of equal pages."""
    context_tokens_without_padding: int | None = None

    @property
    def valid(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class CapacityPlan:
    scenario: str
    source: str
    max_model_len: int
    num_speculative_tokens: int
    pool: dict
    columns: tuple[CapacityColumn, ...]
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- one group ---------------------------------------------------------------------------


def _shards(group: KVCacheGroupSpec, dcp: int) -> int:
    return dcp if group.sharded and dcp > 1 else 1


def scenario_pool_blocks(scenario: Scenario, group: KVCacheGroupSpec) -> int:
    """Blocks of the group's pool (besides the null block), by the scenario's settings:
    ``num_gpu_blocks`` each; or ``kv_cache_tokens`` worth of blocks, at least the largest
    request's need; or room for every request at once. A ring holds one block a request."""
    config = scenario.config
    ring = storage_of(group.representative) is Storage.RING
    span = group.representative.block_size * _shards(group, config.decode_context_parallel_size)
    k = config.num_speculative_tokens
    spare = 1 if config.kv_cache_layout == "helix" else 0  # Helix's spare entry a row (semantics section 15)
    needs = [1 if ring else cdiv(r.prompt_len + r.output_len + k, span) + spare for r in scenario.requests]
    if scenario.num_gpu_blocks is not None:
        return scenario.num_gpu_blocks
    if ring:
        return len(needs)
    if storage_of(group.representative) is Storage.STATE:  # a few state blocks a request, however long
        spec = group.representative
        window = spec.num_state_blocks
        return len(needs) * (2 * window + 1 if spec.mamba_cache_mode == "align" else window)
    if scenario.kv_cache_tokens is not None:
        return max(max(needs), cdiv(scenario.kv_cache_tokens, span) + spare)
    return sum(needs)


def layer_specs(group: KVCacheGroupSpec) -> list[KVCacheSpec]:
    """The spec of every layer of the group, one per layer name (a merged group spec
    stands for each of its identical layers; vLLM charges a block every layer's page)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [spec.kv_cache_specs[name] for name in group.layer_names]
    return [spec] * len(group.layer_names)


def _if_sharded(group: KVCacheGroupSpec, scenario: Scenario) -> tuple[int | None, str | None]:
    config = scenario.config
    if group.sharded or config.decode_context_parallel_size == 1:
        return None, None
    layers = layer_specs(group)
    if storage_of(group.representative) is Storage.RING:
        return sum(s.max_memory_usage_bytes(config) for s in layers), "a ring is not split: one block a request"
    if all(isinstance(s, FullAttentionSpec) for s in layers):
        unrep = [dataclasses.replace(s, dcp_replicated=False) for s in layers]
        return sum(s.max_memory_usage_bytes(config) for s in unrep), "spec model, dcp_replicated off"
    memory = sum(s.max_memory_usage_bytes(config) for s in layers)
    return cdiv(memory, config.decode_context_parallel_size), "ideal 1/W share"


def group_capacity(scenario: Scenario, group: KVCacheGroupSpec, pool_blocks: int) -> GroupCapacity:
    """One group of ``scenario`` (at its own DCP size) with a pool of ``pool_blocks``."""
    config = scenario.config
    rep = group.representative
    ring = storage_of(rep) in (Storage.RING, Storage.STATE)  # no token capacity: blocks a request
    shards = _shards(group, config.decode_context_parallel_size)
    layers = layer_specs(group)
    page = sum(s.page_size_bytes for s in layers)
    memory = sum(s.max_memory_usage_bytes(config) for s in layers)
    blocks = cdiv(memory, page) + (1 if config.kv_cache_layout == "helix" and not ring else 0)  # Helix's spare entry
    span = None if ring else rep.block_size * shards
    if_sharded, rule = _if_sharded(group, scenario)
    return GroupCapacity(
        name=group.name,
        kind=type(rep).__name__,
        layers=len(group.layer_names),
        sharded=shards > 1,
        dcp_replicated=group.replicated,
        block_size=rep.block_size,
        states_per_page=1 if storage_of(rep) is Storage.STATE else rep.block_size // records_per_state(rep),
        tokens_per_block_entry=span,
        layer_page_size_bytes=rep.page_size_bytes,
        layer_max_memory_usage_bytes=rep.max_memory_usage_bytes(config),
        page_size_bytes=page,
        max_memory_usage_bytes=memory,
        bytes_per_token=None if ring else page / span,
        blocks_per_request=blocks,
        pool_blocks=pool_blocks,
        pool_tokens=None if ring else pool_blocks * span,
        pool_bytes=pool_blocks * page,
        concurrency=pool_blocks / blocks,
        if_sharded_bytes=if_sharded,
        if_sharded_rule=rule,
    )


# --- one DCP size ------------------------------------------------------------------------


def scenario_column(scenario: Scenario) -> CapacityColumn:
    """The scenario's own pools (one per group) at its DCP size."""
    groups = tuple(group_capacity(scenario, g, scenario_pool_blocks(scenario, g)) for g in group_layer_specs(scenario.layers))
    concurrency = min(g.concurrency for g in groups)
    return _totals(scenario, groups, concurrency)


def budget_column(scenario: Scenario, budget: Budget) -> CapacityColumn:
    """A per-rank budget over one shared block pool, the way vLLM 0.33.0 divides it."""
    specs = group_layer_specs(scenario.layers)
    block_bytes = max(sum(s.page_size_bytes for s in layer_specs(g)) for g in specs)
    num_blocks = budget.bytes_per_rank // block_bytes
    first = [group_capacity(scenario, g, 0) for g in specs]
    per_request = sum(g.blocks_per_request for g in first)
    concurrency = num_blocks / per_request
    groups = tuple(
        dataclasses.replace(
            group_capacity(scenario, g, num_blocks * c.blocks_per_request // per_request),
            padding_bytes_per_block=block_bytes - c.page_size_bytes,
        )
        for g, c in zip(specs, first)
    )
    # what a group holds is a share of the shared pool: every block costs block_bytes
    groups = tuple(dataclasses.replace(g, pool_bytes=g.pool_blocks * block_bytes, concurrency=concurrency) for g in groups)
    unpadded = budget.bytes_per_rank / sum(c.blocks_per_request * c.page_size_bytes for c in first)
    return dataclasses.replace(
        _totals(scenario, groups, concurrency, block_bytes=block_bytes, num_blocks=num_blocks, pool_bytes=num_blocks * block_bytes),
        concurrency_without_padding=unpadded,
        context_tokens_without_padding=int(unpadded * scenario.config.max_model_len),
    )


def _totals(
    scenario: Scenario,
    groups: tuple[GroupCapacity, ...],
    concurrency: float,
    *,
    block_bytes: int | None = None,
    num_blocks: int | None = None,
    pool_bytes: int | None = None,
) -> CapacityColumn:
    replicated = [g for g in groups if g.if_sharded_bytes is not None]
    return CapacityColumn(
        decode_context_parallel_size=scenario.config.decode_context_parallel_size,
        groups=groups,
        max_memory_per_request=sum(g.max_memory_usage_bytes for g in groups),
        replicated_per_request=sum(g.max_memory_usage_bytes for g in replicated),
        replicated_if_sharded=sum(g.if_sharded_bytes for g in replicated),
        pool_bytes=sum(g.pool_bytes for g in groups) if pool_bytes is None else pool_bytes,
        concurrency=concurrency,
        context_tokens=int(concurrency * scenario.config.max_model_len),
        block_bytes=block_bytes,
        num_blocks=num_blocks,
    )


def plan_capacity(scenario: Scenario, columns: list[CapacityColumn], budget: Budget | None) -> CapacityPlan:
    """The plan of ``columns`` (each from ``scenario_column`` or ``budget_column`` of the
    scenario at one DCP size, or an invalid column), with the pool settings and notes."""
    if budget is None:
        pool = {"mode": "scenario", "kv_cache_tokens": scenario.kv_cache_tokens, "num_gpu_blocks": scenario.num_gpu_blocks}
        notes = NOTES_SCENARIO + NOTES_COMMON
    else:
        pool = {
            "mode": "gpu-memory",
            "gpu_memory_gib": budget.gpu_memory_gib,
            "gpu_memory_utilization": budget.gpu_memory_utilization,
            "budget_bytes_per_rank": budget.bytes_per_rank,
        }
        notes = NOTES_BUDGET + NOTES_COMMON
    return CapacityPlan(
        scenario=scenario.name,
        source=scenario.source,
        max_model_len=scenario.config.max_model_len,
        num_speculative_tokens=scenario.config.num_speculative_tokens,
        pool=pool,
        columns=tuple(columns),
        notes=notes,
    )


def column(scenario: Scenario, budget: Budget | None) -> CapacityColumn:
    """``scenario_column`` or ``budget_column``."""
    return scenario_column(scenario) if budget is None else budget_column(scenario, budget)


def invalid_column(dcp: int, reason: str) -> CapacityColumn:
    return CapacityColumn(decode_context_parallel_size=dcp, error=reason)
