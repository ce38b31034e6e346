"""The attention check's verdict: the engine's per-step attention against a reference.

For every step, every request written in it and every attention group (paged and
compressed-records groups; rings are compressor state, not attention KV), the engine
reports an ``AttentionResult`` per rank (``dcpsim.engine.attention.shard``). Here each
rank recomputes the heads the engine gave it over the request's full context from plan
data alone (``attention_reference``): positions before the write hold the request's true
contents, the write's positions hold what it wrote. The ranks then all-gather one row per
item (max error, where, LSEs) so that every rank reaches the same verdict; only on a
mismatch do they gather each rank's contribution.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dcpsim.model.attention_config import AttentionConfig
from dcpsim.model.kinds import Storage
from dcpsim.model.plan import AttentionResult, StepPlan
from dcpsim.model.rank_view import RankView
from dcpsim.model.vectors import kv_vectors, query_vectors
from dcpsim.plural import plural
from dcpsim.verify.attention_reference import (
    context_keys,
    reference_attention,
    reference_context,
    select_queries,
    state_error,
)
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.report import Failure, FailureKind

ERR, QUERY, HEAD, LSE_GOT, LSE_REF = range(5)


class AttentionVerifier:
    def __init__(self, config: AttentionConfig, groups: list[ExpectedGroup], collectives, view: RankView):
        self.cfg = config
        self.coll = collectives
        self.rank, self.world = collectives.rank, collectives.world_size
        self.groups = {view.group_of_layer(g.layer_names[0]): g for g in groups
                       if g.storage not in (Storage.RING, Storage.STATE)}
        """The engine's store of each attention group -> the checker's geometry of it."""
        self.checks = 0
        self.query_tokens = 0
        self.sampled = 0
        self.max_error = 0.0
        self._true_kv: dict[tuple[int, int], np.ndarray] = {}

    def queries(self, plan: StepPlan) -> dict[tuple[int, int], np.ndarray]:
        """Which query tokens of each (group, write) the engine must compute: all of them,
        or a deterministic sample of a huge prefill chunk (``max_query_keys``)."""
        out = {}
        for store, group in self.groups.items():
            for w in plan.writes:
                keys = context_keys(group, w.start, w.stop)
                out[(store, w.req_index)] = select_queries(w.stop - w.start, keys, self.cfg.max_query_keys)
        return out

    # --- the reference --------------------------------------------------------------

    def _true_vectors(self, store: int, view, upto: int) -> np.ndarray:
        """K/V of the request's true contents at positions ``[0, upto)`` (cached per request)."""
        key = (store, view.req_index)
        have = self._true_kv.get(key)
        n = 0 if have is None else len(have)
        if n < upto:
            new = kv_vectors(store, view.fingerprints[n:upto], self.cfg.kv_width)
            have = new if have is None else np.concatenate([have, new])
            self._true_kv[key] = have
        return have

    def _reference(self, res: AttentionResult, view):
        w, cfg, dk = res.write, self.cfg, self.cfg.head_dim
        emit, mask = reference_context(self.groups[res.group], w.start, w.stop, res.rows)
        kv = np.empty((len(emit), cfg.kv_width), dtype=np.float32)
        hist = emit < w.start  # committed before the step: the request's true contents
        if hist.any():
            kv[hist] = self._true_vectors(res.group, view, w.start)[emit[hist]]
        kv[~hist] = kv_vectors(res.group, w.contents[emit[~hist] - w.start], cfg.kv_width)
        kv = torch.from_numpy(kv)
        # the queries come from plan data (request, position, content), as the engine's do
        query = torch.from_numpy(query_vectors(res.group, w.req_index, w.start + res.rows,
                                               w.contents[res.rows], cfg.heads, dk))
        return reference_attention(query[:, res.head0:res.head1], kv[:, :dk], kv[:, dk:],
                                   torch.from_numpy(mask), scale=cfg.softmax_scale, base=cfg.lse_base)

    # --- the verdict ----------------------------------------------------------------

    def judge(self, plan: StepPlan, results: list[AttentionResult]) -> Failure | None:
        if not results:
            return None
        views = {v.req_index: v for v in plan.views}
        rows = np.zeros((len(results), 5), dtype=np.float64)
        for k, res in enumerate(results):
            if res.head1 <= res.head0:  # this rank holds no real head (more ranks than heads)
                rows[k] = (0.0, -1, -1, math.nan, math.nan)
                continue
            o_ref, l_ref = self._reference(res, views[res.write.req_index])
            err = state_error(res.out, res.lse, o_ref, l_ref)
            j, h = divmod(int(torch.argmax(err)), res.head1 - res.head0)
            rows[k] = (float(err[j, h]), j, res.head0 + h, float(res.lse[j, h]), float(l_ref[j, h]))
        gathered = torch.stack(self.coll.all_gather_tensor(torch.from_numpy(rows))).numpy()  # [W, n, 5]
        errors = gathered[:, :, ERR]
        self.checks += len(results)
        self.query_tokens += sum(len(r.rows) for r in results)
        self.sampled += sum(len(r.rows) < r.write.stop - r.write.start for r in results)
        self.max_error = max(self.max_error, float(errors.max()))  # NaN was mapped to +inf
        worst = errors.max(axis=0)
        bad = np.nonzero(~(worst <= self.cfg.tolerance))[0]
        if not len(bad):
            return None
        return self._failure(plan, results, gathered, int(bad[0]))

    def _failure(self, plan: StepPlan, results: list[AttentionResult], gathered: np.ndarray, k: int) -> Failure:
        res = results[k]
        w = res.write
        who = int(np.argmax(gathered[:, k, ERR]))
        err, j, h, lse_got, lse_ref = gathered[who, k]
        j, h = int(j), int(h)
        token = int(res.rows[j])
        mine = h - res.shard_head0
        contributions = self.coll.all_gather_object(dict(
            rank=self.rank, keys=int(res.visible[j]),
            lse=float(res.shard_lse[j, mine]) if 0 <= mine < res.shard_lse.shape[1] else None,
        ))
        position = w.start + token
        what = "merged across ranks" if res.merged else "computed on each rank (replicated: no merge)"
        details = [
            f"query token {token} of {w.stop - w.start} (positions {w.start}..{w.stop - 1}), head {h}, "
            f"checked on rank {who}",
            f"lse: {lse_got:.6g} (engine, {what}) vs {lse_ref:.6g} (reference), base {self.cfg.lse_base}",
        ]
        if res.merged:
            details.append(f"merge variant: {self.cfg.variant_for_step(plan.step)}")
        details += [
            f"rank {c['rank']}: {plural(c['keys'], 'key')} visible, "
            + (f"lse {c['lse']:.6g}" if c["lse"] is not None else f"(computes other heads than {h})")
            for c in contributions
        ]
        return Failure(
            kind=FailureKind.ATTENTION_MISMATCH,
            step=plan.step,
            message=f"attention differs from the full-context reference: error {err:.3g} > tolerance "
            f"{self.cfg.tolerance:g} at query position {position}",
            group=self.groups[res.group].name,
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
