"""The checker's own geometry: what each KV-cache group must look like, from the scenario.

Derived from the scenario's layer specs and config alone, with the naive rules of
``docs/dcp-semantics.md`` (sections 2-4): a group is sharded when all its layers are
non-replicated full attention and ``W > 1``; a sharded group spreads its positions (or,
for compressed caches, its records) over the ranks ``I`` at a time; a page holds
``B // R`` states; the kernel reads ``Bk`` states per kernel block; a Mamba state group is
replicated and its page is one state. Nothing here comes
from the engine: a geometry the engine gets wrong (an interleave it rescales, a flag a
merge drops) shows as a difference between what it wrote and what this expects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dcpsim.model.grouping import group_layer_specs
from dcpsim.model.kinds import Retention, Storage, records_per_state, retention_of, storage_of
from dcpsim.model.sparse import is_indexer, sparse_topk
from dcpsim.model.specs import is_dcp_sharded_spec
from dcpsim.verify.attention_heads import gqa_spec


@dataclass(frozen=True)
class ExpectedGroup:
    name: str
    layer_names: tuple[str, ...]
    storage: Storage
    retention: Retention
    sharded: bool
    dcp_size: int
    interleave_size: int
    """Positions (paged) or records (compressed) a rank takes before the next one's turn."""
    tokens_per_state: int
    block_size: int
    """Tokens per page (``B``), or the ring capacity (``C``)."""
    kernel_block_size: int | None
    """States per kernel block, or None (one per page)."""
    sliding_window: int = 0
    extra_retained_tokens: int = 0
    attention_chunk_size: int = 0
    num_speculative_tokens: int = 0
    draft: bool = False
    """Holds layers of the draft model: the drafter's attention metadata is judged too."""
    mamba_cache_mode: str = ""
    index_topk: int = 0
    """A sparse-attention group (semantics section 10): each token attends to this many keys."""
    indexer: bool = False
    """The indexer's K cache of sparse attention: scored, never attended."""
    """A Mamba state group: ``none`` (the state blocks are the row's first entries) or
    ``align`` (the row is indexed by position, ``block_size`` tokens an entry)."""
    gqa: bool = False
    """GQA/MHA attention layers of the target model (paged, not MLA): with the scenario's heads
    stated, one K/V vector per KV head (``verify.attention_heads``)."""
    helix: bool = False
    """Helix's layout (``kv_cache_layout = "helix"``, ``verify.helix``): a position's rank and
    local slot depend on its request's prompt length (``prompt_len``), on every rank at ``W = 1`` too."""
    helix_prompts: tuple[tuple[str, int], ...] = ()
    """Under Helix: (request id, prompt length) of every request of the scenario."""

    @functools.cached_property
    def _prompt_lens(self) -> dict[str, int]:
        return dict(self.helix_prompts)

    def prompt_len(self, request_id: str) -> int:
        """Where request ``request_id``'s decoding starts (Helix)."""
        return self._prompt_lens[request_id]

    @property
    def page_states(self) -> int:
        if self.storage is Storage.STATE:
            return 1
        return self.block_size // self.tokens_per_state

    @property
    def manager_block_size(self) -> int:
        """Tokens one block-table entry spans: ``B * W`` sharded, ``B`` replicated (section 5)."""
        return self.block_size * (self.dcp_size if self.sharded else 1)

    @property
    def index_kind(self) -> str:
        kinds = {Storage.RECORDS: "record", Storage.RING: "ring row", Storage.STATE: "state after position"}
        return kinds.get(self.storage, "position")


def expected_groups(scenario) -> list[ExpectedGroup]:
    """One ``ExpectedGroup`` per KV-cache group of the scenario's model, in group order."""
    cfg = scenario.config
    out = []
    for group in group_layer_specs(scenario.layers):
        spec = group.representative
        storage = storage_of(spec)
        out.append(
            ExpectedGroup(
                name=group.name,
                layer_names=group.layer_names,
                storage=storage,
                retention=retention_of(spec),
                sharded=is_dcp_sharded_spec(group.kv_cache_spec) and cfg.decode_context_parallel_size > 1,
                dcp_size=cfg.decode_context_parallel_size,
                interleave_size=spec.block_size if cfg.kv_cache_layout == "helix" else cfg.cp_kv_cache_interleave_size,
                tokens_per_state=records_per_state(spec),
                block_size=spec.block_size,
                kernel_block_size=None if storage in (Storage.RING, Storage.STATE) else cfg.kernel_block_size,
                sliding_window=getattr(spec, "sliding_window", 0),
                extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0),
                attention_chunk_size=getattr(spec, "attention_chunk_size", 0),
                num_speculative_tokens=cfg.num_speculative_tokens,
                draft=any(n in cfg.draft_layers for n in group.layer_names),
                mamba_cache_mode=getattr(spec, "mamba_cache_mode", ""),
                index_topk=sparse_topk(group.kv_cache_spec),
                indexer=is_indexer(group.kv_cache_spec),
                gqa=gqa_spec(spec, storage) and not any(n in cfg.draft_layers for n in group.layer_names),
                helix=cfg.kv_cache_layout == "helix",
                helix_prompts=tuple((r.request_id, r.prompt_len) for r in scenario.requests) if cfg.kv_cache_layout == "helix" else (),
            )
        )
    return out
