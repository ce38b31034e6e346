"""Sparse attention (DeepSeek-V3.2's DSA): the indexer's stand-in vectors and the model's
sparse groups, shared by both sides (semantics section 14).

Every query token of a ``SparseMLAAttentionSpec`` group attends to the ``index_topk`` keys
of its causal context that the indexer scores highest. The indexer's keys live in the
model's ``IndexerSpec`` group (its own KV-cache group, written like any other). Scores are
exact: indexer queries and keys are small integers, so a float32 GEMM (the engine's) and a
float64 one (the checker's) give the very same values, and ties are frequent, which the tie
rule (score descending, then position ascending: a total order) settles.

* ``indexer_keys(kv)``: the indexer key of each stored K/V row (its first ``INDEX_DIM``
  elements, quantized to ``{-2, ..., 2}``): what the store holds, so a misplaced write
  changes the scores.
* ``indexer_queries(...)``: ``[q, INDEX_HEADS, INDEX_DIM]`` integer queries, hashes of
  (indexer group, request, position, content) like ``vectors.query_vectors``.
* The score of key ``t`` for a query token: ``sum_h relu(q_h . k_t)`` (unit head weights),
  an integer in ``[0, INDEX_HEADS * INDEX_DIM * 4]``.

The stand-in's widths are not the model's (64 heads of 128): like ``--attention-head-dim``,
they keep a check of thousands of keys per token cheap; the spec's own ``index_n_heads`` and
``head_size`` size its pages.

Pure numpy; no torch. The engine's local mappings are in ``model.layout``-style helpers at
the end (``vllm_topk_local_index``, ``sglang_topk_local_index``), which the checker never
uses.
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.model.grouping import group_layer_specs
from dcpsim.model.specs import IndexerSpec, KVCacheSpec, SparseMLAAttentionSpec, iter_layer_specs
from dcpsim.model.vectors import query_vectors

INDEX_HEADS = 4
"""Indexer query heads of the stand-in (the model's 64 size the pages only)."""
INDEX_DIM = 16
"""Width of the stand-in's indexer keys and queries (at most ``--attention-head-dim``)."""
LEVELS = 5
"""Integer levels of a quantized element: ``{-2, ..., 2}``."""
_HALF_RANGE = np.float32(math.sqrt(3.0))


def quantize(values: np.ndarray) -> np.ndarray:
    """float32 stand-in values (uniform in ``[-sqrt 3, sqrt 3)``) as float32 integers in
    ``{-2, ..., 2}``, elementwise (the same float32 arithmetic on both sides)."""
    unit = (np.asarray(values, dtype=np.float32) + _HALF_RANGE) / (np.float32(2.0) * _HALF_RANGE)
    return np.clip(np.floor(unit * np.float32(LEVELS)), 0, LEVELS - 1).astype(np.float32) - np.float32(LEVELS // 2)


def index_dim(head_dim: int) -> int:
    """The indexer width a run uses: ``INDEX_DIM``, or less with a narrower K."""
    return min(INDEX_DIM, head_dim)


def indexer_keys(kv: np.ndarray, head_dim: int) -> np.ndarray:
    """``[n, index_dim]`` integer keys (float32) of stored K/V rows ``kv [n, >= index_dim]``."""
    return quantize(np.asarray(kv)[:, : index_dim(head_dim)])


def indexer_queries(group_id: int, req_index: int, positions, contents, head_dim: int) -> np.ndarray:
    """``[q, INDEX_HEADS, index_dim]`` integer queries (float32) of a request's tokens."""
    return quantize(query_vectors(group_id, req_index, positions, contents, INDEX_HEADS, index_dim(head_dim)))


def is_indexer(spec: KVCacheSpec) -> bool:
    return all(isinstance(s, IndexerSpec) for s in iter_layer_specs(spec))


def sparse_topk(spec: KVCacheSpec) -> int:
    """The group's ``index_topk`` when it is read by sparse attention, else 0."""
    layers = iter_layer_specs(spec)
    if all(isinstance(s, SparseMLAAttentionSpec) for s in layers):
        return min(s.index_topk for s in layers)
    return 0


def indexer_group(group_specs: list[KVCacheSpec]) -> int | None:
    """The index of the model's indexer group among its groups' specs (None without sparse
    attention); ``ConfigError`` when sparse layers have no indexer or several indexer groups."""
    indexers = [g for g, spec in enumerate(group_specs) if is_indexer(spec)]
    sparse = [g for g, spec in enumerate(group_specs) if sparse_topk(spec)]
    if sparse and len(indexers) != 1:
        raise ConfigError(
            f"sparse_mla layers need exactly one indexer KV-cache group (kind = 'indexer', one block size and "
            f"dcp_replicated), found {len(indexers)}"
        )
    if not sparse:
        return None
    return indexers[0]


def check_sparse_layout(layers: dict[str, KVCacheSpec]) -> None:
    """A model with sparse layers has exactly one indexer group, and a model with indexer
    layers has the sparse layers they select keys for (``ConfigError`` otherwise, naming the
    indexer layer)."""
    if any(sparse_topk(spec) for spec in layers.values()):
        indexer_group([g.kv_cache_spec for g in group_layer_specs(layers)])
        return
    indexers = [name for name, spec in layers.items() if is_indexer(spec)]
    if indexers:
        more = f" (and {len(indexers) - 1} more)" if len(indexers) > 1 else ""
        raise ConfigError(
            f"layer {indexers[0]!r}{more}: an indexer (kind = 'indexer') with nothing to index: no sparse_mla layer "
            f"selects its keys through it; add the sparse_mla layers it scores for, or drop the indexer layers"
        )


# --- the engine's local mappings (the checker never uses them) -------------------------


def vllm_topk_local_index(t: np.ndarray, dcp_size: int, interleave_size: int, dcp_rank: int) -> np.ndarray:
    """vLLM's mapping of global top-k ids ``t`` (positions; -1 padding) to this rank's local
    indices: position ``t`` lives on rank ``(t // I) % W`` at local index
    ``round_down(t // W, I) + t % I``; -1 where another rank owns it (or ``t`` is -1)."""
    t = np.asarray(t, dtype=np.int64)
    W, I = dcp_size, interleave_size
    local = (t // W) // I * I + t % I
    owned = (t >= 0) & ((t // I) % W == dcp_rank)
    return np.where(owned, local, -1)


def sglang_topk_local_index(loc: np.ndarray, dcp_size: int, dcp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's ``transform_index_page_table_dcp``: keep the ids with ``loc % W == r``, divide
    them by ``W`` and pack them to the front of each row (the rest -1); also each row's count.
    ``loc`` is a slot of SGLang's global slot space, which with ``W`` dividing the page size
    has ``loc % W == position % W`` (token interleave, ``I = 1``)."""
    loc = np.atleast_2d(np.asarray(loc, dtype=np.int64))
    keep = (loc >= 0) & (loc % dcp_size == dcp_rank)
    order = np.argsort(~keep, axis=1, kind="stable")  # kept ids first, in their order
    packed = np.take_along_axis(np.where(keep, loc // dcp_size, -1), order, axis=1)
    return packed, keep.sum(axis=1)
