"""The engine configuration the specs and the scheduler read (vLLM field names)."""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.helix import KV_CACHE_LAYOUTS, check_helix_config
from dcpsim.model.parallel import ParallelLayout, check_parallel_sizes, default_tensor_parallel_size
from dcpsim.model.validate import check_int

__all__ = ["KV_CACHE_LAYOUTS", "KV_CACHE_REPORT_MODES", "SPECULATIVE_METHODS", "SimConfig"]

KV_CACHE_REPORT_MODES = ("incremental", "full")
SPECULATIVE_METHODS = ("ngram", "eagle", "mtp")
"""vLLM's ``speculative_config.method`` values dcpsim tells apart: a drafter without a KV
cache of its own (``ngram``), and the EAGLE-style drafters (``eagle``, ``mtp``) whose prefix-cache
hits drop the last cached block (section 5 of the semantics)."""


@dataclass(frozen=True)
class SimConfig:
    """What vLLM spreads over ModelConfig, ParallelConfig, SchedulerConfig and
    SpeculativeConfig, flattened to the fields that shape the KV cache.

    ``kernel_block_size`` is the attention kernel's block size ``Bk``; ``None``
    means ``Bk == B`` for every group (a group whose ``B`` it does not divide
    is rejected when the layout is validated).

    ``long_prefill_token_threshold`` caps the tokens one request gets in one step (0: no
    cap, as in vLLM), so a long prefill runs in short chunks while the rest of the budget
    admits other requests beside it.
    """

    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    num_speculative_tokens: int = 0
    kernel_block_size: int | None = None
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    draft_decode_context_parallel_size: int | None = None
    """The draft model's own ``decode_context_parallel_size`` (its ParallelConfig under
    speculative decoding): the target's (None), or 1 for a draft whose cache is
    replicated. A draft at 1 against a sharded cache is refused."""
    draft_layers: tuple[str, ...] = ()
    """The layers of the draft model (MTP / EAGLE); scenario files mark them ``draft = true``."""
    max_cudagraph_capture_size: int = 0
    """vLLM's ``compilation_config.max_cudagraph_capture_size``: uniform decode steps of at
    most this many tokens are padded to a captured size (0: no CUDA graphs, no padding)."""
    async_scheduling: bool = False
    """vLLM's ``scheduler_config.async_scheduling``: the next step is scheduled while the
    current one runs, so two batches are in flight (``max_concurrent_batches``)."""
    block_size: int | None = None
    """vLLM's ``cache_config.block_size`` (``--block-size``): the cache block size, in states
    per page. Attention layers that give no ``block_size`` of their own take it (``B * R``
    tokens for a compressed one). Under DCP it must be >= and a multiple of
    ``cp_kv_cache_interleave_size``, as vLLM 0.33.0 checks (``VllmConfig.validate_block_size``).
    None: every layer gives its own, and each sharded group's page is checked instead."""
    prefill_context_parallel_size: int = 1
    """vLLM's PCP size: prefills are split over this many ranks, whose KV is all-gathered;
    it multiplies the world but adds no KV shards (``dcpsim.model.parallel``)."""
    tensor_parallel_size: int | None = None
    """vLLM's TP size; the world is ``prefill_context_parallel_size * tensor_parallel_size``
    processes. None: ``default_tensor_parallel_size`` (the DCP size without PCP)."""
    num_attention_heads: int | None = None
    """The model's query heads (HF ``num_attention_heads``), before TP splits them. With
    ``num_key_value_heads``: the head layout of its GQA/MHA layers is checked under DCP
    (``dcpsim.model.heads``); None: not stated, not checked."""
    num_key_value_heads: int | None = None
    """The model's KV heads (HF ``num_key_value_heads``), before TP splits or replicates them."""
    draft_num_attention_heads: int | None = None
    """The draft model's query heads (its own head layout is checked as the target's)."""
    draft_num_key_value_heads: int | None = None
    """The draft model's KV heads."""
    chunked_prefill_workspace_size: int | None = None
    """Rows of the workspace an MLA prefill gathers its cached context into, chunk by chunk
    (``dcpsim.model.context_gather``). None: vLLM 0.33.0's rule,
    ``min(max(8 * max_model_len, 4 * max_num_seqs * B), 65536)``; either way rounded up to a
    multiple of ``lcm(B, W * I)`` (``B`` without DCP)."""
    kv_cache_report_mode: str = "incremental"
    """vLLM's KV events report mode (a request's ``kv_cache_report_mode``): ``incremental``
    advertises each block once, when it is cached; ``full`` also advertises again the cached
    blocks a prefix-cache hit reuses, so a router learns them (vllm#50118 lives there)."""
    speculative_method: str = "ngram"
    """vLLM's ``speculative_config.method``: ``eagle`` and ``mtp`` drafters need the hidden
    states of the last cached block, so a prefix-cache hit leaves one block of every KV-cache
    group to recompute (vLLM's ``use_eagle``: the EAGLE drop), and each step holds their KV
    lookahead (``num_lookahead_tokens``); ``ngram`` (the default) keeps every cached block and
    reserves no lookahead. Only read with ``num_speculative_tokens > 0``."""
    prefix_match_unit: int = 0
    """vLLM's ``cache_config.prefix_match_unit`` (``--prefix-match-unit``): the finest token
    boundary a prefix-cache hit may end on, finer than a block (partial-block hits, each copied
    into a private block before the request writes into it; semantics section 5). 0: hits in
    whole hit units only. It must divide every group's manager block size (``B*W`` sharded)."""
    kv_cache_layout: str = "vllm"
    """Where a sharded group's tokens live: ``vllm`` (by position, ``(p // I) % W``; section 2
    of the semantics) or ``helix`` (TensorRT-LLM's Helix: the prompt's blocks round-robin, then
    decode block ``k`` of ``B`` decode tokens on rank ``k % W``; section 15, ``dcpsim.model.helix``)."""

    def __post_init__(self) -> None:
        check_int("max_model_len", self.max_model_len, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        check_int("decode_context_parallel_size", self.decode_context_parallel_size, 1)
        check_int("cp_kv_cache_interleave_size", self.cp_kv_cache_interleave_size, 1)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, 0)
        check_int("prefix_match_unit", self.prefix_match_unit, 0)
        if self.draft_decode_context_parallel_size is not None:
            check_int("draft_decode_context_parallel_size", self.draft_decode_context_parallel_size, 1)
            if self.draft_decode_context_parallel_size not in (1, self.decode_context_parallel_size):
                raise ConfigError(
                    f"draft_decode_context_parallel_size {self.draft_decode_context_parallel_size}: a draft "
                    f"runs at the target's decode_context_parallel_size ({self.decode_context_parallel_size}, "
                    "sharing its KV layout) or at 1 (with a replicated cache)"
                )
        if self.kernel_block_size is not None:
            check_int("kernel_block_size", self.kernel_block_size, 1)
        if self.chunked_prefill_workspace_size is not None:
            check_int("chunked_prefill_workspace_size", self.chunked_prefill_workspace_size, 1)
        if self.block_size is not None:
            check_int("block_size", self.block_size, 1)
            self._check_interleave_fits_block_size()
        check_int("prefill_context_parallel_size", self.prefill_context_parallel_size, 1)
        if self.tensor_parallel_size is not None:
            check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_parallel_sizes(self.prefill_context_parallel_size, self.tp_size, self.decode_context_parallel_size)
        self._check_heads()
        if self.kv_cache_report_mode not in KV_CACHE_REPORT_MODES:
            raise ConfigError(f"kv_cache_report_mode must be one of {', '.join(KV_CACHE_REPORT_MODES)}, got {self.kv_cache_report_mode!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative_method!r}")
        for flag in ("enable_prefix_caching", "async_scheduling"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        check_helix_config(self)  # kv_cache_layout, and what Helix's cannot express
        if self.num_speculative_tokens + 1 > self.max_num_batched_tokens:
            raise ConfigError(
                "max_num_batched_tokens must hold one speculative step "
                f"(num_speculative_tokens + 1 = {self.num_speculative_tokens + 1}), "
                f"got {self.max_num_batched_tokens}"
            )

    def _check_heads(self) -> None:
        """The head counts, the target's and the draft's: positive, given in pairs."""
        for prefix in ("", "draft_"):
            heads, kv = getattr(self, f"{prefix}num_attention_heads"), getattr(self, f"{prefix}num_key_value_heads")
            for name, value in ((f"{prefix}num_attention_heads", heads), (f"{prefix}num_key_value_heads", kv)):
                if value is not None:
                    check_int(name, value, 1)
            if (heads is None) != (kv is None):
                raise ConfigError(f"{prefix}num_attention_heads and {prefix}num_key_value_heads are given together or not at all")

    def _check_interleave_fits_block_size(self) -> None:
        """vLLM 0.33.0: with ``decode_context_parallel_size > 1`` the cache block size must be
        >= and divisible by the interleave ("Block_size(B) should be greater than or equal
        to and divisible by cp_kv_cache_interleave_size (I).")."""
        B, I = self.block_size, self.cp_kv_cache_interleave_size
        if self.decode_context_parallel_size > 1 and (I > B or B % I):
            raise ConfigError(
                f"block_size ({B}) should be greater than or equal to and divisible by "
                f"cp_kv_cache_interleave_size ({I}) when decode_context_parallel_size > 1 "
                "(the cache block size, as vLLM checks it)"
            )

    @property
    def eagle_drop(self) -> bool:
        """Prefix-cache hits drop the last cached block of each group (an EAGLE / MTP drafter)."""
        return self.num_speculative_tokens > 0 and self.speculative_method in ("eagle", "mtp")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a step reserves past its last scheduled token for the drafter (vLLM's
        ``VllmConfig.num_lookahead_tokens``, passed to ``allocate_slots``): an EAGLE / MTP
        drafter runs its own forward pass and writes KV up to ``num_speculative_tokens``
        positions ahead, so ``eagle`` and ``mtp`` reserve that many; ``ngram`` has no KV of
        its own and reserves none. Capped at ``max_model_len`` where it is used."""
        return self.num_speculative_tokens if self.eagle_drop else 0

    @property
    def tp_size(self) -> int:
        """``tensor_parallel_size``, or its default."""
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size
        return default_tensor_parallel_size(self.prefill_context_parallel_size, self.decode_context_parallel_size)

    @property
    def parallel_layout(self) -> ParallelLayout:
        """The (PCP, TP) rank grid and its DCP, PCP and TP groups."""
        return ParallelLayout(self.prefill_context_parallel_size, self.tp_size, self.decode_context_parallel_size)

    @property
    def world_size(self) -> int:
        """Processes of one engine: ``prefill_context_parallel_size * tensor_parallel_size``."""
        return self.prefill_context_parallel_size * self.tp_size

    @property
    def draft_dcp_size(self) -> int:
        """The draft model's DCP size (the target's unless set)."""
        d = self.draft_decode_context_parallel_size
        return self.decode_context_parallel_size if d is None else d

    @property
    def cudagraph_capture_sizes(self) -> tuple[int, ...]:
        """vLLM's default capture sizes up to ``max_cudagraph_capture_size``:
        1, 2, 4, then every 8 below 256, then every 16."""
        top = self.max_cudagraph_capture_size
        # a step holds at most max_num_batched_tokens, and the size it takes is the first
        # multiple of 1 + k at or above it, so no larger size is ever used (and a huge
        # max_cudagraph_capture_size costs nothing)
        top = min(top, self.max_num_batched_tokens + 16 * (self.num_speculative_tokens + 1))
        sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
        return tuple(s for s in sizes if s <= top)

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight at once: 2 with async scheduling, else 1 (no pipeline
        parallelism here)."""
        return 2 if self.async_scheduling else 1

    @property
    def max_in_flight_tokens(self) -> int:
        """Tokens scheduled but not yet settled (vLLM 0.33.0): every concurrent batch may
        hold a full ``max_num_batched_tokens``. Sliding-window and chunked-local caps
        reserve for it, since their out-of-window blocks are freed on processed tokens."""
        return self.max_concurrent_batches * self.max_num_batched_tokens
