"""The checker's sparse attention (DSA, semantics section 14), from plan data alone.

For a write of a request in a sparse group, the checker scores every position of each
query token's causal context itself: indexer keys from the true contents (positions before
the write) and the write's contents, indexer queries from (request, position, content),
``sum_h relu(q_h . k_t)`` in float64. Its selection follows the tie rule with its own
arithmetic: every score above the k-th largest, then the tied ones by position ascending
(a context of at most ``index_topk`` positions is selected whole). Then:

* **Agreement.** Each rank reports the selection it attended with; the ranks all-gather one
  order-free digest per query token, the checker's own digest beside. The first token where
  a rank's digest differs from the checker's is a ``sparse-selection`` failure naming the
  rank, request and position, with the keys it missed and the keys it added.
* **Attention.** The merged output must equal a float64 reference over exactly the
  selected keys (``attention_reference.reference_attention``), every rank computing the
  whole reference of its results (at most ``index_topk`` keys a token).

It never imports the engine, nor reuses its selection or its local mappings.
"""

from __future__ import annotations

import numpy as np
import torch

from dcpsim.model.content import mix64_into
from dcpsim.model.plan import AttentionResult, StepPlan
from dcpsim.model.sparse import indexer_keys, indexer_queries
from dcpsim.model.vectors import kv_vectors, query_vectors
from dcpsim.plural import plural
from dcpsim.verify.attention_reference import reference_attention
from dcpsim.verify.report import Failure, FailureKind

_DIGEST_SALT = np.uint64(0x2545F4914F6CDD1D)


def contents_at(view, write, positions: np.ndarray) -> np.ndarray:
    """The content each position holds after the write: the request's true one before the
    write, the write's own from its start."""
    positions = np.asarray(positions, dtype=np.int64)
    before = positions < write.start
    out = np.empty(len(positions), dtype=np.int64)
    out[before] = np.asarray(view.fingerprints)[positions[before]]
    out[~before] = np.asarray(write.contents)[positions[~before] - write.start]
    return out


def scores(indexer_store: int, view, write, rows: np.ndarray, kv_width: int, head_dim: int) -> np.ndarray:
    """``[len(rows), write.stop]`` float64 scores, ``-inf`` past each token's position."""
    positions = write.start + np.asarray(rows, dtype=np.int64)
    every = np.arange(write.stop, dtype=np.int64)
    keys = indexer_keys(kv_vectors(indexer_store, contents_at(view, write, every), kv_width), head_dim).astype(np.float64)
    q = indexer_queries(indexer_store, write.req_index, positions, np.asarray(write.contents)[rows], head_dim).astype(np.float64)
    nq, H, d = q.shape
    s = np.maximum(q.reshape(nq * H, d) @ keys.T, 0.0).reshape(nq, H, -1).sum(axis=1)
    s[every[None, :] > positions[:, None]] = -np.inf
    return s


def select(score_rows: np.ndarray, positions: np.ndarray, topk: int) -> list[np.ndarray]:
    """Each token's selected positions (ascending): every score above the k-th largest of its
    context ``[0, p]`` (``-inf`` beyond it), then the ones equal to it by position ascending
    up to ``k``; a context of at most ``k`` positions whole."""
    s = np.asarray(score_rows, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.int64)
    nq, n = s.shape
    if not nq:
        return []
    k = min(topk, n)
    kth = np.partition(s, n - k, axis=1)[:, n - k : n - k + 1]  # the k-th largest of each row
    above = s > kth
    tied = s == kth
    room = k - above.sum(axis=1, keepdims=True)
    chosen = above | (tied & (np.cumsum(tied, axis=1) <= room))
    whole = positions + 1 <= topk  # short contexts: every position up to p
    chosen[whole] = np.arange(n)[None, :] <= positions[whole, None]
    return [np.flatnonzero(row) for row in chosen]


def digest(positions: np.ndarray) -> int:
    """An order-free digest of a set of positions (-1 entries ignored) as an int64."""
    p = np.asarray(positions, dtype=np.int64)
    p = p[p >= 0]
    total = mix64_into(p.astype(np.uint64) * _DIGEST_SALT + np.uint64(1)).sum(dtype=np.uint64) ^ np.uint64(len(p))
    return int(np.array([total], dtype=np.uint64).view(np.int64)[0])


class SparseCheck:
    """The checker's side of the sparse groups of one rank's run."""

    def __init__(self, config, collectives, indexer_store: int, topk_of: dict[int, int], names: dict[int, str]):
        self.cfg = config
        self.names = names
        self.coll = collectives
        self.indexer_store = indexer_store
        self.topk_of = topk_of
        """Sparse group store -> its ``index_topk``."""
        self.selections: dict[int, list[np.ndarray]] = {}
        self.checked_tokens = 0

    def is_sparse(self, res: AttentionResult) -> bool:
        return res.group in self.topk_of

    def expected(self, res: AttentionResult, view) -> list[np.ndarray]:
        positions = res.write.start + np.asarray(res.rows, dtype=np.int64)
        s = scores(self.indexer_store, view, res.write, res.rows, self.cfg.kv_width, self.cfg.head_dim)
        return select(s, positions, self.topk_of[res.group])

    def reference(self, res: AttentionResult, view, selected: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 reference ``(O, lse)`` of the result's heads over exactly the selected keys."""
        cfg, w, dk = self.cfg, res.write, self.cfg.head_dim
        union = np.unique(np.concatenate(selected)) if selected else np.zeros(0, np.int64)
        mask = np.zeros((len(selected), len(union)), dtype=bool)
        for j, sel in enumerate(selected):
            mask[j, np.searchsorted(union, sel)] = True
        kv = torch.from_numpy(kv_vectors(res.group, contents_at(view, w, union), cfg.kv_width))
        positions = w.start + np.asarray(res.rows, dtype=np.int64)
        query = torch.from_numpy(query_vectors(res.group, w.req_index, positions, np.asarray(w.contents)[res.rows], cfg.heads, dk))
        o, lse = reference_attention(query, kv[:, :dk], kv[:, dk:], torch.from_numpy(mask), scale=cfg.softmax_scale, base=cfg.base)
        return o[:, res.head0 : res.head1], lse[:, res.head0 : res.head1]

    def agreement(self, plan: StepPlan, results: list[AttentionResult], expected: dict[int, list[np.ndarray]]) -> Failure | None:
        """All-gather each sparse token's digest; the first token where a rank's selection is
        not the checker's, as a failure (every rank reaches the same verdict)."""
        sparse = [k for k, res in enumerate(results) if self.is_sparse(res)]
        if not sparse:
            return None
        mine = np.array([digest(row) for k in sparse for row in results[k].selection], dtype=np.int64)
        ours = np.array([digest(sel) for k in sparse for sel in expected[k]], dtype=np.int64)
        self.checked_tokens += len(ours)
        gathered = torch.stack(self.coll.all_gather_tensor(torch.from_numpy(mine))).numpy()  # [W, tokens]
        bad = np.nonzero((gathered != ours[None, :]).any(axis=0))[0]
        if not len(bad):
            return None
        return self._failure(plan, results, sparse, expected, gathered, int(bad[0]))

    def _failure(self, plan, results, sparse, expected, gathered, token: int) -> Failure:
        counts = np.cumsum([0] + [len(results[k].rows) for k in sparse])
        i = int(np.searchsorted(counts, token, side="right") - 1)
        k, j = sparse[i], token - int(counts[i])
        res = results[k]
        want = expected[k][j]
        rows = self.coll.all_gather_object([int(p) for p in res.selection[j] if p >= 0])
        wrong = [r for r in range(len(rows)) if gathered[r, token] != digest(want)]
        position = res.write.start + int(res.rows[j])
        details = [f"the checker selects {plural(len(want), 'key')} of positions 0..{position} (index_topk {self.topk_of[res.group]})"]
        for r, got in enumerate(rows):
            missing = np.setdiff1d(want, got)
            extra = np.setdiff1d(got, want)
            verdict = "agrees" if r not in wrong else f"misses {_few(missing)}, adds {_few(extra)}"
            details.append(f"rank {r}: {plural(len(got), 'key')} selected, {verdict}")
        others = "the other ranks and " if len(wrong) < len(rows) else ""
        return Failure(
            kind=FailureKind.SPARSE_SELECTION,
            step=plan.step,
            message=f"rank {wrong[0]}'s top-k selection differs from {others}the scenario's (score descending, then "
            f"position ascending) at query position {position}",
            group=self.names[res.group],
            request_id=res.write.request_id,
            details=details,
            query_position=position,
        )


def _few(values: np.ndarray, n: int = 6) -> str:
    shown = ", ".join(str(int(v)) for v in values[:n])
    more = f", ... ({len(values)} in all)" if len(values) > n else ""
    return f"[{shown}{more}]"
