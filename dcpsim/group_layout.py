"""Per-group geometry under one config: how a KV-cache group is stored and sharded.

Derived once from a ``KVCacheGroupSpec`` and a ``SimConfig``; read by the
scheduler (manager block size, retention), the write path (slot mapping
arguments) and the checker (kernel-style reads). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.config import SimConfig
from dcpsim.errors import ConfigError
from dcpsim.grouping import KVCacheGroupSpec, check_groups_for_dcp
from dcpsim.layout import validate_layout
from dcpsim.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)

PAGED, RECORDS, RING = "paged", "records", "ring"
FULL, WINDOW, CHUNK = "full", "window", "chunk"


@dataclass(frozen=True)
class GroupLayout:
    group_id: int
    name: str
    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    """The representative layer spec (all layers of the group share its geometry)."""
    group_spec: KVCacheSpec
    storage: str  # PAGED, RECORDS or RING
    retention: str  # FULL, WINDOW, CHUNK or RING
    block_size: int  # tokens per page (B), or ring capacity (C)
    tokens_per_state: int  # R for compressed records, else 1
    sharded: bool  # positions/records split across the DCP ranks
    dcp_size: int
    interleave_size: int
    kernel_block_size: int | None  # states per kernel block (None: same as a page)
    num_speculative_tokens: int

    @property
    def replicated(self) -> bool:
        return not self.sharded

    @property
    def states_per_page(self) -> int:
        return self.block_size // self.tokens_per_state

    @property
    def manager_block_size(self) -> int:
        """Tokens one block-table entry covers: ``B * W`` when sharded, else ``B``."""
        return self.block_size * (self.dcp_size if self.sharded else 1)

    @property
    def prefix_cacheable(self) -> bool:
        return self.retention == FULL

    def blocks_needed(self, num_tokens: int) -> int:
        """Block-table entries a request with ``num_tokens`` tokens needs."""
        if self.storage == RING:
            return 1
        return cdiv(num_tokens, self.manager_block_size)

    def first_needed_position(self, num_committed: int) -> int:
        """Positions below this are no longer needed after ``num_committed`` tokens."""
        if self.retention in (WINDOW, CHUNK):
            return self.spec.first_needed_position(num_committed)
        if self.retention == RING:
            return max(0, num_committed - self.ring_retained_rows)
        return 0

    @property
    def ring_retained_rows(self) -> int:
        """Rows a ring still holds for sure after rejection: ``C - k``.

        A step writes ``k + 1`` rows; with every draft rejected only ``C - k``
        committed rows survive, which must include the previous row.
        """
        return self.block_size - self.num_speculative_tokens


def _storage_and_retention(spec: KVCacheSpec) -> tuple[str, str]:
    if isinstance(spec, CircularBufferSpec):
        return RING, RING
    tps = spec.tokens_per_state
    if not isinstance(tps, int):
        raise ConfigError(
            f"{type(spec).__name__}: tokens_per_state={tps} (several states per token) is "
            "modelled in page sizes only; the harness does not simulate it"
        )
    storage = RECORDS if tps > 1 else PAGED
    if isinstance(spec, SlidingWindowSpec):
        retention = WINDOW
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        retention = CHUNK
    else:
        retention = FULL
    if storage == RECORDS and retention != FULL:
        raise ConfigError(f"{type(spec).__name__}: compressed records are simulated for full attention only")
    return storage, retention


def build_group_layouts(groups: list[KVCacheGroupSpec], config: SimConfig) -> list[GroupLayout]:
    """Validate every group under ``config`` and derive its geometry."""
    check_groups_for_dcp(groups, config)
    layouts = []
    for gid, group in enumerate(groups):
        spec = group.representative
        storage, retention = _storage_and_retention(spec)
        sharded = group.sharded and config.decode_context_parallel_size > 1
        tps = spec.tokens_per_state if storage == RECORDS else 1
        what = f"group {group.name}" + (
            f" ({spec.block_size}-token pages of {spec.block_size // tps} records; "
            "block_size below counts records)"
            if tps > 1 else ""
        )
        kbs = config.kernel_block_size
        if storage == RING:
            kbs = None
            k = config.num_speculative_tokens
            if spec.block_size < k + 2:
                raise ConfigError(
                    f"{what}: ring capacity block_size={spec.block_size} must hold the "
                    f"{k} drafts, the bonus token and the previous row (>= {k + 2})"
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
        layouts.append(
            GroupLayout(
                group_id=gid,
                name=group.name,
                layer_names=group.layer_names,
                spec=spec,
                group_spec=group.kv_cache_spec,
                storage=storage,
                retention=retention,
                block_size=spec.block_size,
                tokens_per_state=tps,
                sharded=sharded,
                dcp_size=config.decode_context_parallel_size,
                interleave_size=config.cp_kv_cache_interleave_size,
                kernel_block_size=kbs,
                num_speculative_tokens=config.num_speculative_tokens,
            )
        )
    return layouts
