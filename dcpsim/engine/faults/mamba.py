"""Mamba-state faults: the DCP factor or the DCP slot transform applied to replicated state
(bug classes 19 and 20)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.geometry import GroupGeometry
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import PAD, owner_rank


def _is_align_state(g: GroupGeometry) -> bool:
    """A Mamba group in ``align`` mode under DCP: its block table is indexed by position."""
    return g.storage is Storage.STATE and g.dcp_size > 1 and g.spec.mamba_cache_mode == "align"


class MambaBlockSizeScaledByW(Fault):
    name = "mamba-block-size-scaled-by-w"
    bug_class = (
        "19. the DCP factor applied to every group's block span, Mamba states included (vllm#49962: KV offload stored 2 of 4 Mamba blocks)"
    )
    description = (
        "every group's manager block size is B*W, right for sharded attention but wrong for a replicated "
        "Mamba state: an align-mode state group believes one block-table entry spans B*W tokens, so it "
        "allocates and releases its state blocks at entries the kernel, which indexes the state by "
        "(seq_len - 1) // B, never uses"
    )
    configs = ({"mamba_cache_mode": "align", "block_size": 16},)
    """Position-indexed state blocks (align mode) of 16 tokens; in 'none' mode one block spans
    max_model_len tokens, so the bug cannot show there."""

    def applies_to(self, geometries) -> bool:
        return any(_is_align_state(g) for g in geometries)

    def group_geometry(self, group_id, group, config):
        geometry = super().group_geometry(group_id, group, config)
        if geometry.storage is Storage.STATE:
            geometry = dataclasses.replace(geometry, manager_block_size=geometry.block_size * geometry.dcp_size)
        return geometry


class DcpTransformOnReplicated(Fault):
    name = "dcp-transform-on-replicated"
    bug_class = (
        "20. the DCP slot transform (owner mask and local offset) applied to every group, replicated ones "
        "included (vllm#57260: silent corruption of Mamba state, sliding windows, chunked local)"
    )
    description = (
        "the write path maps every group through the sharded owner/local-offset transform: a replicated "
        "paged group keeps only the owner rank's writes, at local offsets inside virtual blocks of B*W "
        "positions; a Mamba state (one state per page, so the offset drops out) is written only by the "
        "rank owning its position, and the other replicas go stale"
    )

    @staticmethod
    def _hit(g: GroupGeometry) -> bool:
        return g.replicated and g.dcp_size > 1 and g.storage in (Storage.PAGED, Storage.STATE)

    def applies_to(self, geometries) -> bool:
        return any(self._hit(g) for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        g = geometry
        if not self._hit(g):
            return slots, index
        W, I = g.dcp_size, g.interleave_size
        owned = owner_rank(index, dcp_size=W, interleave_size=I) == dcp_rank
        if g.storage is Storage.STATE:
            return np.where(owned, slots, PAD), index
        B = g.block_size
        vb, off = np.divmod(np.asarray(index, np.int64), B * W)
        loc = (off // (W * I)) * I + off % I
        row = np.asarray(block_row, np.int64)
        return np.where(owned, row[vb] * B + loc, PAD), index
