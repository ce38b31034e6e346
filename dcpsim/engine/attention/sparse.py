"""The engine's sparse attention on one rank (DSA, semantics section 14).

For the query tokens of one write in a sparse group: read this rank's rows of the indexer
cache (``Engine.indexer_local_rows``, through the indexer group's block table), gather every
rank's rows into the global order (sharded indexer; a replicated one is read whole), score
every position of each token's causal context (``sum_h relu(q_h . k_t)``, float32, exact on
the integer stand-ins), pick the top-k (``Engine.select_topk``), map the picks to this
rank's local keys (``Engine.sparse_local_keys``) and attend over those only. The caller
(``shard.ShardAttention``) merges sharded groups as for dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dcpsim.model.plan import ReqWrite
from dcpsim.model.sparse import indexer_keys, indexer_queries


@dataclass
class SparseKeys:
    """What a rank reads for a sparse write: the store slots of its selected keys, the
    ``[nq, len(slots)]`` mask of which token selected which, and the global selection."""

    slots: np.ndarray
    mask: np.ndarray
    selection: np.ndarray


class SparseIndexer:
    def __init__(self, engine, head_dim: int, collectives):
        self.engine = engine
        self.head_dim = head_dim
        self.coll = collectives
        self.rank, self.world = collectives.rank, collectives.world_size

    def keys(self, runner, group: int, indexer: int, w: ReqWrite, rows: np.ndarray) -> SparseKeys:
        """The keys rank reads in sparse group ``group`` for query tokens ``w.start + rows``."""
        eng, ig = self.engine, runner.geometries[indexer]
        positions = w.start + np.asarray(rows, dtype=np.int64)
        keys = self._global_indexer_keys(runner, indexer, w)
        query = indexer_queries(indexer, w.req_index, positions, w.contents[rows], self.head_dim)
        nq, H, d = query.shape
        dots = torch.from_numpy(query.reshape(nq * H, d)) @ torch.from_numpy(keys).t()
        scores = dots.clamp_(min=0).reshape(nq, H, -1).sum(dim=1).numpy()
        scores[np.arange(len(keys))[None, :] > positions[:, None]] = -np.inf  # causal
        local_counts = np.asarray(eng.query_local_bounds(ig, w.start, w.stop, self.rank), dtype=np.int64)[rows]
        topk = runner.geometries[group].spec.index_topk
        selection = np.asarray(eng.select_topk(scores, topk, local_counts, self.rank), dtype=np.int64)
        g = runner.geometries[group]
        local = np.asarray(eng.sparse_local_keys(g, selection, self.rank), dtype=np.int64)
        every, _, _ = eng.attention_metadata(g, w.start, w.stop, runner.block_tables[group].row(w.req_index), self.rank, rows[-1:])
        chosen = np.unique(local[local >= 0])
        inside = chosen < len(every)
        slots = np.full(len(chosen), -1, dtype=np.int64)
        slots[inside] = every[chosen[inside]]
        mask = np.zeros((nq, len(chosen)), dtype=bool)
        j, _ = np.nonzero(local >= 0)
        mask[j, np.searchsorted(chosen, local[local >= 0])] = True
        return SparseKeys(slots, mask, selection)

    def _global_indexer_keys(self, runner, indexer: int, w: ReqWrite) -> np.ndarray:
        """``[w.stop, dim]`` indexer keys of positions ``[0, w.stop)``: this rank's rows read
        from its store, every rank's gathered (a sharded indexer). NaN where no rank gave one."""
        eng, ig = self.engine, runner.geometries[indexer]
        row = runner.block_tables[indexer].row(w.req_index)
        mine = np.asarray(eng.indexer_local_rows(ig, w.stop, self.rank), dtype=np.int64)
        last = np.array([w.stop - w.start - 1])
        slots, _, _ = eng.attention_metadata(ig, w.start, w.stop, row, self.rank, last)
        read = np.full(len(mine), -1, dtype=np.int64)
        read[: min(len(mine), len(slots))] = slots[: len(mine)]
        local = indexer_keys(runner.stores[indexer].read_vectors(read).numpy(), self.head_dim)
        out = np.full((w.stop, local.shape[1]), np.nan, dtype=np.float32)
        if not ig.sharded or self.world == 1:
            ok = (mine >= 0) & (mine < w.stop)
            out[mine[ok]] = local[ok]
            return out
        rows_of = [np.asarray(eng.indexer_local_rows(ig, w.stop, s), dtype=np.int64) for s in range(self.world)]
        n = max(len(r) for r in rows_of)
        send = np.zeros((n, local.shape[1]), dtype=np.float32)
        send[: len(local)] = local
        for s, part in enumerate(self.coll.all_gather_tensor(torch.from_numpy(send))):
            ok = (rows_of[s] >= 0) & (rows_of[s] < w.stop)
            out[rows_of[s][ok]] = part.numpy()[: len(rows_of[s])][ok]
        return out
