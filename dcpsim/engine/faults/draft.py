"""Draft-model faults (MTP / EAGLE): the drafter's parallel config and paged plan
(bug classes 10 and 22)."""

from __future__ import annotations

import dataclasses

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.faults.metadata import plan_from_global_lens
from dcpsim.engine.geometry import GroupGeometry
from dcpsim.model.kinds import Storage


def _sharded_draft(g: GroupGeometry) -> bool:
    return g.draft and g.sharded and g.storage in (Storage.PAGED, Storage.RECORDS)


class DraftDropsDcp(Fault):
    name = "draft-drops-dcp"
    bug_class = (
        "10. draft model running with W = 1 against a sharded cache (local-inference-lab/vllm#72: "
        "acceptance collapse, three of four ranks attend to nothing)"
    )
    description = (
        "the draft model's parallel config silently drops decode_context_parallel_size, so its "
        "drafter builds attention metadata for W = 1 (every key local, a plain block table) over "
        "a cache the target shards across W ranks"
    )
    configs = ({"decode_context_parallel_size": 4},)

    def applies_to(self, geometries) -> bool:
        return any(_sharded_draft(g) for g in geometries)

    def draft_geometry(self, geometry):
        draft = super().draft_geometry(geometry)
        if not _sharded_draft(geometry):
            return draft
        return dataclasses.replace(
            draft,
            dcp_size=1,
            sharded=False,
            manager_block_size=geometry.block_size,
            block_table_width=geometry.block_table_width * geometry.dcp_size,
        )


class DraftIndptrFromGlobalLens(Fault):
    name = "draft-indptr-global"
    bug_class = "22. a draft's kv_indptr built from the global lengths (ROCm/ATOM#1746)"
    description = (
        "the drafter of a sharded draft builds its paged plan (kv_indptr, kv_indices, "
        "kv_last_page_len) from the global sequence lengths while the target's uses the local ones"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return any(_sharded_draft(g) for g in geometries)

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        if geometry.model != "draft" or not _sharded_draft(geometry):
            return meta
        return plan_from_global_lens(self, geometry, meta, block_rows)
