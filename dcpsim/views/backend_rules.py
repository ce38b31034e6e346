"""Rules of known DCP backends that an interleave size can break, as data with their source.

Each rule was read in docs/dcp-semantics.md or in vLLM 0.33.0's source (the file and the
function are named); nothing here is inferred. ``kind`` says what breaking it means:
``rejected`` (the configuration is refused: dcpsim and vLLM stop before running),
``backend`` (the named vLLM attention backends refuse it at start-up) or ``performance``
(it runs, on a slower path).

``broken_rules(context)`` lists the rules one layout breaks and where.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dcpsim.model.grouping import group_layer_specs
from dcpsim.model.kinds import Storage, records_per_state, storage_of
from dcpsim.model.scenario import Scenario
from dcpsim.model.specs import MLAAttentionSpec


@dataclass(frozen=True)
class GroupFacts:
    name: str
    sharded: bool
    mla: bool
    states_per_page: int
    """Per page: tokens, or records of a compressed group (``B / R``)."""
    tokens_per_state: int


@dataclass(frozen=True)
class LayoutContext:
    dcp_size: int
    interleave_size: int
    num_speculative_tokens: int
    groups: tuple[GroupFacts, ...]
    """The paged groups (rings are not interleaved)."""

    @property
    def sharded(self) -> tuple[GroupFacts, ...]:
        return tuple(g for g in self.groups if g.sharded)


def layout_context(scenario: Scenario) -> LayoutContext:
    config = scenario.config
    W = config.decode_context_parallel_size
    facts = []
    for group in group_layer_specs(scenario.layers):
        rep = group.representative
        if storage_of(rep) is Storage.RING:
            continue
        R = records_per_state(rep)
        facts.append(GroupFacts(group.name, group.sharded and W > 1, isinstance(rep, MLAAttentionSpec), rep.block_size // R, R))
    return LayoutContext(W, config.cp_kv_cache_interleave_size, config.num_speculative_tokens, tuple(facts))


@dataclass(frozen=True)
class BackendRule:
    id: str
    kind: str
    rule: str
    source: str
    where: Callable[[LayoutContext], list[str]]
    """The groups (or a reason) where ``context`` breaks the rule; empty when it holds."""


def _divides_block(c: LayoutContext) -> list[str]:
    I = c.interleave_size
    return [
        f"{g.name}: {g.states_per_page} {'records' if g.tokens_per_state > 1 else 'tokens'} per page"
        for g in c.sharded
        if I > g.states_per_page or g.states_per_page % I
    ]


def _mtp(c: LayoutContext) -> list[str]:
    if c.sharded and c.num_speculative_tokens > 0 and c.interleave_size > 1:
        return [f"num_speculative_tokens = {c.num_speculative_tokens}, I = {c.interleave_size}"]
    return []


def _mla_sharded(c: LayoutContext) -> list[str]:
    return [g.name for g in c.sharded if g.mla]


def _flashinfer_mla(c: LayoutContext) -> list[str]:
    return _mla_sharded(c) if c.interleave_size != 1 else []


def _varlen(c: LayoutContext) -> list[str]:
    return _mla_sharded(c) if c.interleave_size != 1 and c.num_speculative_tokens > 0 else []


def _indexer(c: LayoutContext) -> list[str]:
    return [f"{g.name}: R = {g.tokens_per_state}" for g in c.sharded if g.tokens_per_state > 1 and c.interleave_size % g.tokens_per_state]


RULES: tuple[BackendRule, ...] = (
    BackendRule(
        "interleave-divides-block",
        "rejected",
        "under DCP, cp_kv_cache_interleave_size must be <= the block size of every sharded group and "
        "divide it (dcpsim counts a compressed group's block in records)",
        "docs/dcp-semantics.md section 2; vllm/config/vllm.py VllmConfig.validate_block_size; "
        "vllm/config/parallel.py ParallelConfig.cp_kv_cache_interleave_size",
        _divides_block,
    ),
    BackendRule(
        "mtp-needs-interleave-support",
        "backend",
        "speculative decoding (MTP) with cp_kv_cache_interleave_size > 1 under DCP needs an attention "
        "backend with supports_mtp_with_cp_non_trivial_interleave_size; in vLLM 0.33.0 only "
        "FLASHMLA_SPARSE (FlashMLASparseImpl) and TOKENSPEED_MLA (TokenspeedMLAImpl) set it, every "
        "other backend fails an assertion at start-up",
        "vllm/v1/worker/cp_utils.py check_attention_cp_compatibility; vllm/v1/attention/backend.py "
        "AttentionImpl; vllm/v1/attention/backends/mla/flashmla_sparse.py, tokenspeed_mla.py",
        _mtp,
    ),
    BackendRule(
        "flashinfer-mla-needs-interleave-1",
        "backend",
        "FLASHINFER_MLA refuses native DCP unless cp_kv_cache_interleave_size = 1 (ValueError)",
        "vllm/v1/attention/backends/mla/flashinfer_mla.py FlashInferMLAMetadataBuilder.__init__",
        _flashinfer_mla,
    ),
    BackendRule(
        "spec-steps-not-batched-as-decodes",
        "performance",
        "with cp_kv_cache_interleave_size != 1 under DCP, FLASH_ATTN_MLA and FLASHMLA_SPARSE set "
        "supports_dcp_with_varlen off, so reorder_batch_threshold drops to 1: multi-token "
        "(speculative) queries are batched as prefills, not decodes",
        "vllm/v1/attention/backend.py AttentionMetadataBuilder._init_reorder_batch_threshold; "
        "vllm/v1/attention/backends/mla/flashattn_mla.py, flashmla_sparse.py",
        _varlen,
    ),
    BackendRule(
        "indexer-interleave-multiple-of-R",
        "backend",
        "vLLM's sparse indexer under DCP needs cp_kv_cache_interleave_size (in tokens) to be a multiple "
        "of the compress ratio R and then deals I // R compressed states per rank, where dcpsim (after "
        "the seed, semantics section 4) deals I records; it refuses DeepSeek-V4 compressed specs under "
        "DCP whatever I is",
        "vllm/v1/attention/backends/mla/indexer.py DeepseekV32IndexerMetadataBuilder.__init__",
        _indexer,
    ),
)


def broken_rules(context: LayoutContext) -> list[dict]:
    """The rules ``context`` breaks: ``id``, ``kind``, ``rule``, ``source`` and ``where``."""
    out = []
    for rule in RULES:
        where = rule.where(context)
        if where:
            out.append({"id": rule.id, "kind": rule.kind, "rule": rule.rule, "source": rule.source, "where": where})
    return out
