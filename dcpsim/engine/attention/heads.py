"""The engine's heads in the attention check: which groups have several KV heads, and each
rank's heads in them (``Engine.attention_heads``).

A scenario that states ``num_attention_heads`` / ``num_key_value_heads`` gives its GQA/MHA
attention groups (paged, not MLA, not the draft's) one K/V vector per KV head and token.
There a rank stores the KV heads it holds (TP's split), attends the query heads its DCP
group gathered, and reads for each the KV head the engine maps it to. Every other group
keeps one KV head shared by ``--attention-heads`` query heads, at the cost of before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.kinds import Storage
from dcpsim.model.specs import AttentionSpec, CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec


@dataclass(frozen=True)
class GroupHeads:
    """One group's heads on this rank (the engine's)."""

    num_heads: int
    """The model's query heads (before TP): the width of its query vectors."""
    query_heads: np.ndarray
    """The gathered query heads (global), in gather order: the heads of the rank's attention."""
    kv_heads: np.ndarray
    """The KV heads (global) the rank's store holds, in store order."""
    kv_index: np.ndarray
    """Per gathered query head: the index into ``kv_heads`` of the KV head it reads."""


def has_kv_heads(geometry) -> bool:
    """A target model's GQA/MHA attention group (paged, not MLA, not a ring)."""
    spec = geometry.spec
    mla = isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec, CircularBufferSpec))
    return isinstance(spec, AttentionSpec) and not mla and geometry.storage is Storage.PAGED and not geometry.draft


def group_heads(engine, geometries, config, layout, rank: int) -> dict[int, GroupHeads]:
    """Group id -> this world rank's heads, for the groups with KV heads of a scenario that
    states its heads (empty otherwise: every group has one KV head, as before)."""
    H, kv = config.num_attention_heads, config.num_key_value_heads
    if H is None:
        return {}
    chosen = engine.attention_heads(layout, rank, H, kv)
    heads = GroupHeads(
        H,
        np.asarray(chosen.query_heads, dtype=np.int64),
        np.asarray(chosen.kv_heads, dtype=np.int64),
        np.asarray(chosen.kv_index, dtype=np.int64),
    )
    return {g.group_id: heads for g in geometries if has_kv_heads(g)}
