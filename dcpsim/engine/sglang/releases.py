"""The SGLang releases dcpsim knows, and the one table of the code shapes each decision has had.

``SGLANG_RELEASES``: 0.5.18 (the first with ``kernels/ops/attention/dcp_kernels.py``) to the
newest. ``SGLANG_TABLE``: per decision, the shapes its code has had, newest first;
``dcpsim.engine.loading.bindings.bind`` finds the one a tree holds, and the adapter branches on
the bound shape's name only. Measured by probing every release's unpacked wheel
(``tests/dist/test_engine_releases.py`` checks the table against them).
"""

from __future__ import annotations

from dcpsim.engine.loading.bindings import Decision, Shape, span

SGLANG_RELEASES = ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
"""Every SGLang release dcpsim binds, oldest first; ``engine fetch sglang`` takes the newest."""
NEWEST = SGLANG_RELEASES[-1]


def since(first: str, last: str | None = None) -> tuple[str, ...]:
    return span(SGLANG_RELEASES, first, last)


LAYOUT = "sglang.srt.layers.dcp.layout"
WRITES = "sglang.kernels.ops.kvcache.mla_buffer"
KERNELS = "sglang.kernels.ops.attention.dcp_kernels"
POOL = "sglang.srt.mem_cache.memory_pool"
BACKEND = "sglang.srt.layers.attention.triton_backend"

LOCAL_LENS = Decision(
    "local_seq_lens",
    (
        Shape("interleave", LAYOUT, "get_dcp_lens", ("lens", "dcp_size", "dcp_rank", "start", "interleave_size"), since("0.5.22")),
        Shape("token", LAYOUT, "get_dcp_lens", ("lens", "dcp_size", "dcp_rank", "start"), since("0.5.18", "0.5.21")),
    ),
)
"""``get_dcp_lens``: with an ``interleave_size`` (0.5.22 on), or tokens dealt one by one (I = 1)."""

QUERY_BOUNDS = Decision(
    "query_local_bounds",
    (
        Shape(
            "chain-spec",
            LAYOUT,
            "get_dcp_chain_spec_lens",
            ("total_kv_lens", "tokens_per_req", "dcp_size", "dcp_rank", "interleave_size"),
            since("0.5.22"),
        ),
    ),
    absent=since("0.5.18", "0.5.21"),
    absent_reason="has no get_dcp_chain_spec_lens (per-token frontiers of a chain); reference",
)

LOCALIZE = Decision(
    "npu_localize",
    (Shape("localize", LAYOUT, "localize_dcp_indices", ("indices", "dcp_size", "dcp_rank", "interleave_size"), since("0.5.22")),),
    absent=since("0.5.18", "0.5.21"),
    absent_reason="has no localize_dcp_indices: no NPU layout (whole pages) under DCP; --sglang-platform npu is refused",
)

MLA_WRITE = Decision(
    "mla_write",
    (
        Shape(
            "dcp-sharded-triton",
            WRITES,
            "set_mla_kv_buffer_dcp_sharded_triton",
            ("kv_buffer", "loc", "cache_k_nope", "cache_k_rope", "reserved_skip_index"),
            since("0.5.20"),
        ),
    ),
    absent=("0.5.18", "0.5.19"),
    absent_reason="has no set_mla_kv_buffer_dcp_sharded_triton (its MLA pool masks the rows in "
    "MLATokenToKVPool.set_kv_buffer, which is not loaded); reference",
)
"""SGLang's Triton MLA write at the widened ids (the sampled tokens of a write)."""

MLA_WRITE_REST = Decision(
    "mla_write_rest",
    (
        Shape(
            "naive",
            WRITES,
            "set_mla_kv_buffer_naive",
            ("kv_buffer", "loc", "cache_k_nope", "cache_k_rope", "reserved_skip_index", "dcp_world_size", "dcp_rank"),
            since("0.5.22"),
        ),
    ),
    absent=since("0.5.18", "0.5.21"),
    absent_reason="has no torch-native set_mla_kv_buffer_naive; the reference places the tokens the Triton kernel does not run on",
)
"""SGLang's torch-native MLA scatter, for the tokens of a write its Triton kernel does not run on."""

MHA_WRITE = Decision(
    "mha_write",
    (
        Shape(
            "triton-backend",
            BACKEND,
            "TritonAttnBackend._set_kv_buffer",
            ("self", "forward_batch", "layer", "loc_info", "k", "v"),
            since("0.5.18"),
        ),
    ),
)
MHA_POOL = Decision(
    "mha_pool",
    (
        Shape(
            "masked",
            POOL,
            "MHATokenToKVPool.set_kv_buffer",
            ("self", "layer", "loc_info", "cache_k", "cache_v", "k_scale", "v_scale", "layer_id_override", "dcp_kv_mask"),
            since("0.5.18"),
        ),
    ),
)
COMBINE = Decision(
    "merge_alltoall",
    (Shape("combine", KERNELS, "dcp_lse_combine_triton", ("recv_output", "recv_lse", "is_lse_base_on_e", "return_lse"), since("0.5.18")),),
)
CORRECT = Decision(
    "merge_allgather",
    (Shape("correct", KERNELS, "correct_attn_out", ("out", "lses", "cp_rank", "ctx", "new_output", "is_lse_base_on_e"), since("0.5.18")),),
)
TOKEN_INDICES = Decision(
    "attention_metadata",
    (
        Shape(
            "token-indices",
            KERNELS,
            "create_triton_kv_indices_for_dcp_triton",
            ("req_to_token_ptr", "req_pool_indices_ptr", "dcp_kernel_lens_ptr", "kv_indptr", "kv_start_idx", "kv_indices_ptr"),
            since("0.5.18"),
        ),
    ),
)
_PAGES = ("req_to_token_ptr", "req_pool_indices_ptr", "local_seq_lens_ptr", "block_kv_indices_ptr")
PAGE_TABLE = Decision(
    "build_attention_metadata",
    (
        Shape(
            "v2p",
            KERNELS,
            "create_mla_kv_page_table_for_dcp",
            (*_PAGES, "v2p_ptr", "req_to_token_stride", "block_table_stride", "PHYSICAL_PAGE_SIZE"),
            since("0.5.22"),
        ),
        Shape(
            "v2p-mult",
            KERNELS,
            "create_mla_kv_page_table_for_dcp",
            (*_PAGES, "v2p_ptr", "req_to_token_stride", "block_table_stride", "mult"),
            since("0.5.20", "0.5.21"),
        ),
        Shape(
            "no-v2p",
            KERNELS,
            "create_mla_kv_page_table_for_dcp",
            (*_PAGES, "req_to_token_stride", "block_table_stride", "PHYSICAL_PAGE_SIZE"),
            since("0.5.18", "0.5.19"),
        ),
    ),
)
"""SGLang's MLA page-table builder (``kv_indices``): with a virtual-to-physical map, with a
sub-pool multiplier too (0.5.20, 0.5.21), or without either (0.5.18, 0.5.19)."""

SGLANG_TABLE = (
    LOCAL_LENS,
    QUERY_BOUNDS,
    LOCALIZE,
    MLA_WRITE,
    MLA_WRITE_REST,
    MHA_WRITE,
    MHA_POOL,
    COMBINE,
    CORRECT,
    TOKEN_INDICES,
    PAGE_TABLE,
)
