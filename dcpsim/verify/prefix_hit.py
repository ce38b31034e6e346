"""The checker's judgement of prefix-cache hit lengths: no admission may take a shorter hit than
the cache allows (failure ``prefix-hit-short``, a lost hit, not wrong data).

From the plans alone (the block tables of every step and each request's true fingerprints) the
checker keeps, per block id, which prefix each group's block holds whole: a request that has
committed every position of its ``k``-th block of a group (``span`` tokens: the group's manager
block size, ``B * W`` sharded) leaves in it the prefix ending at position ``(k + 1) * span - 1``,
keyed by that position's fingerprint (fingerprints chain the whole prefix). The block keeps it
after its holder finishes or is preempted, until the id is handed out again (vLLM's one block pool
evicts it there): it turns up in any group's table at an index that is to hold other content, or
as a fresh entry of a row (one the request's row did not have at that index the step before, and
not among the blocks an admission's hit reuses), even one its new holder fills with the same
content (two requests computing one prefix: the block is rewritten, not found). The write checks
have judged that the stores hold exactly that content, so nothing here reads the stores again.

Only the blocks of a holder's whole hit units count (the LCM ``U`` of the spans: what every engine
registers at least, a unit once its every position is committed), so a group of a smaller span
keeps the blocks of a unit past the prefix another request shares with it, and those a limit cuts.

When a request is admitted at step ``s`` (not loaded by a KV connector), the blocks findable for
it are those keyed before the step, less those handed out in the step (its tables). Each group's
cached run is its leading blocks of the request's prompt found so, at most ``limit // span`` of
them (``limit``: the request's known tokens less one, taken as its prompt, or what it had
committed before a preemption), in whole blocks (not rounded to ``U`` before the drop: rounding
there would hide a drop in the wrong group). With an EAGLE / MTP drafter each EAGLE group (one
holding a layer of the draft model, ``SimConfig.draft_layers``; every group when none does) then
gives up its last block; the other groups keep theirs. The longest hit the semantics allow is the
shortest run, rounded down to ``U``: a hit below it is ``prefix-hit-short``. This is a lower bound:
an engine may find more (vLLM registers blocks when they are scheduled; with lookahead-aware block
hashes, vllm#50897, an EAGLE hit needs no drop), never less.

The drafter's lookahead (semantics section 5: an EAGLE / MTP step's rows cover ``k`` slots past its
tokens) needs nothing of its own here: those entries are fresh entries of the rows like any other,
so a cached block handed out as one is gone from that step on, and they never hold a prefix (no
position of theirs is committed when they are taken; once one is, the block counts as any other).

Judged only where every group keeps full prefixes (full attention and MLA, paged or records), with
prefix caching on, one PCP rank and no async scheduling (whose registration lags a step). A block
id handed out in one group counts as evicted in every group (vLLM's one pool) until a step's tables
hold one id in two groups at once, which only pools of their own per group allow (dcpsim's); from
then on an id handed out in a group is gone from that group only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcpsim.model.plan import EventKind, StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.kv_events import prefix_cacheable

MAX_KEPT = 20


@dataclass(frozen=True)
class HitShort:
    rank: int
    step: int
    request_id: str
    hit: int
    longest: int
    cached: tuple[int, ...]
    """Tokens of each group's cached run (whole blocks of whole units, before the EAGLE drop)."""
    eagle: tuple[bool, ...]
    """Which groups give up their last block for the EAGLE drafter."""

    unit: int = 0

    def __str__(self) -> str:
        runs = ", ".join(str(t) for t in self.cached)
        drop = ""
        if all(self.eagle):
            drop = ", less its last block for the EAGLE drafter"
        elif any(self.eagle):
            which = ", ".join(str(g) for g, e in enumerate(self.eagle) if e)
            drop = f", less its last block in the EAGLE groups (group {which}: the drafter's layers) only"
        return (
            f"step {self.step} request {self.request_id}: a prefix-cache hit of {self.hit} tokens where the cache allows "
            f"{self.longest} (each group's cached run: {runs} tokens{drop}; hits in units of {self.unit}): "
            f"{self.longest - self.hit} tokens recomputed"
        )


class PrefixHitJudge:
    """Judges every admission's prefix-cache hit against the cache's content (rank 0 only: the
    plans are every rank's)."""

    def __init__(self, rank: int, groups: list[ExpectedGroup], eagle: bool, prompt_lens: dict[str, int]):
        self.rank = rank
        self.spans = [g.manager_block_size for g in groups]
        self.unit = math.lcm(*self.spans)
        drafts = [g.draft for g in groups]
        self.eagle = tuple(eagle and (d or not any(drafts)) for d in drafts)
        """Which groups drop their last block: with an EAGLE / MTP drafter, those holding a draft
        layer, or every group when none does."""
        self.prompt_lens = prompt_lens
        self.held = np.zeros((len(groups), 0), dtype=bool)
        """[group, block id]: whether the group's block holds a prefix whole."""
        self.keys = np.zeros((len(groups), 0), dtype=np.int64)
        """[group, block id]: the fingerprint keying that prefix (where ``held``)."""
        self.shared_pool = True
        """Whether the groups may share one pool of block ids (vLLM's): until one step's tables
        hold an id in two groups at once, a block handed out in one group is gone from all."""
        self.rows: dict[tuple[int, int], np.ndarray] = {}
        """(group, request index) -> the request's row the step before (to tell fresh entries)."""
        self.committed: dict[str, int] = {}
        """Each request's committed length at its last view (the limit of a re-admission)."""
        self.count = 0
        self.checks = 0
        """Admissions whose hit was judged."""
        self.kept: list[HitShort] = []

    def _keys(self, fingerprints: np.ndarray, g: int, n: int) -> tuple[np.ndarray, int]:
        """The keys of blocks ``0 .. n - 1`` of group ``g`` (the fingerprint of each block's last
        position), in one slice, and how many of them exist (a block past the request's last
        position, a drafter's lookahead, has none)."""
        span = self.spans[g]
        keys = np.asarray(fingerprints[span - 1 : n * span : span], dtype=np.int64)
        have = len(keys)
        return (keys if have == n else np.concatenate([keys, np.zeros(n - have, np.int64)])), have

    def key(self, fingerprints: np.ndarray, g: int, k: int) -> int | None:
        """The key of block ``k`` of group ``g`` of a request (None past its last position)."""
        end = (k + 1) * self.spans[g]
        return int(fingerprints[end - 1]) if end <= len(fingerprints) else None

    def hold(self, block: int, g: int, key: int) -> None:
        """Group ``g``'s block ``block`` now keeps the prefix keyed ``key``."""
        self._grow([np.array([block])])
        self.held[g, block], self.keys[g, block] = True, key

    def held_keys(self, g: int) -> set[int]:
        """The keys of the prefixes group ``g``'s blocks keep."""
        return set(self.keys[g, self.held[g]].tolist())

    def _grow(self, rows) -> None:
        """Room in ``held`` and ``keys`` for every block id in ``rows``."""
        every = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        top = int(every.max()) + 1 if len(every) else 0
        if top > self.held.shape[1]:
            size = max(top, 2 * self.held.shape[1])
            pad = size - self.held.shape[1]
            self.held = np.pad(self.held, ((0, 0), (0, pad)))
            self.keys = np.pad(self.keys, ((0, 0), (0, pad)))

    def judge(self, plan: StepPlan) -> None:
        if self.rank != 0:  # every rank's plans are the same: the others would repeat rank 0's bookkeeping
            return
        views = {v.req_index: v for v in plan.views}
        self._hand_out(plan, views)
        by_id = {v.request_id: v for v in plan.views}
        for e in plan.events:
            if e.kind is EventKind.ADMITTED and not e.loaded and e.request_id in by_id:
                self._judge_admission(plan, e.request_id, e.prefix_hit, by_id[e.request_id].fingerprints)
        self._commit(plan, views)

    def _hand_out(self, plan: StepPlan, views) -> None:
        """Blocks the step's tables place at an index to hold other content than they keep:
        handed out again, so their prefixes are gone (in every group while the pool may be
        shared, else in that group).

        Each entry is judged against the holds as the step found them, and the prefixes gone are
        dropped once, after: an entry's verdict cannot depend on another's in the same step (a
        prefix dropped earlier in the step is dropped again, or stays dropped)."""
        if self.shared_pool and len(plan.rows_before) > 1:
            self.shared_pool = not _some_id_in_two(plan.rows_before)
        hits = {e.request_id: e.prefix_hit for e in plan.events if e.kind is EventKind.ADMITTED}
        before, self.rows = self.rows, {}
        rows_of = [{ri: np.asarray(row, dtype=np.int64) for ri, row in rows.items()} for rows in plan.rows_before]
        self._grow([row for rows in rows_of for row in rows.values()])
        any_held = self.held.any(axis=0)
        for g, rows in enumerate(rows_of):  # one pass over the group's entries, its rows concatenated
            span = self.spans[g]
            ids, fresh, keys, no_key = [], [], [], []
            at = 0
            for ri, row in rows.items():
                self.rows[(g, ri)] = row
                view = views.get(ri)
                n = len(row)
                if view is None or not n:
                    continue
                last = None if view.request_id in hits else before.get((g, ri))
                fresh.append(_changed(row, last))
                first = hits.get(view.request_id, 0) // span  # the hit's blocks: found, not handed out
                if first:
                    fresh[-1][:first] = False
                k, have = self._keys(view.fingerprints, g, n)
                if have < n:  # a drafter's lookahead past the request's last position: no prefix there
                    no_key.append(np.arange(at + have, at + n))
                ids.append(row)
                keys.append(k)
                at += n
            if not ids:
                continue
            ids, fresh, keys = np.concatenate(ids), np.concatenate(fresh), np.concatenate(keys)
            other = ~self.held[g, ids] | (self.keys[g, ids] != keys)
            if no_key:
                other[np.concatenate(no_key)] = True
            gone = ids[(ids != 0) & any_held[ids] & (fresh | other)]
            if len(gone):
                gone_from = self.held if self.shared_pool else self.held[g]
                gone_from[..., gone] = False

    def _commit(self, plan: StepPlan, views) -> None:
        """The blocks whose every position their holder has committed now keep its prefix."""
        unit = self.unit
        for g, rows in enumerate(plan.rows_before):
            span = self.spans[g]
            blocks, keys = [], []
            for ri in rows:
                view = views.get(ri)
                if view is None:
                    continue
                whole = view.num_committed // unit * unit  # whole units only: what is registered
                row, fingerprints = self.rows[(g, ri)], view.fingerprints
                n = min(whole // span, len(row), len(fingerprints) // span)  # committed positions have a fingerprint
                blocks.append(row[:n])
                keys.append(self._keys(fingerprints, g, n)[0])
            if blocks:
                blocks, keys = np.concatenate(blocks), np.concatenate(keys)
                taken = blocks != 0
                self.held[g, blocks[taken]] = True
                self.keys[g, blocks[taken]] = keys[taken]
        self.committed.update((v.request_id, v.num_committed) for v in plan.views)

    def longest_hit(self, fingerprints: np.ndarray, limit: int) -> tuple[int, tuple[int, ...]]:
        """The longest hit the cache allows a prompt of ``fingerprints`` within ``limit``
        tokens, and each group's cached run (tokens, whole blocks)."""
        runs = []
        for g, span in enumerate(self.spans):
            keys, have = self._keys(fingerprints, g, max(0, limit // span))
            found = np.isin(keys[:have], self.keys[g, self.held[g]])
            n = int(np.argmin(found)) if not found.all() else have
            runs.append(n * span)
        kept = [max(0, t - span) if drop and t else t for t, span, drop in zip(runs, self.spans, self.eagle)]
        return min(kept) // self.unit * self.unit if kept else 0, tuple(runs)

    def _judge_admission(self, plan: StepPlan, request_id: str, hit: int, fingerprints: np.ndarray) -> None:
        limit = max(self.prompt_lens.get(request_id, 0), self.committed.get(request_id, 0)) - 1
        self.checks += 1
        longest, runs = self.longest_hit(fingerprints, limit)
        if hit < longest:
            self.count += 1
            if len(self.kept) < MAX_KEPT:
                self.kept.append(HitShort(self.rank, plan.step, request_id, hit, longest, runs, self.eagle, self.unit))


def _changed(row: np.ndarray, last: np.ndarray | None) -> np.ndarray:
    """Which entries of ``row`` the request's row did not hold at that index the step before
    (``last``; None: a row of its own now, every entry new)."""
    if last is None:
        return np.ones(len(row), dtype=bool)
    if len(last) == len(row):
        return row != last
    same = min(len(row), len(last))
    return np.concatenate([row[:same] != last[:same], np.ones(len(row) - same, dtype=bool)])


def _some_id_in_two(rows_before: list[dict]) -> bool:
    """Whether some nonzero block id is in the rows of two groups at once."""
    seen = []
    for rows in rows_before:
        ids = np.unique(np.concatenate([np.asarray(row, dtype=np.int64) for row in rows.values()])) if rows else np.zeros(0, np.int64)
        seen.append(ids[ids != 0])
    every = np.concatenate(seen)
    return len(np.unique(every)) < len(every)


def hits_judged(groups: list[ExpectedGroup], config) -> bool:
    """Whether the run's hits can be judged (the module's conditions)."""
    return (
        bool(groups)
        and config is not None
        and config.enable_prefix_caching
        and prefix_cacheable(groups)
        and config.prefill_context_parallel_size == 1
        and not config.async_scheduling
    )
