"""The vllm-ascend releases dcpsim knows, the vLLM release each runs on, and the one table of
the code shapes its DCP decisions have had (``dcpsim.engine.loading.bindings``)."""

from __future__ import annotations

from dcpsim.engine.loading.bindings import Decision, Shape

ASCEND_RELEASES = ("0.23.0.post1",)
"""Every vllm-ascend release dcpsim binds; ``engine fetch vllm-ascend`` takes the newest."""
NEWEST = ASCEND_RELEASES[-1]
VLLM_OF = {"0.23.0.post1": "0.23.0"}
"""The vLLM release each plugin release runs on (its ``vllm/`` core: the KV cache manager, the
spec classes, the scheduler)."""

BLOCK_TABLE = "vllm_ascend.worker.block_table"
PCP_UTILS = "vllm_ascend.worker.pcp_utils"
PLATFORM = "vllm_ascend.platform"

SLOT_MAPPING = Decision(
    "write_slots",
    (
        Shape(
            "pcp-dcp",
            BLOCK_TABLE,
            "BlockTable._compute_pcp_dcp_slot_mapping",
            ("self", "req_indices", "positions"),
            ASCEND_RELEASES,
            exact=True,
        ),
    ),
)
"""``BlockTable._compute_pcp_dcp_slot_mapping``: the slot of each position on this rank
(PCP x DCP, ``rank = pcp_rank * dcp + dcp_rank``), -1 elsewhere, in plain torch."""

LOCAL_LENS = Decision(
    "local_seq_lens",
    (
        Shape(
            "cp-local-seq-lens",
            PCP_UTILS,
            "PCPManager._get_cp_local_seq_lens",
            ("self", "seq_lens", "pcp_world_size", "dcp_world_size", "cp_kv_cache_interleave_size"),
            ASCEND_RELEASES,
        ),
    ),
)
"""``PCPManager._get_cp_local_seq_lens``: every (PCP, DCP) rank's local length of each request."""

ASCEND_TABLE = (SLOT_MAPPING, LOCAL_LENS)
