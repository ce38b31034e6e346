"""Layout faults: a sharded or replicated group placed, sized, released or written wrongly
(bug classes 2, 5-10 and 18 of docs/dcp-semantics.md section 8, and the write guard's foreign block)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dcpsim.engine.faults.base import Fault, has_sharded_attention, is_replicated_paged
from dcpsim.engine.geometry import GroupGeometry
from dcpsim.model.arith import cdiv
from dcpsim.model.grouping import KVCacheGroupSpec
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import PAD, owner_rank, ring_slot_mapping
from dcpsim.model.specs import FullAttentionSpec


class KernelVirtualBlock(Fault):
    name = "kernel-virtual-block"
    bug_class = "2. virtual block formed from the kernel block size (Bk*W) instead of B*W when Bk < B"
    description = (
        "sharded groups compute owner and local offset inside virtual blocks of Bk*W states (kernel "
        "coordinates) instead of B*W; with I > Bk slots collide and some ranks store nothing"
    )
    needs = {"kernel_block_size": 16}
    configs = ({"block_size": 64, "cp_kv_cache_interleave_size": 64},)
    """With I dividing Bk both coordinate systems give the same slots, so I = B = 64 > Bk = 16."""

    @staticmethod
    def _hit(g: GroupGeometry) -> bool:
        kbs = g.kernel_block_size
        return g.sharded and g.storage is not Storage.RING and kbs is not None and kbs < g.states_per_page

    def applies_to(self, geometries) -> bool:
        return any(self._hit(g) for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if not self._hit(geometry):
            return slots, index
        # virtual blocks of Bk * W kernel-block states, owner and local offset inside them,
        # the kernel block table indexed by that virtual block
        kernel, W, I = geometry.kernel_block_size, geometry.dcp_size, geometry.interleave_size
        kernel_ids = self.kernel_block_table(geometry, block_row)
        vb, off = np.divmod(np.asarray(index, np.int64), kernel * W)
        owned = (off // I) % W == dcp_rank
        loc = (off // (W * I)) * I + off % I
        return np.where(owned, kernel_ids[vb] * kernel + loc, PAD), index


class ReplicatedScaledByW(Fault):
    name = "replicated-scaled-by-w"
    bug_class = "5. a replicated state (Mamba, sliding window) scaled by W as if sharded (vllm#50493)"
    description = (
        "replicated groups get block tables of cdiv(max_model_len, B*W) entries, as if sharded: "
        "narrower than the attention-metadata builder expects, and a request longer than "
        "max_model_len / W overflows its row"
    )
    configs = ({"decode_context_parallel_size": 4},)

    def applies_to(self, geometries) -> bool:
        return any(is_replicated_paged(g) for g in geometries)

    @staticmethod
    def _narrow_width(g: GroupGeometry, config) -> int:
        return cdiv(config.max_model_len, g.block_size * g.dcp_size)

    def group_geometry(self, group_id, group, config):
        geometry = super().group_geometry(group_id, group, config)
        if is_replicated_paged(geometry):
            geometry = dataclasses.replace(geometry, block_table_width=self._narrow_width(geometry, config))
        return geometry


def _drops_flag(group: KVCacheGroupSpec) -> bool:
    """A merged (not uniform-type) replicated full-attention group: dropping
    ``dcp_replicated`` turns it into a valid sharded group, silently. (A sliding window
    that lost the flag is refused loudly by the DCP group check.)"""
    spec = group.kv_cache_spec
    return isinstance(spec, FullAttentionSpec) and spec.dcp_replicated


class MergeDropsDcpReplicated(Fault):
    name = "merge-drops-dcp-replicated"
    bug_class = "6. merge of specs dropping dcp_replicated (a replicated group silently becomes sharded)"
    description = (
        "the engine merges each group's layer specs without dcp_replicated, so a replicated "
        "full-attention group (a draft model's) is laid out, allocated and written as sharded"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.replicated and g.dcp_size > 1 and isinstance(g.group_spec, FullAttentionSpec) for g in geometries)

    def kv_cache_groups(self, layer_specs):
        groups = []
        for group in super().kv_cache_groups(layer_specs):
            if _drops_flag(group):
                merged = dataclasses.replace(group.kv_cache_spec, dcp_replicated=False)
                group = KVCacheGroupSpec(group.layer_names, merged)
            groups.append(group)
        return groups


class ReplicatedOwnerOnly(Fault):
    name = "replicated-owner-only"
    bug_class = "7. a replicated group masked like a sharded one (only the owner writes a position)"
    description = "in replicated groups only the position's owner rank writes it; the others keep holes"

    def applies_to(self, geometries) -> bool:
        return any(is_replicated_paged(g) for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if is_replicated_paged(geometry):
            owner = owner_rank(index, dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size)
            slots = np.where(owner == dcp_rank, slots, PAD)
        return slots, index


class SlidingWindowEarlyRelease(Fault):
    name = "sliding-window-early-release"
    bug_class = "8. sliding-window blocks released while still inside the window"
    description = (
        "a sliding-window manager releases one block too many: the block holding the first "
        "position still inside the window goes back to the pool and its entry becomes the null block"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.retention is Retention.WINDOW for g in geometries)

    def num_released_blocks(self, geometry, first_needed):
        n = super().num_released_blocks(geometry, first_needed)
        return n + 1 if geometry.retention is Retention.WINDOW and first_needed > 0 else n


class RingRejectedOverwrite(Fault):
    name = "ring-rejected-overwrite"
    bug_class = "9. ring rows of rejected drafts overwriting the accepted boundary"
    description = (
        "a compressor ring writes a speculative step's draft rows one row early, so the first "
        "draft lands on the row of the step's true token (the accepted boundary)"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.storage is Storage.RING and g.num_speculative_tokens > 0 for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if geometry.storage is Storage.RING and write.num_drafts:
            draft = index >= write.stop - write.num_drafts
            early = ring_slot_mapping(index - 1, int(block_row[0]), geometry.block_size)
            slots = np.where(draft, early, slots)
        return slots, index


class InterleaveOffByOne(Fault):
    name = "interleave-off-by-one"
    bug_class = (
        "10 (family). a writer whose rank ownership disagrees with the sharded cache's readers "
        "(the draft at W = 1 itself is draft-drops-dcp)"
    )
    description = (
        "sharded groups place each run of I positions on the next rank (owner ((p // I) + 1) % W "
        "instead of (p // I) % W): the symptom of a writer and readers disagreeing on ownership"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.sharded for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        if geometry.sharded:
            dcp_rank = (dcp_rank - 1) % geometry.dcp_size
        return super().write_slots(geometry, write, block_row, dcp_rank)


class AdmissionCapacityUnscaled(Fault):
    name = "admission-capacity-unscaled"
    bug_class = "18. a sharded group's capacity not scaled by W at admission (sglang#33448)"
    description = (
        "the scheduler counts a sharded group's blocks per B tokens instead of per B*W, so each "
        "request takes W times the blocks it fills: the pool holds 1/W of its real context and "
        "requests are rejected or stall"
    )
    layouts = ("vllm",)
    """Helix sizes its rows for the busiest rank (one spare entry); its own block counts are
    not the per-position ones this bug scales."""
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def blocks_needed(self, geometry, num_tokens):
        if geometry.sharded and geometry.storage is not Storage.RING:
            return cdiv(num_tokens, geometry.block_size)
        return super().blocks_needed(geometry, num_tokens)


class ForeignBlock(Fault):
    name = "foreign-block"
    bug_class = "not in section 8 (write-guard check): a write into a block the request does not hold (stale or off-by-one block index)"
    description = "positions that belong in the request's last block go to a block it does not hold"

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        page = geometry.states_per_page
        held = set(int(b) for b in block_row)
        stranger = next(b for b in range(1, len(held) + 2) if b not in held)
        last = int(block_row[-1])
        hit = (slots >= 0) & (slots // page == last)
        return np.where(hit, stranger * page + slots % page, slots), index
