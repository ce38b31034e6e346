"""Attention heads across the ranks: which query and KV heads each rank holds, and whether a DCP
group's gathered queries find their KV heads on every member (semantics section 2, "heads").

Tensor parallelism splits a GQA/MHA model's ``H`` query heads into ``H / tp`` per TP rank (TP rank
``t`` holds heads ``[t * H / tp, (t + 1) * H / tp)``) and its ``kv`` KV heads the same way when
``kv >= tp``; with ``kv < tp`` each KV head is replicated on ``tp / kv`` consecutive TP ranks. Query
head ``h`` uses KV head ``h // (H / kv)``. Under DCP the ranks of a DCP group all-gather their
queries and each attends the gathered queries over its own shard of the context: every member must
hold every KV head the gathered queries use. A DCP group spanning the PCP axis gathers queries of
one TP rank only (its members share a TP rank), so it is admissible whatever ``kv`` is; a group of
TP ranks needs them to hold the same KV heads, ``kv * dcp <= tp`` with the group inside one
replica run. MLA has one latent KV head shared by all query heads: no constraint. Pure: no torch,
no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpsim.errors import ConfigError
from dcpsim.model.parallel import ParallelLayout
from dcpsim.model.specs import AttentionSpec, CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec


def query_heads(tp_rank: int, tp: int, num_heads: int) -> range:
    """The query heads TP rank ``tp_rank`` holds."""
    per = num_heads // tp
    return range(tp_rank * per, (tp_rank + 1) * per)


def kv_heads(tp_rank: int, tp: int, num_kv_heads: int) -> range:
    """The KV heads TP rank ``tp_rank`` holds (one, replicated, when ``num_kv_heads < tp``)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class RankHeads:
    """One rank's heads in a GQA/MHA layer's decode under DCP (``Engine.attention_heads``):
    the query heads it attends after the DCP all-gather of queries, the KV heads it holds, and
    which of them each gathered query head reads."""

    query_heads: tuple[int, ...]
    """The gathered query heads (global indices) in gather order: each DCP-group member's TP
    query heads, member after member (a group spanning the PCP axis gathers one TP rank's
    heads once per member)."""
    kv_heads: tuple[int, ...]
    """The KV heads (global indices) the rank holds, in the order its cache stores them."""
    kv_index: tuple[int, ...]
    """Per gathered query head: the index into ``kv_heads`` of the KV head it reads."""


def rank_heads(layout: ParallelLayout, rank: int, num_heads: int, num_kv_heads: int) -> RankHeads:
    """The heads of world rank ``rank`` (the module docstring's rule): its DCP group's
    gathered query heads, its TP KV heads, and query head ``h`` reading KV head
    ``h // (H / kv)``. The layout must be admissible (``check_dcp_heads``)."""
    members = next(m for m in layout.dcp_groups() if rank in m)
    gathered = tuple(h for m in members for h in query_heads(layout.coords(m).tp_rank, layout.tp, num_heads))
    held = tuple(kv_heads(layout.coords(rank).tp_rank, layout.tp, num_kv_heads))
    group_size = num_heads // num_kv_heads
    return RankHeads(gathered, held, tuple(held.index(h // group_size) for h in gathered))


def check_tp_heads(num_heads: int, num_kv_heads: int, tp: int, what: str = "") -> None:
    """TP's split: ``H`` divisible by ``tp``, ``kv`` dividing ``H``, and ``kv`` a multiple of ``tp``
    or a divisor of it (each KV head whole on a rank, or replicated evenly)."""
    who = f"{what} " if what else ""
    if num_heads % tp:
        raise ConfigError(f"the {who}model's {num_heads} attention heads must be divisible by tensor_parallel_size {tp}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"the {who}model's {num_heads} attention heads must be a multiple of its {num_kv_heads} KV heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ConfigError(
            f"the {who}model's {num_kv_heads} KV heads must be a multiple or a divisor of tensor_parallel_size {tp} "
            "(each rank holds whole KV heads, or one replicated evenly)"
        )


def check_dcp_heads(layout: ParallelLayout, num_heads: int, num_kv_heads: int, what: str = "") -> None:
    """Every DCP group's members hold every KV head its gathered queries use; a ``ConfigError``
    naming the group, the rank and the heads otherwise (the module docstring's rule)."""
    check_tp_heads(num_heads, num_kv_heads, layout.tp, what)
    if layout.dcp == 1:
        return
    group_size = num_heads // num_kv_heads
    for g, members in enumerate(layout.dcp_groups()):
        tp_ranks = sorted({layout.coords(r).tp_rank for r in members})
        needed = sorted({h // group_size for t in tp_ranks for h in query_heads(t, layout.tp, num_heads)})
        for rank in members:
            held = kv_heads(layout.coords(rank).tp_rank, layout.tp, num_kv_heads)
            missing = [h for h in needed if h not in held]
            if missing:
                who = f"{what} " if what else ""
                raise ConfigError(
                    f"the {who}model's KV heads do not follow its queries under DCP: DCP group {g} (ranks {members}) gathers "
                    f"the queries of TP ranks {tp_ranks}, which use KV heads {needed}, but rank {rank} holds KV heads "
                    f"{list(held)} ({num_heads} query heads, {num_kv_heads} KV heads, tensor_parallel_size {layout.tp}, "
                    f"prefill_context_parallel_size {layout.pcp}, decode_context_parallel_size {layout.dcp}): every KV "
                    "head a DCP group's gathered queries use must be on each of its ranks (kv_heads * dcp <= tp for a "
                    "group of TP ranks; any kv_heads for one spanning the PCP axis)"
                )


def gathers_queries(spec, config) -> bool:
    """Whether a layer's decode gathers the DCP group's queries over GQA/MHA KV heads: a sharded
    attention layer that is not MLA (whose one latent head every query uses) or a ring."""
    if not isinstance(spec, AttentionSpec) or isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec, CircularBufferSpec)):
        return False
    return config.decode_context_parallel_size > 1 and not getattr(spec, "dcp_replicated", False)


def check_head_layouts(layers: dict, config) -> None:
    """The target's and the draft's head layouts (where the scenario states them) under DCP, for
    the models with a layer that gathers queries; before any rank starts."""
    layout = ParallelLayout(config.prefill_context_parallel_size, config.tp_size, config.decode_context_parallel_size)
    draft = set(config.draft_layers)
    for what, prefix, names in (("", "", [n for n in layers if n not in draft]), ("draft", "draft_", sorted(draft))):
        heads, kv = getattr(config, f"{prefix}num_attention_heads"), getattr(config, f"{prefix}num_key_value_heads")
        if heads is None:
            continue
        check_tp_heads(heads, kv, layout.tp, what)
        if any(gathers_queries(layers[n], config) for n in names if n in layers):
            check_dcp_heads(layout, heads, kv, what)
