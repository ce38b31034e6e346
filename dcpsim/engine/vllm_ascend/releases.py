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

TABLE_WIDTH = Decision(
    "block_table_width",
    (
        Shape(
            "multi-group-block-table",
            BLOCK_TABLE,
            "MultiGroupBlockTable.__init__",
            ("self", "max_num_reqs", "max_model_len", "max_num_batched_tokens", "pin_memory", "device", "block_sizes"),
            ASCEND_RELEASES,
        ),
    ),
)
"""``MultiGroupBlockTable``: each group's ``BlockTable.max_num_blocks_per_req``, the entries of a
worker row (``cdiv(max_model_len, B * pcp * dcp)``; a compressed group's divided by its ratio, a
Mamba group's times ``pcp * dcp``; never aligned to 128 tokens)."""
CP_UTILS = "vllm.v1.worker.cp_utils"
"""vLLM's module whose ``get_total_cp_world_size`` the table's width reads (loaded from the vLLM tree)."""

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

SPEC_DECODE_MASK = Decision(
    "spec_decode_mask",
    (
        Shape(
            "mtp-mask-for-decode",
            PCP_UTILS,
            "PCPManager.generate_mtp_attention_mask_for_decode",
            ("self", "decode_num_computed_tokens", "decode_num_scheduled_tokens"),
            ASCEND_RELEASES,
        ),
    ),
)
"""``PCPManager.generate_mtp_attention_mask_for_decode``: the verify mask of the decode rows of a
speculative step under DCP/PCP (True: masked), over the rank's local keys."""

PCP_SPLIT = Decision(
    "pcp_split",
    (
        Shape(
            "update-tokens-for-pcp",
            PCP_UTILS,
            "PCPManager.update_tokens_for_pcp",
            ("self", "num_scheduled_tokens", "arange_np"),
            ASCEND_RELEASES,
        ),
    ),
)
"""``PCPManager.update_tokens_for_pcp``: a prefill row padded to a multiple of ``2 * pcp`` and cut
into ``2 * pcp`` chunks, PCP rank ``r`` computing chunks ``r`` and ``2 * pcp - 1 - r`` (DualChunkSwap),
with the index that restores the all-gathered chunks to query order and the mask of real tokens."""
PCP_DECODE_ROWS = Decision(
    "pcp_decode_rows",
    (
        Shape(
            "classify-decode-request-mask",
            PCP_UTILS,
            "PCPManager.classify_decode_request_mask",
            ("self", "num_scheduled_tokens", "num_computed_tokens", "num_prompt_tokens", "decode_threshold"),
            ASCEND_RELEASES,
        ),
    ),
)
"""``PCPManager.classify_decode_request_mask``: the rows PCP does not split (a decode: context, at
most ``1 + num_speculative_tokens`` tokens, the prompt done); every other row is split, however short."""
PCP_METADATA = Decision(
    "pcp_query_keys",
    (
        Shape(
            "generate-pcp-metadata",
            PCP_UTILS,
            "PCPManager.generate_pcp_metadata",
            (
                "self",
                "total_num_scheduled_tokens",
                "query_lens",
                "input_batch",
                "num_scheduled_tokens",
                "block_table_tensor",
                "num_reqs_padded",
                "num_reqs",
            ),
            ASCEND_RELEASES,
        ),
    ),
)
"""``PCPManager.generate_pcp_metadata``: the PCP prefill's attention index lists, which rows of the
all-gathered row each head and tail query chunk reads unmasked (``kv_with_q_*_nomask_idx``) and
masked causally (``kv_with_q_*_mask_idx``)."""
ATTENTION_UTILS = "vllm_ascend.attention.utils"
"""The module ``generate_pcp_metadata`` imports its metadata class from at call time (a stand-in
there: the real module imports vLLM's forward context and KV transfer)."""

COMMON_CP = "vllm_ascend.attention.context_parallel.common_cp"
MERGE_EXCHANGE = Decision(
    "merge_exchange",
    (Shape("attn-out-lse-all-to-all", COMMON_CP, "_process_attn_out_lse", ("attn_output", "softmax_lse"), ASCEND_RELEASES),),
)
"""``_process_attn_out_lse``: a rank's ``[q, H, D + 1]`` partials, head slice ``i`` sent to DCP rank ``i``."""
MERGE_UPDATE = Decision(
    "merge_update",
    (Shape("npu-attention-update", COMMON_CP, "_npu_attention_update", ("head_size", "attn_out_lse"), ASCEND_RELEASES),),
)
"""``_npu_attention_update``: every rank's partials of this rank's heads, combined (the NPU op)."""
MERGE_COMBINE = Decision(
    "merge_combine",
    (Shape("update-out-and-lse", COMMON_CP, "_update_out_and_lse", ("out_list", "lse_list"), ASCEND_RELEASES),),
)
"""``_update_out_and_lse``: the plugin's plain-torch LSE combine, standing for ``torch_npu.npu_attention_update``."""
MERGE_DECISIONS = ("merge_exchange", "merge_update", "merge_combine")
"""The three pieces of ``merge_across_ranks``: the plugin merges only where its tree holds all three."""

PATCH_COORDINATOR = "vllm_ascend.patch.platform.patch_kv_cache_coordinator"
PATCH_UTILS = "vllm_ascend.patch.platform.patch_kv_cache_utils"
COORDINATOR_SUPPORT = ("vllm_ascend.core.kv_cache_interface", "vllm_ascend.core.single_type_kv_cache_manager")
"""What the plugin's coordinator builds and tests against (loaded with it): its spec classes
(``AscendMLAAttentionSpec``) and its per-spec managers (``get_manager_for_kv_cache_spec``)."""
COORDINATOR = Decision(
    "kv_cache_coordinator",
    (
        Shape(
            "ascend-get-kv-cache-coordinator",
            PATCH_COORDINATOR,
            "get_kv_cache_coordinator",
            ("kv_cache_config", "max_model_len", "max_num_batched_tokens", "use_eagle", "enable_caching"),
            ASCEND_RELEASES,
        ),
    ),
)
"""``get_kv_cache_coordinator`` of the plugin's patch: vLLM's ``KVCacheManager`` builds its
coordinator through it (``AscendHybridKVCacheCoordinator`` for several groups with caching on,
over the plugin's per-spec managers; vLLM's own otherwise)."""
BLOCK_SIZES = Decision(
    "kv_cache_block_sizes",
    (
        Shape(
            "ascend-resolve-block-sizes",
            PATCH_UTILS,
            "_ascend_resolve_kv_cache_block_sizes",
            ("kv_cache_config", "vllm_config"),
            ASCEND_RELEASES,
        ),
    ),
)
"""The plugin's ``resolve_kv_cache_block_sizes``: several groups under DCP/PCP schedule at
``lcm(B) * dcp * pcp`` and hash at ``gcd(B)`` (vLLM 0.23.0's own refuses them)."""
SCHEDULER_DECISIONS = ("kv_cache_coordinator", "kv_cache_block_sizes")

SFA_CP = "vllm_ascend.attention.context_parallel.sfa_cp"
SPARSE_REMAP = Decision(
    "sparse_local_keys",
    (Shape("sfa-remap-sparse-indices", SFA_CP, "AscendSFADCPImpl._remap_sparse_indices", ("self", "topk_indices"), ASCEND_RELEASES),),
)
"""``AscendSFADCPImpl._remap_sparse_indices``: the global top-k ids of sparse attention mapped to
this rank's local keys (float32 arithmetic), compacted to the front in top-k order, -1 after."""

MLA_CP = "vllm_ascend.attention.context_parallel.mla_cp"
MLA_V1 = "vllm_ascend.attention.mla_v1"
"""The module of the MLA builder ``AscendMlaCPMetadataBuilder`` derives from: its
``build_chunked_metadata`` (the chunks of the whole context) is the one the CP builder calls
first; loaded with ``mla_cp``, under a placeholder ``torch.npu`` (a class default of its metadata)."""
CONTEXT_GATHER = Decision(
    "context_gather",
    (
        Shape(
            "mla-cp-chunked-metadata",
            MLA_CP,
            "AscendMlaCPMetadataBuilder.build_chunked_metadata",
            ("self", "common_prefix_len", "common_attn_metadata"),
            ASCEND_RELEASES,
        ),
    ),
)
"""``AscendMlaCPMetadataBuilder.build_chunked_metadata``: the chunked context of an MLA prefill
under DCP/PCP, every request cut alike into pieces of ``workspace // (prefills with a context)``
tokens rounded down to ``lcm(B, I * dcp * pcp)``, piece ``i`` of each in chunk ``i``; each rank
loads ``cdiv(piece, I * dcp * pcp) * I`` local rows of a piece (padded to ``I``), of which the
attention keeps the rank's own keys (``_reorg_kvcache``)."""

ASCEND_TABLE = (
    SLOT_MAPPING,
    TABLE_WIDTH,
    LOCAL_LENS,
    SPEC_DECODE_MASK,
    PCP_SPLIT,
    PCP_DECODE_ROWS,
    PCP_METADATA,
    MERGE_EXCHANGE,
    MERGE_UPDATE,
    MERGE_COMBINE,
    COORDINATOR,
    BLOCK_SIZES,
    SPARSE_REMAP,
    CONTEXT_GATHER,
)
