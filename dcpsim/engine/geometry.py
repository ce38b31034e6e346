"""``GroupGeometry``: how an engine stores and shards one KV-cache group under one config.

A value the engine returns (``Engine.group_geometry``) and every part of the engine reads:
the scheduler (manager block size, block-table width, retention), the worker (slot mapping
arguments, store shape) and the engine's attention. ``derive_geometry`` is the reference
derivation (vLLM semantics plus ``dcp_replicated``); an engine variant may return other
values, and the checker never reads any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.config import SimConfig
from dcpsim.model.context_gather import workspace_size
from dcpsim.model.grouping import KVCacheGroupSpec
from dcpsim.model.kinds import Retention, Storage, records_per_state, retention_of, storage_of
from dcpsim.model.layout import validate_layout
from dcpsim.model.specs import KVCacheSpec
from dcpsim.plural import plural


@dataclass(frozen=True)
class GroupGeometry:
    group_id: int
    name: str
    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    """The representative layer spec (all layers of the group share its geometry)."""
    group_spec: KVCacheSpec
    storage: Storage
    retention: Retention
    block_size: int
    """Tokens per page (``B``), the ring capacity (``C``), or the tokens a Mamba state
    block stands for (vLLM's ``mamba_block_size``)."""
    tokens_per_state: int
    """``R`` for compressed records, else 1."""
    sharded: bool
    """Positions (or records) split across the DCP ranks."""
    dcp_size: int
    interleave_size: int
    """``I``, in the units the group is sharded in (positions, or records)."""
    kernel_block_size: int | None
    """States per attention-kernel block (None: one kernel block per page)."""
    num_speculative_tokens: int
    manager_block_size: int
    """Tokens one block-table entry covers: ``B * W`` when sharded, else ``B`` (Mamba
    states included: never scaled by ``W``)."""
    block_table_width: int
    """Entries of a worker block-table row: ``max_num_blocks_per_req`` rounded up to a
    multiple of 128 tokens where the spec asks (``get_block_table_width``)."""
    page_size_bytes: int | None = None
    """Bytes of one page of one layer (the representative spec), as the engine counts them."""
    max_memory_usage_bytes: int | None = None
    """The worst-case bytes one request can use in one layer (the representative spec)."""
    draft: bool = False
    """The group holds layers of the draft model (whose drafter builds its own metadata and
    writes their KV with its own slot mapping)."""
    draft_only: bool = False
    """Every layer of the group is a draft layer (no target layer shares its cache)."""
    model: str = "target"
    """Whose attention this geometry describes: ``target``, or ``draft`` (``Engine.draft_geometry``)."""
    cudagraph_capture_sizes: tuple[int, ...] = ()
    """Token counts a uniform decode step is padded up to (empty: no CUDA-graph padding)."""
    chunked_prefill_workspace_size: int = 0
    """Rows of the context-gather workspace (``dcpsim.model.context_gather``): the
    configured size or vLLM's default, aligned; 0 for a group without a gather."""

    @property
    def replicated(self) -> bool:
        return not self.sharded

    @property
    def states_per_page(self) -> int:
        if self.storage is Storage.STATE:
            return 1  # a page is one recurrent state, whatever block_size tokens it stands for
        return self.block_size // self.tokens_per_state

    @property
    def prefix_cacheable(self) -> bool:
        return self.retention is Retention.FULL


def derive_geometry(group_id: int, group: KVCacheGroupSpec, config: SimConfig) -> GroupGeometry:
    """The reference geometry of one group, validated (``ConfigError`` names the group)."""
    spec = group.representative
    storage = storage_of(spec)
    sharded = group.sharded and config.decode_context_parallel_size > 1
    tps = records_per_state(spec)
    what = f"group {group.name}" + (
        f" ({spec.block_size}-token pages of {spec.block_size // tps} records; block_size below counts records)" if tps > 1 else ""
    )
    kbs = config.kernel_block_size
    if storage is Storage.STATE:
        kbs = None  # read whole, as recurrent state indices: no kernel blocks, no interleave
    elif storage is Storage.RING:
        kbs = None
        k = config.num_speculative_tokens
        if spec.block_size < k + 2:
            raise ConfigError(
                f"{what}: ring capacity block_size={spec.block_size} must hold the "
                f"{plural(k, 'draft')}, the bonus token and the previous row (>= {k + 2})"
            )
    else:
        validate_layout(
            block_size=spec.block_size // tps,
            dcp_size=config.decode_context_parallel_size,
            interleave_size=config.cp_kv_cache_interleave_size,
            kernel_block_size=kbs,
            replicated=not sharded,
            what=what,
        )
    return GroupGeometry(
        group_id=group_id,
        name=group.name,
        layer_names=group.layer_names,
        spec=spec,
        group_spec=group.kv_cache_spec,
        storage=storage,
        retention=retention_of(spec),
        block_size=spec.block_size,
        tokens_per_state=tps,
        sharded=sharded,
        dcp_size=config.decode_context_parallel_size,
        interleave_size=config.cp_kv_cache_interleave_size,
        kernel_block_size=kbs,
        num_speculative_tokens=config.num_speculative_tokens,
        manager_block_size=spec.block_size * (config.decode_context_parallel_size if sharded else 1),
        block_table_width=group.kv_cache_spec.block_table_width(config, config.max_model_len),
        page_size_bytes=spec.page_size_bytes,
        max_memory_usage_bytes=spec.max_memory_usage_bytes(config),
        cudagraph_capture_sizes=config.cudagraph_capture_sizes,
        chunked_prefill_workspace_size=_workspace(config, spec.block_size, sharded) if storage is Storage.PAGED else 0,
        draft=any(n in config.draft_layers for n in group.layer_names),
        draft_only=all(n in config.draft_layers for n in group.layer_names),
    )


def _workspace(config: SimConfig, block_size: int, sharded: bool) -> int:
    """The context-gather workspace rows of a paged group (``workspace_size``)."""
    return workspace_size(
        config.chunked_prefill_workspace_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        block_size=block_size,
        dcp_size=config.decode_context_parallel_size if sharded else 1,
        interleave_size=config.cp_kv_cache_interleave_size,
    )
