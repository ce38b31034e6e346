"""The engine's attention on one rank, per step (``--attention``).

After a step's writes, with the block tables the step ran with, each rank computes the
attention of every written request's query tokens over its own store: the engine's
``attention_metadata`` says which slots to read and with which mask; ``attend`` does the
math in float32. Sharded groups (the engine's geometry says which) report their LSE
through ``Engine.shard_lse`` and are merged across ranks in one collective call per step
and merge path (``Engine.merge_path``, by default ``Engine.merge_across_ranks``; heads padded
to a multiple of ``W``); replicated groups
run as ``W == 1``, each rank computing its own slice of heads (its tensor-parallel heads)
over its whole replica. A prefill whose cached context the engine gathers in chunks
(``Engine.context_gather``) reads that context through the gather
(``dcpsim.engine.attention.gathered``). Every rank computes every query token, those whose KV
another rank stores too (``Engine.attention_query_rows``, asked with each token's slot in the
rank's slot mapping; a token an engine skips reports an empty shard). The result of each (group,
request) is an ``AttentionResult`` that the checker judges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dcpsim.engine.attention.compute import attend
from dcpsim.engine.attention.gathered import gathered_keys
from dcpsim.engine.attention.heads import GroupHeads
from dcpsim.engine.attention.sparse import SparseIndexer
from dcpsim.engine.interface import Engine
from dcpsim.model.attention_config import AttentionConfig
from dcpsim.model.layout import PAD
from dcpsim.model.plan import AttentionResult, ReqWrite, StepPlan, WriteRecord
from dcpsim.model.sparse import is_indexer, sparse_topk
from dcpsim.model.vectors import query_vectors


class MergeVariantsDiffer(Exception):
    """The ranks of a DCP group chose different merge variants for one step."""

    def __init__(self, step: int, asked: str, chosen: list[str]):
        ranks = ", ".join(f"rank {r} {v}" for r, v in enumerate(chosen))
        super().__init__(f"the ranks chose different attention merge variants at step {step} (asked: {asked}): {ranks}")
        self.step, self.asked, self.chosen = step, asked, chosen


@dataclass
class _Local:
    group: int
    write: ReqWrite
    rows: np.ndarray
    merged: bool
    head0: int
    out: torch.Tensor
    lse: torch.Tensor
    visible: np.ndarray
    selection: np.ndarray | None = None


def query_slots(geometry, write: ReqWrite, record: WriteRecord | None) -> np.ndarray:
    """Each query token's slot in this rank's slot mapping of the step, from the rank's write
    log (``record``, the request's write in the group, ``PAD`` dropped): the slot of the entry
    the token's KV went to (a paged group's position, a compressed group's record, emitted at
    its last token); ``PAD`` where another rank stores it (or where the token emits nothing)."""
    out = np.full(len(write.contents), PAD, dtype=np.int64)
    if record is None or not len(record.slots):
        return out
    tps = geometry.tokens_per_state
    offset = np.asarray(record.index, dtype=np.int64) * tps + (tps - 1) - write.start
    keep = (offset >= 0) & (offset < len(out))
    out[offset[keep]] = np.asarray(record.slots, dtype=np.int64)[keep]
    return out


class ShardAttention:
    def __init__(self, engine, config: AttentionConfig, collectives, heads: dict[int, GroupHeads] | None = None):
        self.engine = engine
        self.cfg = config
        self.coll = collectives
        self.rank, self.world = collectives.rank, collectives.world_size
        self.heads = heads or {}
        """Group id -> this rank's heads, for the groups with several KV heads (``attention.heads``)."""
        self.merges = {"allgather": 0, "alltoall": 0}
        self.merged_by: dict[str, list[int]] = {}
        """Code -> [merges, rows it merged, rows of those merges], from the engine's ``MergedBy``."""
        self._items: list[_Local] = []
        self._geometries: list = []
        self.sparse = SparseIndexer(engine, config.head_dim, collectives)

    def compute(self, plan: StepPlan, runner, queries: dict[tuple[int, int], np.ndarray]) -> None:
        """Attention of the query tokens ``queries[(group, req_index)]`` (offsets from the
        write's start) of every write of the step, on this rank (during the step)."""
        cfg, dk = self.cfg, self.cfg.head_dim
        writes = {w.req_index: w for w in plan.writes}
        gathers = {gather.group: gather for gather in runner.gather_log}
        items = []
        indexer = next((k for k, geo in enumerate(runner.geometries) if is_indexer(geo.group_spec)), None)
        logged = {(rec.group, rec.req_index): rec for rec in runner.write_log}
        for (g, req), rows in queries.items():
            w, geometry, row = writes[req], runner.geometries[g], runner.block_tables[g].row(req)
            selection = None
            gather = gathers.get(g)
            if sparse_topk(geometry.group_spec) and indexer is not None:  # DSA: the indexer's top-k only
                picked = self.sparse.keys(runner, g, indexer, w, rows)
                slots, mask, merged, selection = picked.slots, picked.mask, geometry.sharded, picked.selection
            elif gather is not None and w.request_id in gather.request_ids:  # the context through the gather
                slots, mask, merged = gathered_keys(self.engine, geometry, w, row, self.rank, rows, gather)
            else:
                slots, mask, merged = self.engine.attention_metadata(geometry, w.start, w.stop, row, self.rank, rows)
            mask = self._computed_rows(geometry, w, rows, mask, logged.get((g, req)))
            kv = runner.stores[g].read_vectors(slots)
            heads = self.heads.get(g)
            H = cfg.heads if heads is None else len(heads.query_heads)
            # sharded: every head over the local shard (queries all-gathered), merged later;
            # replicated: this rank's heads over the whole replica, as with W == 1
            h0, h1 = (0, H) if merged else self._own_heads(H)
            if heads is None:
                query = torch.from_numpy(query_vectors(g, req, w.start + rows, w.contents[rows], H, dk))
                out, lse = attend(query[:, h0:h1], kv[:, :dk], kv[:, dk:], torch.from_numpy(mask), scale=cfg.softmax_scale, base=cfg.base)
            else:
                out, lse = self._attend_kv_heads(heads, h0, h1, g, w, rows, kv, mask)
            visible = mask.sum(axis=1)
            if merged:
                empty = torch.from_numpy(visible == 0)
                lse = self.engine.shard_lse(lse, empty)
                out = self.engine.shard_output(out, empty)
            items.append(_Local(g, w, rows, merged, h0, out, lse, visible, selection))
        self._items = items + self._padding(runner)
        self._geometries = runner.geometries

    def _computed_rows(self, geometry, w: ReqWrite, rows: np.ndarray, mask: np.ndarray, record: WriteRecord | None) -> np.ndarray:
        """``mask`` with the rows of the query tokens the engine does not compute on this rank
        (``Engine.attention_query_rows``, asked with each token's slot) emptied: such a token
        reports an empty shard (output 0, ``lse = -inf``) to the merge."""
        token_slots = query_slots(geometry, w, record)[np.asarray(rows, dtype=np.int64)]
        computed = np.asarray(self.engine.attention_query_rows(geometry, token_slots, self.rank), dtype=bool)
        return mask if computed.all() else mask & computed[:, None]

    def _own_heads(self, num_heads: int) -> tuple[int, int]:
        """This rank's slice of ``num_heads`` heads: what it computes of a replicated group
        (with KV heads: its own TP query heads, the slice the merge hands it back)."""
        hs = math.ceil(num_heads / self.world)
        return min(self.rank * hs, num_heads), min((self.rank + 1) * hs, num_heads)

    def _attend_kv_heads(self, heads: GroupHeads, h0: int, h1: int, g: int, w: ReqWrite, rows, kv, mask):
        """The attention of gathered query heads ``[h0, h1)`` of a group with KV heads: each
        query head (its global index's query vector) over the KV head the engine maps it to,
        read from the rank's store (one K/V vector per KV head it holds, in store order)."""
        cfg, dk, width = self.cfg, self.cfg.head_dim, self.cfg.kv_width
        every = query_vectors(g, w.req_index, w.start + rows, w.contents[rows], heads.num_heads, dk)
        query = torch.from_numpy(every[:, heads.query_heads[h0:h1]])
        index = heads.kv_index[h0:h1]
        out = torch.zeros((len(rows), h1 - h0, cfg.value_dim))
        lse = torch.full((len(rows), h1 - h0), float("-inf"))
        bias = torch.from_numpy(mask)
        for j in np.unique(index):
            which = torch.from_numpy(np.nonzero(index == j)[0])
            k, v = kv[:, j * width : j * width + dk], kv[:, j * width + dk : (j + 1) * width]
            out[:, which], lse[:, which] = attend(query[:, which], k, v, bias, scale=cfg.softmax_scale, base=cfg.base)
        return out, lse

    def _padding(self, runner) -> list[_Local]:
        """With ``padded_rows``: the padding rows of a step padded to a CUDA-graph size, one
        item per sharded attention group whose metadata has dummy requests. vLLM pads the
        replayed batch with ``seq_lens`` 0, so a padding row sees no key on any rank: each rank
        reports an empty shard (``shard_lse``/``shard_output`` of an all-empty row) to the merge."""
        if not self.cfg.padded_rows:
            return []
        dv, out = self.cfg.value_dim, []
        for meta in runner.metadata_log:
            g = runner.geometries[meta.group]
            if meta.model != "target" or not g.sharded or not meta.num_dummy_requests:
                continue
            heads = self.heads.get(meta.group)
            H = self.cfg.heads if heads is None else len(heads.query_heads)
            n = meta.num_dummy_requests * (1 + g.num_speculative_tokens)
            empty = torch.ones(n, dtype=torch.bool)
            lse = self.engine.shard_lse(torch.full((n, H), float("-inf")), empty)
            o = self.engine.shard_output(torch.zeros((n, H, dv)), empty)
            out.append(_Local(meta.group, None, np.arange(n, dtype=np.int64), True, 0, o, lse, np.zeros(n, np.int64)))
        return out

    def finish(self, step: int) -> list[AttentionResult]:
        """Merge the sharded items across ranks; every item's result, in compute order."""
        items, self._items = self._items, []
        results = [self._result(it, it.out, it.lse, it.head0) for it in items]
        paths: dict = {}  # the engine's merge path (and head count) of each merged item, in order of first appearance
        for k, it in enumerate(items):
            if it.merged:
                paths.setdefault((self.engine.merge_path(self._geometries[it.group]), it.out.shape[1]), []).append(k)
        for (merge, _), merged in paths.items():
            for k, (o, lse, h0) in zip(merged, self._merge(step, merge, [items[k] for k in merged])):
                results[k] = self._result(items[k], o, lse, h0)
        return results

    @staticmethod
    def _result(it: _Local, out, lse, head0: int) -> AttentionResult:
        return AttentionResult(
            it.group, it.write, it.rows, it.merged, out, lse, head0, head0 + out.shape[1], it.visible, it.lse, it.head0, it.selection
        )

    def _agreed_variant(self, step: int) -> str:
        """The step's merge variant as the engine chooses it (``Engine.merge_variant``); an
        engine that chooses per rank has the choices gathered first, and ranks that differ
        raise ``MergeVariantsDiffer`` on every rank alike (no collective of another shape)."""
        variant = self.cfg.variant_for_step(step)
        if type(self.engine).merge_variant is Engine.merge_variant:
            return variant  # the run's own variant: the same on every rank
        chosen = self.engine.merge_variant(variant, self.rank)
        every = self.coll.all_gather_object(chosen)
        if len(set(every)) > 1:
            raise MergeVariantsDiffer(step, variant, every)
        return chosen

    def _merge(self, step: int, merge, items: list[_Local]):
        """Per merged item (all of one head count): (output, lse, first head) of the slice this rank holds."""
        H, W = items[0].out.shape[1], self.world
        hs = math.ceil(H / W)
        pad = hs * W - H
        out = torch.cat([it.out for it in items])
        lse = torch.cat([it.lse for it in items])
        if pad:
            out = torch.cat([out, out.new_zeros((out.shape[0], pad, out.shape[2]))], dim=1)
            lse = torch.cat([lse, lse.new_full((lse.shape[0], pad), float("-inf"))], dim=1)
        variant = self._agreed_variant(step)
        self.merges[variant] += 1
        o, l, c, *by = merge(out, lse, self.coll, variant=variant, base=self.cfg.base)
        if by:
            self.merged_by.setdefault(by[0].code, [0, 0, 0])
            tally = self.merged_by[by[0].code]
            tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + by[0].rows, tally[2] + by[0].of
        h0, h1 = min(c * hs, H), min((c + 1) * hs, H)
        result, offset = [], 0
        for it in items:
            n = len(it.rows)
            result.append((o[offset : offset + n, : h1 - h0], l[offset : offset + n, : h1 - h0], h0))
            offset += n
        return result
