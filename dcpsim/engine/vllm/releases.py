"""The vLLM releases dcpsim knows, and the one table of the code shapes each decision has had.

``VLLM_RELEASES``: every minor release from 0.23 (the core vllm-ascend 0.23.0 runs on) to the
newest. ``vllm_table(runner)``: per decision, the shapes its code has had (where, with which
leading parameters, in which releases), newest first; ``dcpsim.engine.loading.bindings.bind``
finds the one a tree holds. The adapter's modules branch on the bound shape's name only.

The releases of each shape were measured by probing every release's unpacked wheel
(``tests/dist/test_vllm_releases.py`` checks the table against them).
"""

from __future__ import annotations

from dcpsim.engine.loading.bindings import Decision, Shape, span

VLLM_RELEASES = ("0.23.0", "0.24.0", "0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""Every vLLM release dcpsim binds, oldest first; ``engine fetch vllm`` takes the newest."""
NEWEST = VLLM_RELEASES[-1]


def since(first: str, last: str | None = None) -> tuple[str, ...]:
    """The known releases from ``first`` to ``last`` (default the newest), both included."""
    return span(VLLM_RELEASES, first, last)


_V2 = "vllm.v1.worker.gpu.block_table"
_V2_HEAD = ("max_num_tokens", "idx_mapping", "query_start_loc", "pos", "block_table_ptrs", "block_table_strides", "block_sizes")
_V2_TAIL = ("slot_mappings_ptr", "slot_mappings_stride", "cp_rank", "CP_SIZE", "CP_INTERLEAVE", "PAD_ID", "TRITON_BLOCK_SIZE")
_V1 = "vllm.v1.worker.block_table"
_V1_HEAD = ("num_tokens", "max_num_tokens", "query_start_loc_ptr", "positions_ptr", "block_table_ptr", "block_table_stride")
_V1_CP = ("TOTAL_CP_WORLD_SIZE", "TOTAL_CP_RANK", "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE")

WRITE_V2 = Decision(
    "write_slots",
    (
        Shape("v2", _V2, "_compute_slot_mappings_kernel", (*_V2_HEAD, "slot_mapping_enabled", "dcp_sharded", *_V2_TAIL), since("0.32.0")),
        Shape(
            "v2-kernel-blocks",
            _V2,
            "_compute_slot_mappings_kernel",
            (*_V2_HEAD, "kernel_block_sizes", "slot_mapping_enabled", "dcp_sharded", *_V2_TAIL),
            ("0.31.0",),
        ),
        Shape(
            "v2-kernel-blocks-all-sharded",
            _V2,
            "_compute_slot_mappings_kernel",
            (*_V2_HEAD, "kernel_block_sizes", "slot_mapping_enabled", *_V2_TAIL),
            since("0.29.0", "0.30.0"),
        ),
        Shape("v2-all-sharded", _V2, "_compute_slot_mappings_kernel", (*_V2_HEAD, *_V2_TAIL), since("0.23.0", "0.28.0")),
    ),
)
"""Model runner v2's slot-mapping kernel (``--vllm-runner v2``, the default)."""

WRITE_V1 = Decision(
    "write_slots",
    (
        Shape(
            "v1",
            _V1,
            "ComputeSlotMappingKernel.kernel",
            (*_V1_HEAD, "slot_mapping_ptr", "KV_CACHE_BLOCK_SIZE", *_V1_CP),
            since("0.32.0", "0.33.0"),
        ),
        Shape(
            "v1-kernel-blocks",
            _V1,
            "ComputeSlotMappingKernel.kernel",
            (*_V1_HEAD, "block_size", "slot_mapping_ptr", "KV_CACHE_BLOCK_SIZE", "BLOCKS_PER_KV_BLOCK", *_V1_CP),
            since("0.29.0", "0.31.0"),
        ),
        Shape(
            "v1-function",
            _V1,
            "_compute_slot_mapping_kernel",
            (*_V1_HEAD, "block_size", "slot_mapping_ptr", "KV_CACHE_BLOCK_SIZE", "BLOCKS_PER_KV_BLOCK", *_V1_CP),
            since("0.26.0", "0.28.0"),
        ),
        Shape(
            "v1-function-page",
            _V1,
            "_compute_slot_mapping_kernel",
            (*_V1_HEAD, "block_size", "slot_mapping_ptr", *_V1_CP),
            since("0.23.0", "0.25.1"),
        ),
    ),
    absent=("0.34.0",),
    absent_reason="has no model runner v1 block table (vllm/v1/worker/block_table.py is gone); use --vllm-runner v2",
)
"""Model runner v1's slot-mapping kernel (``--vllm-runner v1``)."""

LOCAL_LENS = Decision(
    "local_seq_lens",
    (
        Shape(
            "dcp-local-seq-lens",
            "vllm.v1.attention.backends.utils",
            "get_dcp_local_seq_lens",
            ("seq_lens", "dcp_size", "dcp_rank", "cp_kv_cache_interleave_size"),
            VLLM_RELEASES,
        ),
    ),
)
"""The local lengths (and, per token, the query bounds)."""

KERNEL_TABLE = Decision(
    "kernel_block_table",
    (
        Shape(
            "attention-group",
            "vllm.v1.worker.utils",
            "AttentionGroup.map_to_kernel_block_table",
            ("self", "block_table", "ubatch_idx"),
            since("0.32.0"),
        ),
    ),
    absent=since("0.23.0", "0.31.0"),
    absent_reason="has no AttentionGroup.map_to_kernel_block_table (its kernels take the block size directly); reference",
)
"""The kernel block table when the kernel block is smaller than the page (``Bk < B``)."""

TABLE_WIDTH = Decision(
    "block_table_width",
    (
        Shape(
            "interface",
            "vllm.v1.kv_cache_interface",
            "get_block_table_width",
            ("max_num_blocks", "block_size", "token_alignment"),
            since("0.34.0"),
        ),
        Shape("worker", _V1, "get_block_table_width", ("max_num_blocks", "block_size", "token_alignment"), since("0.32.0", "0.33.0")),
        Shape(
            "worker-kernel-blocks",
            _V1,
            "get_block_table_width",
            ("max_num_blocks", "block_size", "kernel_block_size", "token_alignment"),
            since("0.27.1", "0.31.0"),
        ),
    ),
    absent=since("0.23.0", "0.26.0"),
    absent_reason="has no get_block_table_width (rows are max_num_blocks_per_req wide, or, before 0.26.0, as the reference sizes them)",
)
"""The worker's block-table row width (``max_num_blocks_per_req`` aligned)."""

SPEC_CLASSES = Decision(
    "group_geometry",
    (
        Shape("dcp-sharded", "vllm.v1.kv_cache_interface", "KVCacheSpec", ("block_size", "dcp_sharded"), since("0.31.0")),
        Shape("all-sharded", "vllm.v1.kv_cache_interface", "KVCacheSpec", ("block_size",), since("0.23.0", "0.30.0"), exact=True),
    ),
)
"""vLLM's spec classes: with a ``dcp_sharded`` field (a group may be replicated), or without
(every attention group is sharded; a ``dcp_replicated`` group is refused)."""

MERGE_ALLGATHER = Decision(
    "merge_allgather",
    (
        Shape("dcp", "vllm.v1.attention.ops.dcp", "cp_lse_ag_out_rs", ("cp_attn_out", "cp_attn_lse", "cp_group"), since("0.29.0")),
        Shape(
            "common",
            "vllm.v1.attention.ops.common",
            "cp_lse_ag_out_rs",
            ("cp_attn_out", "cp_attn_lse", "cp_group"),
            since("0.23.0", "0.28.0"),
        ),
    ),
)
"""The all-gather combine wrapper (and its ``CPTritonContext``)."""

MERGE_ALLTOALL = Decision(
    "merge_alltoall",
    (
        Shape("dcp", "vllm.v1.attention.ops.dcp", "dcp_a2a_lse_reduce", ("cp_attn_out", "cp_attn_lse", "cp_group"), since("0.29.0")),
        Shape(
            "dcp-alltoall",
            "vllm.v1.attention.ops.dcp_alltoall",
            "dcp_a2a_lse_reduce",
            ("cp_attn_out", "cp_attn_lse", "cp_group"),
            since("0.23.0", "0.28.0"),
        ),
    ),
)
"""The all-to-all combine wrapper and its pack/unpack kernels."""

SPARSE_FILTER = Decision(
    "sparse_local_keys",
    (
        Shape(
            "filter-and-convert",
            "vllm.v1.attention.backends.mla.sparse_utils",
            "triton_filter_and_convert_dcp_index",
            ("req_id", "block_table", "token_indices", "dcp_size", "dcp_rank", "cp_kv_cache_interleave_size"),
            since("0.25.1"),
        ),
    ),
    absent=("0.23.0", "0.24.0"),
    absent_reason="has no DCP top-k filter (sparse_utils.triton_filter_and_convert_dcp_index); reference",
)
"""Sparse attention's DCP filter of the top-k ids."""

KV_MANAGER = Decision(
    "kv_cache_manager",
    (
        Shape(
            "max-in-flight",
            "vllm.v1.core.kv_cache_manager",
            "KVCacheManager.__init__",
            ("self", "kv_cache_config", "max_model_len", "scheduler_block_size", "hash_block_size", "max_in_flight_tokens"),
            since("0.26.0"),
        ),
        Shape(
            "max-num-batched",
            "vllm.v1.core.kv_cache_manager",
            "KVCacheManager.__init__",
            ("self", "kv_cache_config", "max_model_len", "scheduler_block_size", "hash_block_size", "max_num_batched_tokens"),
            since("0.23.0", "0.25.1"),
        ),
    ),
)
"""vLLM's ``KVCacheManager`` (the scheduler side): what its token budget is called."""


HYBRID_RULE = Decision(
    "hybrid_manager_rule",
    (Shape("post-init", "vllm.config.vllm", "VllmConfig.__post_init__", ("self",), VLLM_RELEASES),),
)
"""Where vLLM decides whether its hybrid KV cache manager runs: ``VllmConfig.__post_init__`` turns it
off for a model with an ``attention_chunk_size`` (always beside an EAGLE-style drafter, else unless
``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``). Read with ``ast``, never imported
(``dcpsim.engine.vllm.hybrid_layout.read_rule`` finds the rule's lines inside it)."""

KV_LAYOUT = Decision(
    "kv_cache_layout",
    (
        Shape("planning", "vllm.v1.core.kv_cache_planning", "unify_hybrid_kv_cache_specs", ("kv_cache_spec",), since("0.33.0")),
        Shape("utils", "vllm.v1.core.kv_cache_utils", "unify_hybrid_kv_cache_specs", ("kv_cache_spec",), since("0.23.0", "0.32.0")),
    ),
)
"""What the layers' specs become with the hybrid manager off (``get_kv_cache_groups`` calls it):
local-attention specs promoted to full attention where a full-attention layer is beside them
(from 0.31.0 sharded and replicated layers apart)."""


def vllm_table(runner: str) -> tuple[Decision, ...]:
    """The decisions of ``--engine vllm`` with model runner ``runner`` (``v2`` or ``v1``)."""
    write = WRITE_V2 if runner == "v2" else WRITE_V1
    return (
        write,
        LOCAL_LENS,
        KERNEL_TABLE,
        TABLE_WIDTH,
        SPEC_CLASSES,
        MERGE_ALLGATHER,
        MERGE_ALLTOALL,
        SPARSE_FILTER,
        KV_MANAGER,
        HYBRID_RULE,
        KV_LAYOUT,
    )


_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_NIXL_ARGS = ("self", "vllm_config", "engine_id", "kv_cache_config")
NIXL_SCHEDULER = Decision(
    "nixl_scheduler",
    (
        Shape("pull", f"{_NIXL}.pull_scheduler", "NixlPullConnectorScheduler.__init__", _NIXL_ARGS, since("0.24.0")),
        Shape("single", f"{_NIXL}.scheduler", "NixlConnectorScheduler.__init__", _NIXL_ARGS, ("0.23.0",)),
    ),
)
"""The NIXL connector's scheduler side (a P/D decode instance under ``--vllm-scheduler full``):
from 0.24.0 ``nixl/pull_scheduler.py`` over ``nixl/base_scheduler.py`` (``nixl/scheduler.py`` only
re-exports it), in 0.23.0 the whole class in ``nixl/scheduler.py``. Bound on demand
(``dcpsim.engine.vllm.nixl_scheduler``), not in ``vllm_table``: only a P/D decode instance loads it."""

NIXL_SUPPORT = {"pull": (f"{_NIXL}.metadata", f"{_NIXL}.base_scheduler"), "single": (f"{_NIXL}.metadata",)}
"""The modules each NIXL shape's class imports that run for real beside it (the rest are stubs)."""
