"""The attention check's verdict: the engine's per-step attention against a reference.

For every checked step (``max_step_keys``), every request written in it and every
attention group (paged and compressed-records groups; rings are compressor state, not
attention KV), the engine reports an ``AttentionResult`` per rank
(``dcpsim.engine.attention.shard``). Here the ranks recompute the request's full context
from plan data alone (``attention_reference``): positions before the write hold the
request's true contents, the write's positions hold what it wrote. The context is cut
into blocks of ``KEY_BLOCK`` keys dealt round-robin to the ranks from rank ``i % W`` for
request ``i`` (``block_owner``; not the engine's layout); each rank computes every head
over its blocks, all of a step's requests in few calls (``reference_attention_many``),
and one all-gather combines the partials by their LSEs, in float64. The ranks then
all-gather one row per item (max error, where, LSEs) so that every rank reaches the same
verdict; only on a mismatch do they gather each rank's contribution.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dcpsim.model.attention_config import AttentionConfig
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import AttentionResult, StepPlan
from dcpsim.model.rank_view import RankView
from dcpsim.model.vectors import kv_vectors, query_vectors
from dcpsim.plural import plural
from dcpsim.verify.attention_heads import expected_heads
from dcpsim.verify.attention_reference import (
    KEY_BLOCK,
    block_mask,
    check_step,
    context_keys,
    emit_positions,
    key_range,
    keys_before,
    merge_by_lse,
    reference_attention_many,
    select_queries,
    state_error,
)
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.oracle import owned_below
from dcpsim.verify.report import Failure, FailureKind
from dcpsim.verify.sparse import SparseCheck

ERR, QUERY, HEAD, LSE_GOT, LSE_REF, EMPTY_BAD, EMPTY_TOKEN, EMPTY_LSE = range(8)
HEAD_CODE = 1 << 16
"""``EMPTY_TOKEN`` holds ``token * HEAD_CODE + head`` (one float64 column for both)."""


class AttentionVerifier:
    def __init__(
        self, config: AttentionConfig, groups: list[ExpectedGroup], collectives, view: RankView, *, scenario_config=None, world_rank=0
    ):
        """``scenario_config`` (the scenario's ``SimConfig``) and ``world_rank``: the heads of a
        scenario that states them (``verify.attention_heads``); without, one KV head a group."""
        self.cfg = config
        self.coll = collectives
        self.rank, self.world = collectives.rank, collectives.world_size
        attended = [g for g in groups if g.storage not in (Storage.RING, Storage.STATE) and not g.indexer]
        self.groups = {view.group_of_layer(g.layer_names[0]): g for g in attended}
        """The engine's store of each attention group -> the checker's geometry of it."""
        heads = expected_heads(scenario_config, world_rank) if scenario_config is not None else None
        self.heads = {store: heads for store, g in self.groups.items() if heads is not None and g.gqa}
        """Store -> the gathered query heads and the KV head each reads, for the groups with KV heads."""
        indexer = next((g for g in groups if g.indexer), None)
        topk_of = {store: g.index_topk for store, g in self.groups.items() if g.index_topk}
        self.sparse = None
        if indexer is not None and topk_of:
            names = {store: g.name for store, g in self.groups.items()}
            self.sparse = SparseCheck(config, collectives, view.group_of_layer(indexer.layer_names[0]), topk_of, names)
        self.checks = 0
        self.query_tokens = 0
        self.sampled = 0
        self.skipped = 0
        """(group, request, step) items left unchecked by the step rule (``max_step_keys``)."""
        self.checked_steps = 0
        self.max_error = 0.0
        self._true_kv: dict[tuple[int, int], _History] = {}
        self._seen: set[int] = set()

    def queries(self, plan: StepPlan) -> dict[tuple[int, int], np.ndarray]:
        """Which query tokens of each (group, write) the engine must compute: all of them,
        or a deterministic sample of a huge prefill chunk (``max_query_keys``); a (group,
        write) whose context exceeds ``max_step_keys`` only on some steps (``check_step``).
        Plan data only: every rank selects the same items."""
        out = {}
        finished = {v.req_index for v in plan.views if v.finished}
        for w in plan.writes:
            first, last = w.req_index not in self._seen, w.req_index in finished
            self._seen.add(w.req_index)
            for store, group in self.groups.items():
                keys = context_keys(group, w.start, w.stop)
                if not check_step(plan.step, keys, self.cfg.max_step_keys, first=first, last=last):
                    self.skipped += 1
                    continue
                out[(store, w.req_index)] = select_queries(w.stop - w.start, keys, self.cfg.max_query_keys)
        if out:
            self.checked_steps += 1
        return out

    # --- the reference --------------------------------------------------------------

    def _history(self, store: int, view, group: ExpectedGroup, lo: int, hi: int):
        """K ``[hi - lo, dk]`` and V ``[hi - lo, dv]`` of keys ``[lo, hi)`` (in one block this
        rank owns) holding the request's committed contents. Full attention and records read
        from key 0: cached per request (views); a window or chunk reads only its last keys:
        computed."""
        dk, m = self.cfg.head_dim, self._kv_heads(store)

        def vectors(a: int, b: int) -> np.ndarray:
            emit = emit_positions(group, np.arange(a, b, dtype=np.int64))
            return self._kv(store, view.fingerprints[emit])

        if group.retention in (Retention.WINDOW, Retention.CHUNK) and group.storage is not Storage.RECORDS:
            kv = torch.from_numpy(vectors(lo, hi))
            return kv[:, : m * dk], kv[:, m * dk :]
        key = (store, view.req_index)
        cache = self._true_kv.get(key)
        if cache is None:
            capacity = keys_before(group, len(view.fingerprints))
            cache = self._true_kv[key] = _History(capacity, m * dk, m * self.cfg.value_dim, self.rank, self.world, view.req_index)
        return cache.keys(lo, hi, vectors)

    def _kv_heads(self, store: int) -> int:
        """KV heads the reference reads in a group: those the gathered queries use, else 1."""
        heads = self.heads.get(store)
        return 1 if heads is None else len(np.unique(heads.kv_heads))

    def _kv(self, store: int, contents) -> np.ndarray:
        """K then V of entries with ``contents``: ``[n, dk + dv]`` for a group's single KV head;
        with KV heads, the K of each KV head the gathered queries use (ascending), then their Vs."""
        heads = self.heads.get(store)
        if heads is None:
            return kv_vectors(store, contents, self.cfg.kv_width)
        dk = self.cfg.head_dim
        kvs = [kv_vectors(store, contents, self.cfg.kv_width, int(h)) for h in np.unique(heads.kv_heads)]
        return np.concatenate([kv[:, :dk] for kv in kvs] + [kv[:, dk:] for kv in kvs], axis=1)

    def _partial_reference(self, res: AttentionResult, view) -> _Partial:
        """The problems of every head's attention (natural LSE) over the key blocks of the
        context this rank owns: block ``b`` (keys ``[b * KEY_BLOCK, (b + 1) * KEY_BLOCK)``)
        of request ``i`` belongs to rank ``(b + i) % W`` (``block_owner``). Solved for all
        of a step's results at once, the ranks' partials merged in ``_dense_references``."""
        w, cfg, dk = res.write, self.cfg, self.cfg.head_dim
        m = self._kv_heads(res.group)
        group = self.groups[res.group]
        positions = w.start + np.asarray(res.rows, dtype=np.int64)
        lo, hi = key_range(group, positions)
        split = min(max(keys_before(group, w.start), lo), hi)  # keys before it: committed before the step
        blocks = []
        for a, b, history in ((lo, split, True), (split, hi, False)):
            b0 = a
            while b0 < b:
                b1 = min((b0 // KEY_BLOCK + 1) * KEY_BLOCK, b)
                if block_owner(b0 // KEY_BLOCK, w.req_index, self.world) == self.rank:
                    if history:
                        k, v = self._history(res.group, view, group, b0, b1)
                    else:  # written by the step: what it wrote
                        emit = emit_positions(group, np.arange(b0, b1, dtype=np.int64))
                        kv = torch.from_numpy(self._kv(res.group, w.contents[emit - w.start]))
                        k, v = kv[:, : m * dk], kv[:, m * dk :]
                    mask = block_mask(group, b0, b1, positions)
                    blocks.append((k, v, None if mask is None else torch.from_numpy(mask)))
                b0 = b1
        heads = self.heads.get(res.group)
        H = cfg.heads if heads is None else len(heads.query_heads)
        if not blocks:  # this rank owns none of the context's keys
            return _Partial(len(positions), H, [])
        # the queries come from plan data (request, position, content), as the engine's do
        if heads is None:
            query = torch.from_numpy(query_vectors(res.group, w.req_index, positions, w.contents[res.rows], cfg.heads, dk))
            return _Partial(len(positions), H, [(None, (query, blocks))])
        every = torch.from_numpy(query_vectors(res.group, w.req_index, positions, w.contents[res.rows], heads.num_heads, dk))
        return _Partial(len(positions), H, kv_head_problems(every[:, heads.query_heads], heads.kv_heads, blocks, dk, cfg.value_dim))

    def _references(self, results: list[AttentionResult], views, selected: dict | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The reference ``(O, lse)`` of each result's heads: the ranks' partials over the
        blocks they own, all-gathered in one call and combined by their LSEs (float64); a
        sparse group's over its selected keys, whole on every rank (``verify.sparse``)."""
        sparse = {k: self.sparse.reference(results[k], views[results[k].write.req_index], sel) for k, sel in (selected or {}).items()}
        dense = [res for k, res in enumerate(results) if k not in sparse]
        merged = iter(self._dense_references(dense, views)) if dense else iter(())
        return [sparse[k] if k in sparse else next(merged) for k in range(len(results))]

    def _dense_references(self, results: list[AttentionResult], views) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's partials of every result, solved in few calls over the step
        (``reference_attention_many``), all-gathered in one call and merged by their LSEs in
        one call: each result's ``(O, lse)`` of its heads."""
        cfg = self.cfg
        parts = [self._partial_reference(res, views[res.write.req_index]) for res in results]
        solved = iter(reference_attention_many([p for part in parts for _, p in part.problems], scale=cfg.softmax_scale))
        pieces = [part.assemble(solved, cfg.value_dim) for part in parts]
        dv, rows = cfg.value_dim, sum(part.nq * part.heads for part in parts)
        flat = torch.cat([o.reshape(-1) for o, _ in pieces] + [lse.reshape(-1) for _, lse in pieces])
        gathered = torch.stack(self.coll.all_gather_tensor(flat))  # [W, rows * dv + rows]: every O, then every LSE
        o_all, l_all = merge_by_lse(gathered[:, : rows * dv].reshape(-1, rows, dv), gathered[:, rows * dv :], base=cfg.base)
        out, offset = [], 0
        for res, part in zip(results, parts):
            n = part.nq * part.heads
            o_ref = o_all[offset : offset + n].view(part.nq, part.heads, dv)
            total = l_all[offset : offset + n].view(part.nq, part.heads)
            offset += n
            out.append((o_ref[:, res.head0 : res.head1], total[:, res.head0 : res.head1]))
        return out

    # --- the verdict ----------------------------------------------------------------

    def judge(self, plan: StepPlan, results: list[AttentionResult]) -> Failure | None:
        padding = [r for r in results if r.write is None]  # --attention-padded-rows
        results = [r for r in results if r.write is not None]
        failure = self._judge(plan, results) if results else None
        if failure is None and padding:
            failure = self.judge_padding(plan, padding)
        return failure

    def judge_padding(self, plan: StepPlan, padding: list[AttentionResult]) -> Failure | None:
        """The padding rows of a padded decode step see no key on any rank: merged, each must
        be an output of exactly 0 with lse -inf (section 6's merge of rows empty everywhere).
        Every rank judges the heads it holds; one gather makes the verdict common."""
        mine = None
        for res in padding:
            out, lse = res.out.detach().cpu().numpy(), res.lse.detach().cpu().numpy()
            bad = ~(out == 0).all(axis=(1, 2)) | ~np.isneginf(lse).all(axis=1)
            if bad.any() and mine is None:
                j = int(np.nonzero(bad)[0][0])
                mine = (self.groups[res.group].name, j, len(res.rows), float(np.nanmax(np.abs(out[j]))) if out[j].size else 0.0,
                        str(lse[j].tolist()[:4]), bool(np.isnan(out[j]).any() or np.isnan(lse[j]).any()))  # fmt: skip
        self.checks += len(padding)
        verdicts = self.coll.all_gather_object(mine)
        found = next(((r, v) for r, v in enumerate(verdicts) if v is not None), None)
        if found is None:
            return None
        rank, (group, j, n, peak, lses, nan) = found
        return Failure(
            kind=FailureKind.ATTENTION_MISMATCH,
            step=plan.step,
            message=f"padding row {j} of {n} (a CUDA-graph padded decode step) merged to "
            + ("NaN" if nan else "a nonzero or finite state")
            + ": a row with no key on any rank must merge to 0 with lse -inf",
            group=group,
            details=[f"checked on rank {rank}: max |output| {peak:.6g}, lse of its first heads {lses}"],
        )

    def _judge(self, plan: StepPlan, results: list[AttentionResult]) -> Failure | None:
        views = {v.req_index: v for v in plan.views}
        selected = {}
        if self.sparse is not None:
            selected = {
                k: self.sparse.expected(res, views[res.write.req_index]) for k, res in enumerate(results) if self.sparse.is_sparse(res)
            }
            failure = self.sparse.agreement(plan, results, selected)
            if failure is not None:
                return failure
        references = self._references(results, views, selected)
        rows = np.zeros((len(results), 8), dtype=np.float64)
        for k, (res, (o_ref, l_ref)) in enumerate(zip(results, references)):
            rows[k, EMPTY_BAD:] = self._empty_shard_lse(res)
            if res.head1 <= res.head0:  # this rank holds no real head (more ranks than heads)
                rows[k, :EMPTY_BAD] = (0.0, -1, -1, math.nan, math.nan)
                continue
            err = state_error(res.out, res.lse, o_ref, l_ref)
            j, h = divmod(int(torch.argmax(err)), res.head1 - res.head0)
            rows[k, :EMPTY_BAD] = (float(err[j, h]), j, res.head0 + h, float(res.lse[j, h]), float(l_ref[j, h]))
        gathered = torch.stack(self.coll.all_gather_tensor(torch.from_numpy(rows))).numpy()  # [W, n, 8]
        errors = gathered[:, :, ERR]
        self.checks += len(results)
        self.query_tokens += sum(len(r.rows) for r in results)
        self.sampled += sum(len(r.rows) < r.write.stop - r.write.start for r in results)
        self.max_error = max(self.max_error, float(errors.max()))  # NaN was mapped to +inf
        worst = errors.max(axis=0)
        bad = np.nonzero(~(worst <= self.cfg.tolerance))[0]
        if len(bad):
            return self._failure(plan, results, gathered, int(bad[0]))
        return self._empty_shard_failure(plan, results, gathered)

    def _empty_shard_lse(self, res: AttentionResult) -> tuple[float, float, float]:
        """``(1, token, lse)`` of the first query token whose shard on this rank holds no key
        (the checker's own count) but whose reported LSE is not -inf (section 6: an empty
        shard reports -inf), else ``(0, -1, nan)``. A finite stand-in (FlashInfer's -5e4)
        weighs nothing beside a real shard's, so only this rule sees it."""
        group = self.groups[res.group]
        if not res.merged or not group.sharded:
            return 0.0, -1.0, math.nan
        positions = res.write.start + np.asarray(res.rows, dtype=np.int64)
        R = group.tokens_per_state if group.storage is Storage.RECORDS else 1
        empty = owned_below((positions + 1) // R, self.rank, group) == 0
        lse = res.shard_lse.detach().cpu().numpy() if torch.is_tensor(res.shard_lse) else np.asarray(res.shard_lse)
        wrong = empty & ~np.all(np.isneginf(lse), axis=1)
        if not wrong.any():
            return 0.0, -1.0, math.nan
        j = int(np.nonzero(wrong)[0][0])
        h = int(np.nonzero(~np.isneginf(lse[j]))[0][0])
        return 1.0, float(j * HEAD_CODE + h), float(lse[j, h])

    def _empty_shard_failure(self, plan: StepPlan, results: list[AttentionResult], gathered: np.ndarray) -> Failure | None:
        flagged = np.argwhere(gathered[:, :, EMPTY_BAD] > 0)  # (rank, item), rank-major
        if not len(flagged):
            return None
        k = int(flagged[:, 1].min())
        rank = int(flagged[flagged[:, 1] == k][0, 0])
        res, lse = results[k], float(gathered[rank, k, EMPTY_LSE])
        token, head = divmod(int(gathered[rank, k, EMPTY_TOKEN]), HEAD_CODE)
        position = res.write.start + int(res.rows[token])
        return Failure(
            kind=FailureKind.ATTENTION_MISMATCH,
            step=plan.step,
            message=f"rank {rank} reported lse {lse:.6g} for query position {position}, whose shard on that rank "
            "holds no key: an empty shard must report -inf (section 6)",
            group=self.groups[res.group].name,
            request_id=res.write.request_id,
            details=[
                f"query token {int(res.rows[token])} of {res.write.stop - res.write.start} "
                f"(positions {res.write.start}..{res.write.stop - 1}), base {self.cfg.base}",
                "the merged output matches the reference (a finite stand-in weighs ~0 beside a real shard), "
                "but a merge of shards that are all empty then returns a finite LSE",
            ],
            query_position=position,
            head=res.shard_head0 + head,
        )

    def _failure(self, plan: StepPlan, results: list[AttentionResult], gathered: np.ndarray, k: int) -> Failure:
        res = results[k]
        w = res.write
        who = int(np.argmax(gathered[:, k, ERR]))
        err, j, h, lse_got, lse_ref = gathered[who, k, :EMPTY_BAD]
        j, h = int(j), int(h)
        token = int(res.rows[j])
        mine = h - res.shard_head0
        contributions = self.coll.all_gather_object(
            dict(
                rank=self.rank,
                keys=int(res.visible[j]),
                lse=float(res.shard_lse[j, mine]) if 0 <= mine < res.shard_lse.shape[1] else None,
            )
        )
        position = w.start + token
        what = "merged across ranks" if res.merged else "computed on each rank (replicated: no merge)"
        details = [
            f"query token {token} of {w.stop - w.start} (positions {w.start}..{w.stop - 1}), head {h}, checked on rank {who}",
            f"lse: {lse_got:.6g} (engine, {what}) vs {lse_ref:.6g} (reference), base {self.cfg.base}",
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
        self._seen &= live


class _Partial:
    """A result's partial reference on this rank: ``nq`` query tokens, ``heads`` heads, and the
    problems ``(heads or None, (q, blocks))`` that give it (None: every head; none: this rank
    owns no key of the context, so every row is empty)."""

    def __init__(self, nq: int, heads: int, problems: list):
        self.nq, self.heads, self.problems = nq, heads, problems

    def assemble(self, solved, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(O [nq, heads, dv], lse [nq, heads])`` from the next solutions of ``solved``."""
        if len(self.problems) == 1 and self.problems[0][0] is None:
            return next(solved)
        out = torch.zeros((self.nq, self.heads, dv), dtype=torch.float64)
        lse = torch.full((self.nq, self.heads), float("-inf"), dtype=torch.float64)
        for which, _ in self.problems:
            out[:, which], lse[:, which] = next(solved)
        return out, lse


def kv_head_problems(query: torch.Tensor, kv_of: np.ndarray, blocks, dk: int, dv: int) -> list:
    """Problems ``(heads, (q, blocks))`` of query heads ``query [nq, n, dk]`` whose head ``i``
    reads KV head ``kv_of[i]``, over ``blocks`` of keys holding the K (then the V) of each KV
    head ``kv_of`` names, in ascending order: ``k [n_b, m * dk]``, ``v [n_b, m * dv]``. One
    problem per KV head: its query heads over its own columns."""
    out = []
    for j, head in enumerate(np.unique(kv_of)):
        which = torch.from_numpy(np.nonzero(kv_of == head)[0])
        sub = [(k[:, j * dk : (j + 1) * dk], v[:, j * dv : (j + 1) * dv], mask) for k, v, mask in blocks]
        out.append((which, (query[:, which], sub)))
    return out


def kv_head_reference(query: torch.Tensor, kv_of: np.ndarray, blocks, dk: int, dv: int, scale: float):
    """``blocked_reference_attention`` of query heads ``query [nq, n, dk]`` whose head ``i``
    reads KV head ``kv_of[i]`` (``kv_head_problems``). Natural LSE."""
    part = _Partial(query.shape[0], query.shape[1], kv_head_problems(query, kv_of, blocks, dk, dv))
    return part.assemble(iter(reference_attention_many([p for _, p in part.problems], scale=scale)), dv)


def block_owner(block: int, req_index: int, world: int) -> int:
    """The rank that computes key block ``block`` of request ``req_index``'s reference:
    ``(block + req_index) % W``. The blocks of a request go round-robin; its first block
    (all of a context below ``KEY_BLOCK`` keys) goes to rank ``req_index % W``, so that short
    requests spread over the ranks instead of all falling on rank 0."""
    return (block + req_index) % world


HISTORY_FLOAT64_BYTES = 1 << 28
"""A request's cached history (this rank's blocks) is kept in float64 (what the reference
computes in: no conversion per step) while it takes at most this (256 MiB: 1M keys of
16 + 16); beyond, in float32, converted block by block."""


class _History:
    """K (transposed, ``[dk, capacity]``) and V (``[capacity, dv]``) of the key blocks of a
    request's committed keys ``[0, n)`` that this rank owns (block ``b`` of ``KEY_BLOCK``
    keys: rank ``block_owner(b, request, W)``, stored as local block ``b // W``), filled on
    demand. The buffers hold the request's whole length but the OS maps pages only when
    filled, so only filled keys take memory; they double if ever outgrown. K is stored
    transposed so that a block of keys is the matmul's operand as it is (a view, no copy)."""

    def __init__(self, capacity: int, dk: int, dv: int, rank: int, world: int, req_index: int = 0):
        self.rank, self.world, self.req_index = rank, world, req_index
        blocks = -(-capacity // KEY_BLOCK)
        local = max(-(-blocks // world) * KEY_BLOCK, 1)  # this rank's share of the blocks
        self.dtype = np.float64 if local * (dk + dv) * 8 <= HISTORY_FLOAT64_BYTES else np.float32
        self.kt = np.empty((dk, local), dtype=self.dtype)
        self.v = np.empty((local, dv), dtype=self.dtype)
        self.n = 0

    def _local(self, key: int) -> int:
        block, offset = divmod(key, KEY_BLOCK)
        return block // self.world * KEY_BLOCK + offset

    def keys(self, lo: int, hi: int, vectors) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K [hi - lo, dk], V [hi - lo, dv])`` of keys ``[lo, hi)``, within one owned
        block; ``vectors(a, b)`` computes keys ``[a, b)``."""
        if hi > self.n:
            dk, a = self.kt.shape[0], self.n
            while a < hi:  # the owned blocks of the keys not yet filled, a block at a time
                b = min((a // KEY_BLOCK + 1) * KEY_BLOCK, hi)
                if block_owner(a // KEY_BLOCK, self.req_index, self.world) == self.rank:
                    at = self._local(a)
                    if at + b - a > self.v.shape[0]:
                        self._grow(max(at + b - a, 2 * self.v.shape[0]))
                    kv = vectors(a, b)
                    self.kt[:, at : at + b - a] = kv[:, :dk].T
                    self.v[at : at + b - a] = kv[:, dk:]
                a = b
            self.n = hi
        at = self._local(lo)
        return torch.from_numpy(self.kt[:, at : at + hi - lo]).t(), torch.from_numpy(self.v[at : at + hi - lo])

    def _grow(self, capacity: int) -> None:
        kt = np.empty((self.kt.shape[0], capacity), dtype=self.dtype)
        v = np.empty((capacity, self.v.shape[1]), dtype=self.dtype)
        kt[:, : self.v.shape[0]] = self.kt
        v[: self.v.shape[0]] = self.v
        self.kt, self.v = kt, v
