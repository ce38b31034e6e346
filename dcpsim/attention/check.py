"""The per-step attention check: engine attention on every rank, LSE merge, reference.

For every step, every request written in it and every attention group (paged and
compressed-records groups; rings are compressor state, not attention KV):

1. during the step (after its writes, with the block tables the step ran with), each rank
   computes attention of the write's query tokens over its local shard, reading K/V
   through its block table (``compute_local``, called by ``ModelRunner.apply``);
2. sharded groups are merged across ranks with their LSEs, over the ``Collectives``:
   *allgather*: all-gather the LSEs, rescale the own output, reduce-scatter the rescaled
   outputs over heads (each rank gets the merged output of its slice of heads), then
   all-gather the slices; *alltoall*: all-to-all over heads, then each rank merges its
   slice with ``merge_attention_states``. Replicated groups (and ``W == 1``) run as
   ``W == 1``: no merge; each rank computes its own slice of heads (its tensor-parallel
   heads) over its whole replica;
3. each rank compares one slice of heads (sharded: the merged slice it holds; replicated:
   the slice it computed) with the full-context reference computed from plan
   data (``compute.reference_*``), so the reference costs one full context per step, then the
   ranks all-gather one row per item (max error, where, LSEs) so that every rank reaches
   the same verdict; only on a mismatch do they gather each rank's contribution.

All sharded items of a step travel in one collective call (queries concatenated, heads
padded to a multiple of ``W``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dcpsim.attention.compute import (
    attend,
    context_keys,
    engine_view,
    reference_attention,
    reference_context,
    select_queries,
    state_error,
)
from dcpsim.attention.config import AttentionConfig
from dcpsim.attention.merge import merge_attention_states, merge_lse, scale_output
from dcpsim.attention.vectors import KVVectors, kv_vectors, query_vectors
from dcpsim.group_layout import RING, GroupLayout
from dcpsim.runtime.collectives import Collectives
from dcpsim.scheduler.plan import ReqWrite, StepPlan
from dcpsim.verify.read import read_slots
from dcpsim.verify.report import Failure

ERR, QUERY, HEAD, LSE_GOT, LSE_REF = range(5)


@dataclass
class _Local:
    """One (group, request) of a step on this rank, before the merge."""

    group: int
    write: ReqWrite
    rows: np.ndarray  # the query tokens computed (offsets from write.start): all, or a sample
    merged: bool
    query: torch.Tensor  # [rows, H, dk] (every head: the reference takes the ones it checks)
    head0: int  # out and lse hold heads [head0, head0 + out.shape[1])
    out: torch.Tensor  # [rows, heads, dv]
    lse: torch.Tensor  # [rows, heads], as reported to the merge
    visible: np.ndarray  # [rows] keys each computed query token sees on this rank


class AttentionChecker:
    def __init__(self, config: AttentionConfig, layouts: list[GroupLayout], collectives: Collectives, fault=None):
        self.cfg = config
        self.layouts = layouts  # the true layouts: the reference's
        self.coll = collectives
        self.rank = collectives.rank
        self.world = collectives.world_size
        self.fault = fault
        self.groups = [g for g, lay in enumerate(layouts) if lay.storage != RING]
        hs = math.ceil(config.heads / self.world)
        self.own_heads = (min(self.rank * hs, config.heads), min((self.rank + 1) * hs, config.heads))
        """This rank's slice of heads: what it computes of a replicated group (its tensor-parallel
        heads; DCP reuses the TP ranks) and what it checks of a replicated group."""
        self.checks = 0
        self.query_tokens = 0
        self.sampled = 0
        self.max_error = 0.0
        self.bytes = 0
        self.merges = {"allgather": 0, "alltoall": 0}
        self._items: list[_Local] = []
        self._true_kv: dict[tuple[int, int], np.ndarray] = {}
        self.kv_vectors = KVVectors(config.kv_width)
        """The write path's vector function (``ModelRunner(kv_vectors=...)``)."""

    # --- 1. the engine, on this rank, during the step ---------------------------------

    def compute_local(self, plan: StepPlan, runner) -> None:
        cfg, dk = self.cfg, self.cfg.head_dim
        items = []
        for g in self.groups:
            lay = runner.layouts[g]
            if lay.storage == RING:
                continue
            table, store = runner.block_tables[g], runner.stores[g]
            for w in plan.writes:
                keys = context_keys(self.layouts[g], w.start, w.stop)  # the same on every rank
                rows = select_queries(w.stop - w.start, keys, cfg.max_query_keys)
                local, mask, merged = engine_view(lay, runner.rank, w.start, w.stop, self.fault, rows)
                kv = store.read_vectors(read_slots(lay, table.row(w.req_index), local))
                query = torch.from_numpy(
                    query_vectors(g, w.req_index, w.start + rows, w.contents[rows], cfg.heads, dk))
                mask_t = torch.from_numpy(mask)
                # sharded: every head over the local shard (queries all-gathered), merged later;
                # replicated: this rank's heads over the whole replica, as with W == 1
                h0, h1 = (0, cfg.heads) if merged else self.own_heads
                out, lse = attend(query[:, h0:h1], kv[:, :dk], kv[:, dk:], mask_t,
                                  scale=cfg.softmax_scale, base=cfg.lse_base)
                visible = mask.sum(axis=1)
                if merged and self.fault is not None:
                    lse = self.fault.shard_lse(lse, torch.from_numpy(visible == 0))
                items.append(_Local(g, w, rows, merged, query, h0, out, lse, visible))
        self._items = items

    # --- 2. the merge -------------------------------------------------------------------

    def _merge_alltoall(self, out: torch.Tensor, lse: torch.Tensor, hs: int):
        q, _, d = out.shape
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [Q, Hp, D + 1]
        send = packed.reshape(q, self.world, hs, d + 1).transpose(0, 1).contiguous()
        recv = self.coll.all_to_all_tensor(send)  # [W, Q, hs, D + 1]; recv[s] came from rank s
        o, l = merge_attention_states(recv[..., :d], recv[..., d], base=self.cfg.lse_base)
        return o, l, self.rank

    def _merge_allgather(self, out: torch.Tensor, lse: torch.Tensor, hs: int):
        q, _, d = out.shape
        lses = torch.stack(self.coll.all_gather_tensor(lse))  # [W, Q, Hp]
        merged_lse, factors = merge_lse(lses, base=self.cfg.lse_base)
        mine = scale_output(out, factors[self.rank])
        send = mine.reshape(q, self.world, hs, d).transpose(0, 1).contiguous()
        part = self.coll.reduce_scatter_tensor(send)  # [Q, hs, D]: this rank's heads, merged
        slices = torch.stack(self.coll.all_gather_tensor(part))  # [W, Q, hs, D]
        # check a slice this rank did not merge itself, so that the final gather is checked too
        c = (self.rank + 1) % self.world
        return slices[c], merged_lse[:, c * hs : (c + 1) * hs], c

    def _merge(self, step: int, items: list[_Local]):
        """Per merged item: (output, lse, first head, end head) of the slice this rank checks."""
        H, W = self.cfg.heads, self.world
        hs = math.ceil(H / W)
        pad = hs * W - H
        out = torch.cat([it.out for it in items])
        lse = torch.cat([it.lse for it in items])
        if pad:
            out = torch.cat([out, out.new_zeros((out.shape[0], pad, out.shape[2]))], dim=1)
            lse = torch.cat([lse, lse.new_full((lse.shape[0], pad), float("-inf"))], dim=1)
        variant = self.cfg.variant_for_step(step)
        self.merges[variant] += 1
        merge = self._merge_alltoall if variant == "alltoall" else self._merge_allgather
        o, l, c = merge(out, lse, hs)
        h0, h1 = min(c * hs, H), min((c + 1) * hs, H)
        result, offset = [], 0
        for it in items:
            n = len(it.rows)
            result.append((o[offset : offset + n, : h1 - h0], l[offset : offset + n, : h1 - h0], h0, h1))
            offset += n
        return result

    # --- 3. the reference and the verdict ----------------------------------------------

    def _true_vectors(self, g: int, view, upto: int) -> np.ndarray:
        """K/V of the request's true contents at positions ``[0, upto)`` (cached per request)."""
        key = (g, view.req_index)
        have = self._true_kv.get(key)
        n = 0 if have is None else len(have)
        if n < upto:
            new = kv_vectors(g, view.fingerprints[n:upto], self.cfg.kv_width)
            have = new if have is None else np.concatenate([have, new])
            self._true_kv[key] = have
        return have

    def _reference(self, it: _Local, view, h0: int, h1: int):
        lay, w = self.layouts[it.group], it.write
        emit, mask = reference_context(lay, w.start, w.stop, it.rows)
        kv = np.empty((len(emit), self.cfg.kv_width), dtype=np.float32)
        hist = emit < w.start  # committed before the step: the request's true contents
        if hist.any():
            kv[hist] = self._true_vectors(it.group, view, w.start)[emit[hist]]
        kv[~hist] = kv_vectors(it.group, w.contents[emit[~hist] - w.start], self.cfg.kv_width)
        kv = torch.from_numpy(kv)
        dk = self.cfg.head_dim
        # the queries come from plan data (request, position, content), as the engine's do
        return reference_attention(it.query[:, h0:h1], kv[:, :dk], kv[:, dk:], torch.from_numpy(mask),
                                   scale=self.cfg.softmax_scale, base=self.cfg.lse_base)

    def finish(self, plan: StepPlan) -> Failure | None:
        items, self._items = self._items, []
        if not items:
            return None
        before = self.coll.bytes_sent
        try:
            return self._finish(plan, items)
        finally:
            self.bytes += self.coll.bytes_sent - before

    def _finish(self, plan: StepPlan, items: list[_Local]) -> Failure | None:
        # replicated groups: each rank checks the heads it computed (any wrong key it reads
        # shows in every head); sharded groups: the merged slice it holds
        checked: list = [(it.out, it.lse, it.head0, it.head0 + it.out.shape[1]) for it in items]
        merged = [k for k, it in enumerate(items) if it.merged]
        if merged:
            for k, part in zip(merged, self._merge(plan.step, [items[k] for k in merged])):
                checked[k] = part
        views = {v.req_index: v for v in plan.views}
        rows = np.zeros((len(items), 5), dtype=np.float64)
        for k, (it, (o, l, h0, h1)) in enumerate(zip(items, checked)):
            if h1 <= h0:  # this rank holds no real head (more ranks than heads)
                rows[k] = (0.0, -1, -1, math.nan, math.nan)
                continue
            o_ref, l_ref = self._reference(it, views[it.write.req_index], h0, h1)
            err = state_error(o, l, o_ref, l_ref)
            j, h = divmod(int(torch.argmax(err)), h1 - h0)
            rows[k] = (float(err[j, h]), j, h0 + h, float(l[j, h]), float(l_ref[j, h]))
        gathered = torch.stack(self.coll.all_gather_tensor(torch.from_numpy(rows))).numpy()  # [W, n, 5]
        errors = gathered[:, :, ERR]
        self.checks += len(items)
        self.query_tokens += sum(len(it.rows) for it in items)
        self.sampled += sum(len(it.rows) < it.write.stop - it.write.start for it in items)
        self.max_error = max(self.max_error, float(errors.max()))  # NaN was mapped to +inf
        worst = errors.max(axis=0)
        bad = np.nonzero(~(worst <= self.cfg.tolerance))[0]
        if not len(bad):
            return None
        return self._failure(plan, items, gathered, int(bad[0]))

    def _failure(self, plan: StepPlan, items: list[_Local], gathered: np.ndarray, k: int) -> Failure:
        it = items[k]
        lay, w = self.layouts[it.group], it.write
        who = int(np.argmax(gathered[:, k, ERR]))
        err, j, h, lse_got, lse_ref = gathered[who, k]
        j, h = int(j), int(h)
        token = int(it.rows[j])
        mine = h - it.head0
        contributions = self.coll.all_gather_object(dict(
            rank=self.rank, keys=int(it.visible[j]),
            lse=float(it.lse[j, mine]) if 0 <= mine < it.lse.shape[1] else None,  # None: not its head
        ))
        position = w.start + token
        what = "merged across ranks" if it.merged else "computed on each rank (replicated: no merge)"
        details = [
            f"query token {token} of {w.stop - w.start} (positions {w.start}..{w.stop - 1}), head {h}, "
            f"checked on rank {who}",
            f"lse: {lse_got:.6g} (engine, {what}) vs {lse_ref:.6g} (reference), base {self.cfg.lse_base}",
        ]
        if it.merged:
            details.append(f"merge variant: {self.cfg.variant_for_step(plan.step)}")
        details += [
            f"rank {c['rank']}: {c['keys']} keys visible, "
            + (f"lse {c['lse']:.6g}" if c["lse"] is not None else f"(computes other heads than {h})")
            for c in contributions
        ]
        return Failure(
            kind="attention-mismatch",
            step=plan.step,
            message=f"attention differs from the full-context reference: error {err:.3g} > tolerance "
            f"{self.cfg.tolerance:g} at query position {position}",
            group=lay.name,
            request_id=w.request_id,
            details=details,
            query_position=position,
            head=h,
            error=float(err),
            contributions=contributions,
        )

    def forget_finished(self, plan: StepPlan) -> None:
        """Drop cached reference vectors of requests that are no longer live."""
        live = {v.req_index for v in plan.views}
        for key in [key for key in self._true_kv if key[1] not in live]:
            del self._true_kv[key]


def make_attention_checker(job, fault, layouts: list[GroupLayout], coll: Collectives) -> AttentionChecker | None:
    """The run's attention checker: on with ``job.attention`` or a fault that needs it."""
    if not (job.attention or fault.needs.get("attention")):
        return None
    config = AttentionConfig(heads=job.attention_heads, head_dim=job.attention_head_dim,
                             value_dim=job.attention_head_dim, lse_base=job.lse_base,
                             merge=job.attention_merge)
    return AttentionChecker(config, layouts, coll, fault)


def fill_report(report, checker: AttentionChecker | None) -> None:
    if checker is None:
        return
    report.attention = checker.cfg.summary()
    report.attention_checks = checker.checks
    report.attention_query_tokens = checker.query_tokens
    report.attention_sampled_checks = checker.sampled
    report.attention_max_error = checker.max_error if checker.checks else None
    report.attention_bytes = checker.bytes
    report.attention_merges = dict(checker.merges)
