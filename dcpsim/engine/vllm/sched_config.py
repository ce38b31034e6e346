"""The ``VllmConfig`` vLLM's v1 ``Scheduler`` is built from, by hand from a ``SimConfig``.

vLLM's own ``VllmConfig`` validates a whole deployment (a model, a device, a tokenizer),
so the scheduler gets a stand-in that holds only what ``Scheduler.__init__``,
``schedule()`` and ``update_from_output()`` read of it (about 40 fields). A field dcpsim
has is carried over under vLLM's name (``max_num_batched_tokens``, ``max_num_seqs``,
``long_prefill_token_threshold``, ``enable_prefix_caching``, ``max_model_len``,
``decode_context_parallel_size``, ``num_speculative_tokens``); every other field is
vLLM 0.33.0's default (``watermark`` 0.0, ``policy`` fcfs, ``scheduler_reserve_full_isl``
true) or switches off a feature dcpsim has no model of (multimodal inputs, LoRA, KV
connectors, pipeline parallelism, metrics). The drafter needs no extra query slots in the
target's batch (``max_num_new_slots_for_drafting`` 0, vLLM's figure for EAGLE, MTP and ngram).
Its KV lookahead is vLLM's: ``num_lookahead_tokens`` is ``num_speculative_tokens`` with
``speculative_method`` ``eagle`` or ``mtp`` (``VllmConfig.num_lookahead_tokens`` of an EAGLE-style
drafter, which writes its own KV that far past the target's tokens), 0 for ngram
(``SimConfig.num_lookahead_tokens``): the scheduler passes it to every ``allocate_slots``, so each
step holds the blocks of its tokens plus that many slots (never past ``max_model_len``), the
blocks, preemptions and KV events vLLM's engine has. An EAGLE / MTP drafter is also EAGLE for the
prefix cache (``use_eagle_block_drop``: a hit drops its last block). The other two lookaheads stay
0: ``num_prefill_lookahead_tokens`` is 1 for an EAGLE-family drafter in vLLM 0.33.0, which its
scheduler documents as a no-op (no chunk end is moved, no token re-prefilled), and
``num_hash_lookahead_tokens`` 0 keeps the legacy block hashes with the EAGLE drop that dcpsim
models (vLLM's ``disable_lookahead_block_hashes``).

A field vLLM reads that is not here raises ``AttributeError`` naming it, so a newer vLLM
that reads more ends in an engine error saying which field, not in a silent default.
"""

from __future__ import annotations

from dcpsim.model.config import SimConfig


class Fields:
    """A config object of named fields; reading a field it lacks names the field."""

    def __init__(self, path: str, **fields):
        self.__dict__["_path"] = path
        self.__dict__.update(fields)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"vLLM's scheduler reads {self._path}.{name}, which dcpsim's stand-in does not set")


class _Drafter(Fields):
    """vLLM's ``SpeculativeConfig`` of a drafter without extra query slots; an EAGLE / MTP one
    (``SimConfig.eagle_drop``) has its prefix-cache hits drop their last block (its KV
    lookahead is the ``VllmConfig``'s ``num_lookahead_tokens``)."""

    def use_eagle(self) -> bool:
        return self.eagle_drop

    @property
    def uses_target_hidden_states(self) -> bool:
        """vLLM 0.34.0's name for ``use_eagle()`` (a property of its speculator config)."""
        return self.eagle_drop

    def use_eagle_block_drop(self) -> bool:
        return self.eagle_drop

    def needs_eagle_block_drop(self) -> bool:
        return self.eagle_drop


def scheduler_vllm_config(config: SimConfig, block_size: int, num_gpu_blocks: int, cp_sizes: tuple[int, int]) -> Fields:
    """The stand-in ``VllmConfig`` of ``config`` (``block_size``: the attention block size
    vLLM's ``cache_config`` holds; ``num_gpu_blocks``: the shared pool's blocks; ``cp_sizes``:
    its DCP and PCP sizes as the tree states the scenario's layout, ``parallel_rules.release_sizes``)."""
    k = config.num_speculative_tokens
    drafter = None
    if k:
        drafter = _Drafter(
            "vllm_config.speculative_config",
            num_speculative_tokens=k,
            num_speculative_tokens_per_batch_size=None,
            max_num_new_slots_for_drafting=0,
            disable_eagle_block_drop=False,
            eagle_drop=config.eagle_drop,
        )
    return Fields(
        "vllm_config",
        scheduler_config=Fields(
            "vllm_config.scheduler_config",
            max_num_seqs=config.max_num_seqs,
            max_num_active_seqs=None,
            max_num_scheduled_tokens=None,
            max_num_batched_tokens=config.max_num_batched_tokens,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=False,
            enable_chunked_prefill=True,
            disable_chunked_mm_input=False,
            policy="fcfs",
            prefill_schedule_interval=1,
            scheduler_reserve_full_isl=True,
            watermark=0.0,
            async_scheduling=False,
            cache_aware_admission_window=0,
            cache_aware_admission_threshold=0.5,
            max_num_inflight_kv_loads=None,
        ),
        cache_config=Fields(
            "vllm_config.cache_config",
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_match_unit=None,
            enable_mamba_shared_prefix_checkpoint=False,
            mamba_cache_mode="none",
        ),
        model_config=Fields(
            "vllm_config.model_config",
            max_model_len=config.max_model_len,
            uses_mrope=False,
            is_encoder_decoder=False,
            runner_type="generate",
            is_diffusion=False,
            supports_multimodal_inputs=False,
            return_sampling_mask=False,
        ),
        parallel_config=Fields(
            "vllm_config.parallel_config",
            decode_context_parallel_size=cp_sizes[0],
            prefill_context_parallel_size=cp_sizes[1],
            data_parallel_index=0,
            data_parallel_size=1,
            pipeline_parallel_size=1,
        ),
        observability_config=Fields(
            "vllm_config.observability_config",
            per_request_spec_decode_metrics="none",
            kv_cache_metrics=False,
            enable_logging_iteration_details=False,
            enable_mfu_metrics=False,
        ),
        kv_events_config=Fields("vllm_config.kv_events_config", enable_kv_cache_events=True),
        ec_manager_config=Fields("vllm_config.ec_manager_config", get_encoder_cache_manager_obj=lambda: None),
        aux_output_config=Fields("vllm_config.aux_output_config", enabled=False),
        watermark_config=None,
        speculative_config=drafter,
        lora_config=None,
        kv_transfer_config=None,
        ec_transfer_config=None,
        is_mm_encoder_only=False,
        num_speculative_tokens=k,
        num_lookahead_tokens=config.num_lookahead_tokens,
        num_prefill_lookahead_tokens=0,
        num_hash_lookahead_tokens=0,
        use_v2_model_runner=True,
        max_in_flight_tokens=config.max_in_flight_tokens,
        max_concurrent_batches=1,
    )


class NoGrammar:
    """vLLM's ``StructuredOutputManager`` for requests without structured output: every
    token is accepted, no bitmask."""

    def validate_tokens(self, request, token_ids: list[int]) -> list[int]:
        return token_ids

    def accept_tokens(self, request, token_ids: list[int]) -> bool:
        return True

    def trim_spec_tokens(self, request, spec_tokens: list[int]) -> list[int]:
        """vLLM 0.34.0's: an unstructured request's drafts are kept whole."""
        return spec_tokens

    def grammar_bitmask(self, *args, **kwargs):
        return None
