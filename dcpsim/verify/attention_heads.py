"""The checker's heads: which query heads a rank's attention holds after the DCP all-gather of
queries, and which KV head each of them must read (semantics section 12, "Heads").

Its own derivation, from the scenario alone: the world is the ``(PCP, TP)`` grid (world rank
``pcp_rank * T + tp_rank``), read TP-major and cut into runs of ``W`` for the DCP groups; each
member holds TP's ``H / T`` query heads ``[t * H / T, (t + 1) * H / T)``; the gathered heads are
the members' heads, member after member; GQA gives query head ``q`` KV head ``q * kv // H``.
Nothing of the engine (its head map is ``Engine.attention_heads``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.kinds import Storage
from dcpsim.model.specs import AttentionSpec, CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec


@dataclass(frozen=True)
class ExpectedHeads:
    num_heads: int
    """The model's query heads: the width of its query vectors."""
    query_heads: np.ndarray
    """The gathered query heads (global), in gather order: the heads of the rank's attention."""
    kv_heads: np.ndarray
    """Per gathered query head: the (global) KV head it must read."""


def gqa_spec(spec, storage: Storage) -> bool:
    """A GQA/MHA attention layer (paged, not MLA's one latent head, not a ring)."""
    mla = isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec, CircularBufferSpec))
    return isinstance(spec, AttentionSpec) and not mla and storage is Storage.PAGED


def dcp_members(pcp: int, tp: int, dcp: int, world_rank: int) -> list[int]:
    """The world ranks of ``world_rank``'s DCP group, in DCP-rank order: the grid read TP-major
    (``(tp_rank, pcp_rank)`` ascending), cut into runs of ``dcp``."""
    order = sorted(range(pcp * tp), key=lambda r: (r % tp, r // tp))
    at = order.index(world_rank) // dcp * dcp
    return order[at : at + dcp]


def expected_heads(config, world_rank: int) -> ExpectedHeads | None:
    """The gathered query heads of ``world_rank``'s DCP group and the KV head each must read;
    None for a scenario that states no heads (one KV head per group)."""
    H, kv = config.num_attention_heads, config.num_key_value_heads
    if H is None:
        return None
    tp = config.tp_size
    members = dcp_members(config.prefill_context_parallel_size, tp, config.decode_context_parallel_size, world_rank)
    per = H // tp
    query = np.array([(m % tp) * per + j for m in members for j in range(per)], dtype=np.int64)
    return ExpectedHeads(H, query, query * kv // H)
