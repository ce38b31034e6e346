"""The scheduler tests' shared kit: the invariant auditor and the workloads they run.

Every plan of a run can go through ``Auditor``, an independent model written
from the semantics doc (section 5) and the scheduler's documented contract
(not from its code):

* block 0 never appears in a row except as a released (null) entry of a
  sliding-window / chunked-local group, and only for blocks wholly below the
  first still-needed position;
* a block is held by two live requests only in a full-attention group, at the
  same table index, over a common prefix (a prefix-cache hit), and is never
  written while shared;
* row lengths follow the manager block size (``B*W`` sharded, ``B``
  replicated, one block for a ring; a Mamba state: ``cdiv(reach, B) + k`` entries of which
  only the last ``1 + k`` must hold blocks), an attention row covering the drafter's
  lookahead past its furthest write too (``k`` slots for an EAGLE / MTP drafter, none for
  ngram, never past ``max_model_len``);
* each request is written contiguously from its committed length; prefill
  chunks and decode steps respect the token budget (and the per-request
  long_prefill_token_threshold); a decode step writes
  ``1 + drafts``; accepted drafts carry the true fingerprint, rejected ones
  differ and are rewritten later (with the true content);
* a logical KV model (manager block, offset) -> content, fed by the writes,
  holds the true content of every retained position of every live request
  after every step (so block reuse, prefix hits and releases are all safe);
* pool accounting: held blocks plus free blocks equal the pool.

The scheduler tests get it through the fixtures of ``tests/unit/engine/scheduler/conftest.py``:
``audit`` (run a scenario's whole schedule through it), ``auditor`` (the class, to feed
plans by hand), and the workloads ``mixed``, ``prefix_scenario`` and ``pressure``.
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.model.plan import EventKind, ScheduleEvent
from dcpsim.model.scenario import RequestSpec, Scenario
from dcpsim.model.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from support.helpers import chunked_spec as chunked
from support.helpers import full_rep_spec as full_rep
from support.helpers import make_scenario as scenario
from support.helpers import mla_spec as mla
from support.helpers import request_spec as R
from support.helpers import ring_spec as ring
from support.helpers import scheduler
from support.helpers import swa_spec as swa


def cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------- the auditor

EMPTY = -1  # never a fingerprint in practice (the checker's stores use the same sentinel)


class ReqState:
    def __init__(self, spec: RequestSpec, fp: np.ndarray):
        self.spec = spec
        self.fp = fp
        self.running = False
        self.finished = False
        self.committed = 0
        self.num_output = 0
        self.reach = 0  # furthest position + 1 written or hit since the last admission
        self.cursor = 0  # acceptance pattern cursor
        self.since_admission: dict[int, int] = {}  # position -> last content written
        self.last_content: dict[int, int] = {}  # over the whole life
        self.covered_by_hit: set[int] = set()
        self.max_committed_ever = 0
        self.hits: list[int] = []
        self.preemptions: list[tuple[int, str]] = []
        self.admissions = 0
        self.rewrites_after_rejection = 0
        self.writes_from_zero_after_preemption = 0

    @property
    def known(self):
        return self.spec.prompt_len + self.num_output


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


class Auditor:
    """Feed it every plan of a scheduler; it asserts the invariants as it goes."""

    def __init__(self, sched: Scheduler, true_geometries=None):
        """``true_geometries``: the reference geometries of the scenario's specs, when the
        scheduler was given others (an engine that derives wrong ones); the audit judges
        against these."""
        self.s = sched
        self.cfg = sched.config
        self.k = self.cfg.num_speculative_tokens
        self.lookahead = self.k if self.k and self.cfg.speculative_method in ("eagle", "mtp") else 0
        """Slots past a step's tokens its blocks cover (semantics section 5: the drafter's lookahead)."""
        self.geometries = true_geometries or sched.geometries
        assert len(self.geometries) == len(sched.geometries)
        W = self.cfg.decode_context_parallel_size
        # Manager block size from the doc, not from the layout object: B*W for a sharded
        # (non-replicated full-attention) group under DCP, B otherwise; a ring: one block.
        self.mbs = []
        for lay, used in zip(self.geometries, sched.geometries):
            spec = lay.spec
            sharded = isinstance(spec, FullAttentionSpec) and not spec.dcp_replicated and W > 1
            self.mbs.append(spec.block_size * (W if sharded else 1))
            for have in (lay, used):
                assert have.sharded == sharded, f"{have.name}: sharded={have.sharded}"
                assert have.manager_block_size == self.mbs[-1], have.name
        self.req = {r.index: ReqState(r.spec, r.fingerprints.copy()) for r in sched.requests}
        self.by_id = {st.spec.request_id: i for i, st in self.req.items()}
        # logical KV: [block id, offset inside the block-table entry] -> content (EMPTY: never)
        self.store = [np.full((m.pool.num_blocks + 1, self.span(g)), EMPTY, dtype=np.int64) for g, m in enumerate(sched.managers)]
        self.steps = 0
        self.events: list[ScheduleEvent] = []
        self.reused_seen = 0
        self.ever_held: list[dict[int, set[int]]] = [{} for _ in self.geometries]  # block -> holders
        self.state_col: list[dict[int, int]] = [{} for _ in self.geometries]  # Mamba: req -> committed state column

    # --- retention from the doc (section 4), written out here ---------------------
    def first_needed(self, g: int, n: int) -> int:
        spec = self.geometries[g].spec
        if isinstance(spec, CircularBufferSpec):
            return max(0, n - (spec.block_size - self.k))
        if isinstance(spec, SlidingWindowSpec):
            return max(0, n - spec.sliding_window + 1 - spec.extra_retained_tokens)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return (n // spec.attention_chunk_size) * spec.attention_chunk_size
        if isinstance(spec, MambaSpec):
            return max(0, n - 1)  # the state after the last committed token
        return 0

    def kind(self, g):
        spec = self.geometries[g].spec
        if isinstance(spec, CircularBufferSpec):
            return "ring"
        if isinstance(spec, MambaSpec):
            return "state"
        if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
            return "released"
        return "full"

    def span(self, g):
        """Positions one block-table entry stands for (ring: its capacity; a Mamba state: one state)."""
        if self.kind(g) == "state":
            return 1
        return self.geometries[g].spec.block_size if self.kind(g) == "ring" else self.mbs[g]

    def slots(self, g, row, positions: np.ndarray):
        """(block, offset) of each position: entry p // span (ring: its one block, p % C)."""
        row = np.asarray(row, dtype=np.int64)
        span = self.span(g)
        if self.kind(g) == "ring":
            return np.full(len(positions), row[0]), positions % span
        return row[positions // span], positions % span

    # --- row checks -----------------------------------------------------------------
    def check_rows(self, rows, when: str, step: int, committed_of) -> None:
        for g, table in enumerate(rows):
            holders: dict[int, list[tuple[int, int]]] = {}
            for ri, row in table.items():
                st = self.req[ri]
                where = f"step {step} {when} group {self.geometries[g].name} request {st.spec.request_id}"
                assert st.running, f"{where}: a request that is not running holds blocks"
                row = [int(b) for b in row]
                self.check_row_shape(g, row, st, where, when, committed_of(ri))
                assert len({b for b in row if b}) == len([b for b in row if b]), f"{where}: {row}"
                for j, b in enumerate(row):
                    if b:
                        holders.setdefault(b, []).append((ri, j))
                        self.ever_held[g].setdefault(b, set()).add(ri)
            self.check_sharing(g, holders, step)

    def check_row_shape(self, g, row, st: ReqState, where: str, when: str, committed: int) -> None:
        """One row's length and null entries for its group's retention kind (section 4)."""
        kind, mbs = self.kind(g), self.mbs[g]
        if kind == "ring":
            assert len(row) == 1 and row[0] != 0, f"{where}: ring row {row}"
        elif kind == "state":
            window = 1 + self.k
            assert len(row) == cdiv(st.reach, mbs) + self.k, (
                f"{where}: {len(row)} entries for {st.reach} tokens at {mbs} per entry + {self.k}"
            )
            assert 0 not in row[-window:], f"{where}: a state block of the window is null: {row}"
            if when == "after":  # released below the committed state
                first = self.first_needed(g, committed)
                assert all(b == 0 for j, b in enumerate(row) if (j + 1) * mbs <= first), (
                    f"{where}: {row} keeps a block below position {first}"
                )
        else:
            slots = max(st.reach, min(st.reach + self.lookahead, self.cfg.max_model_len))
            if self.cfg.kv_cache_layout == "helix":  # B * W tokens an entry, plus one spare (semantics section 15)
                spb = self.geometries[g].spec.block_size * self.cfg.decode_context_parallel_size
                assert len(row) == cdiv(slots, spb) + (1 if slots else 0), f"{where}: {len(row)} Helix entries for {slots} tokens"
                return
            assert len(row) == cdiv(slots, mbs), (
                f"{where}: {len(row)} entries for {st.reach} tokens + {slots - st.reach} lookahead at {mbs} per entry"
            )
        if kind == "released":
            first = self.first_needed(g, committed)
            for j, b in enumerate(row):
                below = (j + 1) * mbs <= first
                assert (b == 0) == below, f"{where}: entry {j} is {b} but the first needed position is {first}"
        elif kind == "full":
            assert 0 not in row, f"{where}: block 0 handed to a request: {row}"

    def check_sharing(self, g, holders: dict[int, list[tuple[int, int]]], step: int) -> None:
        """A block held by several requests: a full group's, at one index, under one prefix."""
        for b, hs in holders.items():
            if len(hs) == 1:
                continue
            name = self.geometries[g].name
            assert self.kind(g) == "full", f"step {step}: block {b} shared in non-full group {name}: {hs}"
            assert len({j for _, j in hs}) == 1, f"step {step}: block {b} at different indices {hs}"
            j = hs[0][1]
            end = (j + 1) * self.mbs[g] - 1
            fps = {int(self.req[ri].fp[end]) for ri, _ in hs}
            assert len(fps) == 1, f"step {step}: block {b} shared by requests with different prefixes"

    # --- one plan ------------------------------------------------------------------------
    def feed(self, plan) -> None:
        """One plan, in the order its phases happened: preemptions and admissions, the writes
        (rows before), the views, the rows after and what they retain, finishes, the pools."""
        step = plan.step
        assert step == self.steps
        self.steps += 1
        for c in plan.copies:  # a partial hit's copy-on-write runs before the step's writes
            self.store[c.group][c.dst, : c.tokens] = self.store[c.group][c.src, : c.tokens]
        self.events.extend(plan.events)
        self.apply_admissions(plan.events, step)
        self.check_budget(plan, step)
        views = {v.req_index: v for v in plan.views}
        left = self.cfg.max_num_batched_tokens
        for w in plan.writes:
            left -= self.feed_write(plan, w, views, left)
        self.check_views(views, step)
        self.check_rows(plan.rows_after, "after", step, lambda ri: self.req[ri].committed)
        self.check_retained(plan.rows_after, views, step)
        self.apply_finishes(plan.events)
        for st in self.req.values():
            if st.running:
                assert st.num_output < st.spec.output_len
        self.check_pools(step)
        assert plan.last == all(st.finished for st in self.req.values())

    def apply_admissions(self, events, step: int) -> None:
        for ev in events:
            if ev.kind is EventKind.PREEMPTED:
                st = self.req[self.by_id[ev.request_id]]
                assert st.running, ev
                st.running = False
                st.committed = 0
                st.reach = 0
                st.since_admission = {}
                st.preemptions.append((step, str(ev.reason)))
            elif ev.kind is EventKind.ADMITTED and not ev.loaded:
                st = self.req[self.by_id[ev.request_id]]
                assert not st.running and not st.finished, ev
                assert st.spec.arrival_step <= step, ev
                hit = ev.prefix_hit
                st.running = True
                st.admissions += 1
                st.committed = hit
                st.reach = hit
                st.hits.append(hit)
                st.covered_by_hit |= set(range(hit))
                if hit:
                    self.check_hit(st, hit, step)

    def check_budget(self, plan, step: int) -> None:
        """The step's tokens within the budget, one write a request, every running request
        scheduled unless the budget ran out; the rows before the writes."""
        budget = self.cfg.max_num_batched_tokens
        writes = plan.writes
        total = sum(len(w.contents) for w in writes)
        assert total <= budget, f"step {step}: {total} tokens scheduled, budget {budget}"
        written_ids = [w.req_index for w in writes]
        assert len(set(written_ids)) == len(written_ids)
        # Reach is known before the rows are checked: rows_before is after allocation.
        for w in writes:
            st = self.req[w.req_index]
            st.reach = max(st.reach, w.stop)
        before = {ri: st.committed for ri, st in self.req.items()}
        self.check_rows(plan.rows_before, "before", step, lambda ri: before[ri])
        for st in self.req.values():
            if st.running and self.req_index(st) not in written_ids:
                # a running request left out only when the budget ran out
                assert total == budget, f"step {step}: {st.spec.request_id} skipped with budget left"

    def feed_write(self, plan, w, views, left: int) -> int:
        """One request's write: its size, its contents and acceptance, what it rewrites, and
        the logical store. Returns the tokens it took from the budget."""
        st = self.req[w.req_index]
        where = f"step {plan.step} request {w.request_id}"
        assert st.running, f"{where}: writes while not running"
        assert w.start == st.committed, f"{where}: writes from {w.start}, committed {st.committed}"
        n = len(w.contents)
        assert n >= 1
        self.check_write_size(st, n, w.start, left, where)
        contents = np.asarray(w.contents)
        new_committed = self.check_contents(st, w, contents, views, where)
        self.record_positions(st, w, contents, where)
        if w.start == 0 and st.preemptions:
            st.writes_from_zero_after_preemption += 1
        st.committed = new_committed
        st.max_committed_ever = max(st.max_committed_ever, new_committed)
        if w.req_index in views:
            assert views[w.req_index].num_committed == new_committed, where
        self.write_store(plan.rows_before, w, contents, where)
        return n

    def check_write_size(self, st: ReqState, n: int, start: int, left: int, where: str) -> None:
        todo = st.known - start
        assert todo >= 1
        cap = min(left, self.cfg.long_prefill_token_threshold or left)  # 0: no per-request cap
        drafts = 0
        if todo == 1 and self.k:
            remaining = st.spec.output_len - st.num_output
            drafts = max(0, min(self.k, remaining - 1, cap - 1))
        assert n == min(todo + drafts, cap), f"{where}: {n} tokens, expected min({todo} + {drafts}, {cap})"
        if todo == 1:
            assert n == 1 + drafts, f"{where}: a decode step writes 1 + drafts tokens"

    def check_contents(self, st: ReqState, w, contents: np.ndarray, views, where: str) -> int:
        """A prefill chunk's true contents, or a decode step's true and accepted contents and
        its rejected drafts; returns the committed count after the write."""
        known, n = st.known, len(contents)
        true = st.fp[w.start : w.stop]
        if w.start + n < known:  # a prefill chunk
            assert np.array_equal(contents, true), f"{where}: prefill content"
            return w.start + n
        d = w.start + n - known
        assert 0 <= d <= self.k
        assert w.req_index in views, f"{where}: no view after its step"
        new_committed = views[w.req_index].num_committed
        accepted = new_committed - known
        assert 0 <= accepted <= d, f"{where}: accepted {accepted} of {d}"
        if d and st.spec.acceptance:
            pat = st.spec.acceptance
            assert accepted == min(pat[st.cursor % len(pat)], d), where
        if d:
            st.cursor += 1
        ok = known - w.start + accepted
        assert np.array_equal(contents[:ok], true[:ok]), f"{where}: true/accepted content"
        assert (contents[ok:] != true[ok:]).all(), f"{where}: a rejected draft has the true content"
        st.num_output += accepted + 1
        assert st.num_output <= st.spec.output_len
        return new_committed

    def record_positions(self, st: ReqState, w, contents: np.ndarray, where: str) -> None:
        """A position written again since the admission must follow a rejection, with new content."""
        for j, p in enumerate(range(w.start, w.stop)):
            c = int(contents[j])
            if p in st.since_admission:
                prev = st.since_admission[p]
                assert prev != int(st.fp[p]), f"{where}: position {p} rewritten without a rejection"
                assert c != prev, f"{where}: position {p} rewritten with the same content"
                st.rewrites_after_rejection += 1
            st.since_admission[p] = c
            st.last_content[p] = c

    def write_store(self, rows_before, w, contents: np.ndarray, where: str) -> None:
        """The logical store: written into blocks the request holds, never shared ones."""
        for g, table in enumerate(rows_before):
            if self.kind(g) == "state":
                self.write_states(g, table, w, contents, where)
                continue
            lo = w.start
            if self.kind(g) == "ring":  # a ring keeps the last C rows of a chunk
                lo = max(w.start, w.stop - self.span(g))
            positions = np.arange(lo, w.stop)
            blk, off = self.slots(g, table[w.req_index], positions)
            assert (blk != 0).all(), f"{where}: a position goes to the null block in group {g}"
            others = {int(b) for r, rr in table.items() if r != w.req_index for b in rr if b}
            shared = set(blk.tolist()) & others
            assert not shared, f"{where}: writes into blocks {shared} held by another request"
            self.store[g][blk, off] = contents[lo - w.start :]

    def check_views(self, views, step: int) -> None:
        """Views: exactly the running requests with committed > 0, with their contents."""
        running = {self.req_index(st) for st in self.req.values() if st.running and st.committed > 0}
        assert set(views) == running, f"step {step}: views {sorted(views)} vs running {sorted(running)}"
        for ri, v in views.items():
            assert v.num_committed == self.req[ri].committed
            assert np.array_equal(v.fingerprints, self.req[ri].fp)

    def check_retained(self, rows_after, views, step: int) -> None:
        """Every retained position of every live request holds its true content."""
        for ri in views:
            st = self.req[ri]
            n = st.committed
            for g, table in enumerate(rows_after):
                if self.kind(g) == "state":
                    col = self.state_col[g][ri]
                    got = self.store[g][table[ri][col], 0]
                    assert got == st.fp[n - 1], (
                        f"step {step} group {self.geometries[g].name} request {st.spec.request_id}: the "
                        f"state in column {col} holds {got}, want the state after position {n - 1}"
                    )
                    continue
                positions = np.arange(self.first_needed(g, n), n)
                blk, off = self.slots(g, table[ri], positions)
                got = self.store[g][blk, off]
                bad = np.nonzero(got != st.fp[positions])[0]
                if len(bad):
                    p = int(positions[bad[0]])
                    raise AssertionError(
                        f"step {step} group {self.geometries[g].name} request {st.spec.request_id} "
                        f"position {p}: logical store holds {int(got[bad[0]])}, want {int(st.fp[p])}"
                    )

    def apply_finishes(self, events) -> None:
        for ev in events:
            if ev.kind is EventKind.FINISHED:
                st = self.req[self.by_id[ev.request_id]]
                assert st.num_output == st.spec.output_len, ev
                assert st.committed == st.spec.prompt_len + st.spec.output_len - 1, ev
                st.running = False
                st.finished = True

    def check_pools(self, step: int) -> None:
        """Pool accounting after the step: held + free = all."""
        for g, m in enumerate(self.s.managers):
            held = {int(b) for row in m.blocks.values() for b in row if b}
            assert len(held) + m.pool.num_free == m.pool.num_blocks, (
                f"step {step} group {self.geometries[g].name}: {len(held)} held + {m.pool.num_free} free != {m.pool.num_blocks}"
            )

    def req_index(self, st):
        return self.by_id[st.spec.request_id]

    def write_states(self, g, table, w, contents, where) -> None:
        """Semantics section 4 (MambaSpec): a prefill chunk leaves the state after its last
        token in the window's first block; a decode step the state after its token ``j`` in
        the ``j``-th; the window starts at entry 0 (none) or at the last token's block (align)."""
        spec = self.geometries[g].spec
        row = np.asarray(table[w.req_index], dtype=np.int64)
        first = (w.stop - 1) // spec.block_size if spec.mamba_cache_mode == "align" else 0
        if w.stop - w.start - w.num_drafts > 1:
            cols, states = [first], [int(contents[-1])]
        else:
            cols, states = [first + j for j in range(len(contents))], [int(c) for c in contents]
        others = {int(b) for r, rr in table.items() if r != w.req_index for b in rr if b}
        for c, state in zip(cols, states):
            assert c < len(row) and row[c] != 0, f"{where}: state column {c} of {row.tolist()} holds no block"
            assert int(row[c]) not in others, f"{where}: state block {row[c]} held by another request"
            self.store[g][row[c], 0] = state
        # the committed state: the chunk's one state, or the one after a decode step's accepted end
        n = self.req[w.req_index].committed
        self.state_col[g][w.req_index] = cols[0] if len(cols) == 1 else first + (n - 1 - w.start)

    def check_hit(self, st: ReqState, hit: int, step: int) -> None:
        unit, match = math.lcm(*self.mbs), self.cfg.prefix_match_unit
        part = hit % unit  # a partial-block hit (semantics section 5): whole match units, inside one block
        assert not part or (match and part % match == 0 and part < min(self.mbs)), f"hit {hit} is not a whole number of {unit}-token units"
        assert hit < st.known, "a hit must leave at least one token to compute"
        best = st.max_committed_ever  # its own earlier incarnation (before a preemption)
        for other in self.req.values():
            if other is not st:
                best = max(best, min(common_prefix(st.fp, other.fp), other.max_committed_ever))
        assert hit <= best, f"step {step}: hit {hit} exceeds the true common prefix {best}"

    def finish(self) -> None:
        for st in self.req.values():
            rid = st.spec.request_id
            assert st.finished, f"{rid} never finished"
            final = st.spec.prompt_len + st.spec.output_len - 1
            written = set(st.last_content)
            assert max(written | st.covered_by_hit) == final - 1, rid
            assert written | st.covered_by_hit == set(range(final)), f"{rid}: coverage"
            for p, c in st.last_content.items():
                assert c == int(st.fp[p]), f"{rid}: position {p} ends with a non-true content"


def audit(sc: Scenario, engine=None) -> tuple[Scheduler, Auditor]:
    """Run ``sc``'s schedule (the reference engine's, or ``engine``'s) through the auditor."""
    sched = scheduler(sc, engine)
    aud = Auditor(sched)
    for plan in sched.plans():
        aud.feed(plan)
    aud.finish()
    return sched, aud


# ----------------------------------------------------------------------------- scenarios


def mixed(W=2, I=2, **kw):
    """Every kind of group at once: sharded MLA, replicated full, window, chunk, ring."""
    layers = {
        "mla.0": mla(16),
        "mla.1": mla(16),
        "rep.0": full_rep(16),
        "swa.0": swa(8, window=20),
        "swa.1": swa(8, window=20),
        "chunk.0": chunked(8, 24),
        "ring.0": ring(8),
    }
    reqs = [
        R("a", 70, 30, acceptance=(3, 0, 1, 2)),
        R("b", 45, 25, arrival_step=1, acceptance=(0, 0, 3)),
        R("c", 120, 12, arrival_step=2, preempt_at_steps=(6,)),
        R("d", 9, 40, arrival_step=3),
    ]
    kw.setdefault("k", 3)
    kw.setdefault("budget", 40)
    return scenario(layers, reqs, W=W, I=I, **kw)


def prefix_scenario(W=2, B=64, extra_layers=None, **kw):
    """dsv3-like: a 520-token shared system prompt, the second request arrives later."""
    layers = {"mla.0": mla(B), **(extra_layers or {})}
    reqs = [
        R("first", 600, 10, prefix="system", shared_prefix_len=520),
        R("second", 600, 10, prefix="system", shared_prefix_len=520, arrival_step=6),
        R("other", 300, 5, arrival_step=6),
    ]
    kw.setdefault("budget", 256)
    return scenario(layers, reqs, W=W, **kw)


def pressure(W=2, num_gpu_blocks=9, **kw):
    """Two long decoders that cannot both grow: one is preempted for blocks."""
    layers = {"mla.0": mla(16)}
    reqs = [R("x", 60, 120, acceptance=(2, 1)), R("y", 60, 120, acceptance=(0, 3)), R("z", 40, 10, arrival_step=2)]
    return scenario(layers, reqs, W=W, k=3, budget=64, num_gpu_blocks=num_gpu_blocks, **kw)


# ----------------------------------------------------------------------------- fixtures
