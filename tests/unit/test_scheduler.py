"""The deterministic scheduler, audited step by step against the semantics doc (section 5).

Every plan of a run goes through ``Auditor``, an independent model written
from the doc and the scheduler's documented contract (not from its code):

* block 0 never appears in a row except as a released (null) entry of a
  sliding-window / chunked-local group, and only for blocks wholly below the
  first still-needed position;
* a block is held by two live requests only in a full-attention group, at the
  same table index, over a common prefix (a prefix-cache hit), and is never
  written while shared;
* row lengths follow the manager block size (``B*W`` sharded, ``B``
  replicated, one block for a ring);
* each request is written contiguously from its committed length; prefill
  chunks and decode steps respect the token budget; a decode step writes
  ``1 + drafts``; accepted drafts carry the true fingerprint, rejected ones
  differ and are rewritten later (with the true content);
* a logical KV model (manager block, offset) -> content, fed by the writes,
  holds the true content of every retained position of every live request
  after every step (so block reuse, prefix hits and releases are all safe);
* pool accounting: held blocks plus free blocks equal the pool.

Expected numbers in the targeted tests are worked out by hand in comments.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from dcpsim.config import SimConfig
from dcpsim.errors import ConfigError
from dcpsim.scenario import RequestSpec, Scenario
from dcpsim.registry import builtin_scenario_names
from dcpsim.scenario_file import load_scenario
from dcpsim.scheduler.block_pool import BlockPool
from dcpsim.scheduler.scheduler import Scheduler
from dcpsim.simulation import build_layouts
from dcpsim.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

# ----------------------------------------------------------------------------- spec helpers


def mla(B=16, **kw):
    return MLAAttentionSpec(block_size=B, head_size=64, **kw)


def full_rep(B=16):
    return FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dcp_replicated=True)


def swa(B=8, window=20, extra=0, rep=True):
    return SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=8, sliding_window=window,
                             extra_retained_tokens=extra, dcp_replicated=rep)


def chunked(B=8, size=24, rep=True):
    return ChunkedLocalAttentionSpec(block_size=B, num_kv_heads=1, head_size=8,
                                     attention_chunk_size=size, dcp_replicated=rep)


def ring(C=8):
    return CircularBufferSpec(block_size=C, num_kv_heads=1, head_size=8, dcp_replicated=True)


def scenario(layers, requests, *, W=1, I=1, k=0, budget=64, max_len=2048, prefix=True,
             num_gpu_blocks=None, kv_cache_tokens=None, seed=0, name="t", max_steps=10_000):
    cfg = SimConfig(max_model_len=max_len, max_num_batched_tokens=budget,
                    decode_context_parallel_size=W, cp_kv_cache_interleave_size=I,
                    num_speculative_tokens=k, enable_prefix_caching=prefix)
    return Scenario(name=name, layers=dict(layers), config=cfg, requests=tuple(requests),
                    num_gpu_blocks=num_gpu_blocks, kv_cache_tokens=kv_cache_tokens, seed=seed,
                    max_steps=max_steps)


def R(rid, P, O, **kw):
    return RequestSpec(request_id=rid, prompt_len=P, output_len=O, **kw)


def cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------- the auditor

EMPTY = -1  # never a fingerprint in practice (the checker's stores use the same sentinel)
_ADMIT = re.compile(r"^admitted (\S+)(?: with a prefix-cache hit of (\d+) tokens)?$")
_PREEMPT = re.compile(r"^preempted (\S+) \((.*)\)$")
_FINISH = re.compile(r"^finished (\S+)$")


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

    def __init__(self, sched: Scheduler, true_layouts=None):
        """``true_layouts``: the layouts built from the scenario's specs, when the scheduler was
        given others (a fault that derives wrong ones); the audit judges against these."""
        self.s = sched
        self.cfg = sched.config
        self.k = self.cfg.num_speculative_tokens
        self.layouts = true_layouts or sched.layouts
        assert len(self.layouts) == len(sched.layouts)
        W = self.cfg.decode_context_parallel_size
        # Manager block size from the doc, not from the layout object: B*W for a sharded
        # (non-replicated full-attention) group under DCP, B otherwise; a ring: one block.
        self.mbs = []
        for lay, used in zip(self.layouts, sched.layouts):
            spec = lay.spec
            sharded = (isinstance(spec, FullAttentionSpec) and not spec.dcp_replicated and W > 1)
            self.mbs.append(spec.block_size * (W if sharded else 1))
            for have in (lay, used):
                assert have.sharded == sharded, f"{have.name}: sharded={have.sharded}"
                assert have.manager_block_size == self.mbs[-1], have.name
        self.req = {r.index: ReqState(r.spec, r.fingerprints.copy()) for r in sched.requests}
        self.by_id = {st.spec.request_id: i for i, st in self.req.items()}
        # logical KV: [block id, offset inside the block-table entry] -> content (EMPTY: never)
        self.store = [
            np.full((m.pool.num_blocks + 1, self.span(g)), EMPTY, dtype=np.int64)
            for g, m in enumerate(sched.managers)
        ]
        self.steps = 0
        self.events: list[str] = []
        self.reused_seen = 0
        self.ever_held: list[dict[int, set[int]]] = [{} for _ in self.layouts]  # block -> holders

    # --- retention from the doc (section 4), written out here ---------------------
    def first_needed(self, g: int, n: int) -> int:
        spec = self.layouts[g].spec
        if isinstance(spec, CircularBufferSpec):
            return max(0, n - (spec.block_size - self.k))
        if isinstance(spec, SlidingWindowSpec):
            return max(0, n - spec.sliding_window + 1 - spec.extra_retained_tokens)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return (n // spec.attention_chunk_size) * spec.attention_chunk_size
        return 0

    def kind(self, g):
        spec = self.layouts[g].spec
        if isinstance(spec, CircularBufferSpec):
            return "ring"
        if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
            return "released"
        return "full"

    def span(self, g):
        """Positions one block-table entry stands for (ring: its capacity)."""
        return self.layouts[g].spec.block_size if self.kind(g) == "ring" else self.mbs[g]

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
            kind, mbs = self.kind(g), self.mbs[g]
            holders: dict[int, list[tuple[int, int]]] = {}
            for ri, row in table.items():
                st = self.req[ri]
                where = f"step {step} {when} group {self.layouts[g].name} request {st.spec.request_id}"
                assert st.running, f"{where}: a request that is not running holds blocks"
                row = [int(b) for b in row]
                if kind == "ring":
                    assert len(row) == 1 and row[0] != 0, f"{where}: ring row {row}"
                else:
                    assert len(row) == cdiv(st.reach, mbs), (
                        f"{where}: {len(row)} entries for {st.reach} tokens at {mbs} per entry")
                if kind == "released":
                    first = self.first_needed(g, committed_of(ri))
                    for j, b in enumerate(row):
                        below = (j + 1) * mbs <= first
                        assert (b == 0) == below, (
                            f"{where}: entry {j} is {b} but the first needed position is {first}")
                else:
                    assert 0 not in row, f"{where}: block 0 handed to a request: {row}"
                assert len({b for b in row if b}) == len([b for b in row if b]), f"{where}: {row}"
                for j, b in enumerate(row):
                    if b:
                        holders.setdefault(b, []).append((ri, j))
                        self.ever_held[g].setdefault(b, set()).add(ri)
            for b, hs in holders.items():
                if len(hs) == 1:
                    continue
                name = self.layouts[g].name
                assert kind == "full", f"step {step}: block {b} shared in non-full group {name}: {hs}"
                assert len({j for _, j in hs}) == 1, f"step {step}: block {b} at different indices {hs}"
                j = hs[0][1]
                end = (j + 1) * mbs - 1
                fps = {int(self.req[ri].fp[end]) for ri, _ in hs}
                assert len(fps) == 1, f"step {step}: block {b} shared by requests with different prefixes"

    # --- one plan ------------------------------------------------------------------------
    def feed(self, plan) -> None:
        step = plan.step
        assert step == self.steps
        self.steps += 1
        self.events.extend(plan.events)
        budget = self.cfg.max_num_batched_tokens
        for ev in plan.events:
            if m := _PREEMPT.match(ev):
                st = self.req[self.by_id[m.group(1)]]
                assert st.running, ev
                st.running = False
                st.committed = 0
                st.reach = 0
                st.since_admission = {}
                st.preemptions.append((step, m.group(2)))
            elif m := _ADMIT.match(ev):
                st = self.req[self.by_id[m.group(1)]]
                assert not st.running and not st.finished, ev
                assert st.spec.arrival_step <= step, ev
                hit = int(m.group(2) or 0)
                st.running = True
                st.admissions += 1
                st.committed = hit
                st.reach = hit
                st.hits.append(hit)
                st.covered_by_hit |= set(range(hit))
                if hit:
                    self.check_hit(st, hit, step)
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
        views = {v.req_index: v for v in plan.views}
        left = budget
        for w in writes:
            st = self.req[w.req_index]
            where = f"step {step} request {w.request_id}"
            assert st.running, f"{where}: writes while not running"
            assert w.start == st.committed, f"{where}: writes from {w.start}, committed {st.committed}"
            n = len(w.contents)
            assert n >= 1
            known = st.known
            todo = known - w.start
            assert todo >= 1
            drafts = 0
            if todo == 1 and self.k:
                remaining = st.spec.output_len - st.num_output
                drafts = max(0, min(self.k, remaining - 1, left - 1))
            assert n == min(todo + drafts, left), (
                f"{where}: {n} tokens, expected min({todo} + {drafts}, {left})")
            if todo == 1:
                assert n == 1 + drafts, f"{where}: a decode step writes 1 + drafts tokens"
            left -= n
            contents = np.asarray(w.contents)
            true = st.fp[w.start:w.stop]
            if w.start + n < known:  # a prefill chunk
                assert np.array_equal(contents, true), f"{where}: prefill content"
                new_committed = w.start + n
                accepted, d = 0, 0
            else:
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
            for j, p in enumerate(range(w.start, w.stop)):
                c = int(contents[j])
                if p in st.since_admission:
                    prev = st.since_admission[p]
                    assert prev != int(st.fp[p]), f"{where}: position {p} rewritten without a rejection"
                    assert c != prev, f"{where}: position {p} rewritten with the same content"
                    st.rewrites_after_rejection += 1
                st.since_admission[p] = c
                st.last_content[p] = c
            if w.start == 0 and st.preemptions:
                st.writes_from_zero_after_preemption += 1
            st.committed = new_committed
            st.max_committed_ever = max(st.max_committed_ever, new_committed)
            if w.req_index in views:
                assert views[w.req_index].num_committed == new_committed, where
            # the logical store: written into blocks the request holds, never shared ones
            for g, table in enumerate(plan.rows_before):
                lo = w.start
                if self.kind(g) == "ring":  # a ring keeps the last C rows of a chunk
                    lo = max(w.start, w.stop - self.span(g))
                positions = np.arange(lo, w.stop)
                blk, off = self.slots(g, table[w.req_index], positions)
                assert (blk != 0).all(), f"{where}: a position goes to the null block in group {g}"
                others = {int(b) for r, rr in table.items() if r != w.req_index for b in rr if b}
                shared = set(blk.tolist()) & others
                assert not shared, f"{where}: writes into blocks {shared} held by another request"
                self.store[g][blk, off] = contents[lo - w.start:]
        # views: exactly the running requests with committed > 0
        running = {self.req_index(st) for st in self.req.values() if st.running and st.committed > 0}
        assert set(views) == running, f"step {step}: views {sorted(views)} vs running {sorted(running)}"
        for ri, v in views.items():
            assert v.num_committed == self.req[ri].committed
            assert np.array_equal(v.fingerprints, self.req[ri].fp)
        self.check_rows(plan.rows_after, "after", step, lambda ri: self.req[ri].committed)
        # every retained position of every live request holds its true content
        for ri in views:
            st = self.req[ri]
            n = st.committed
            for g, table in enumerate(plan.rows_after):
                positions = np.arange(self.first_needed(g, n), n)
                blk, off = self.slots(g, table[ri], positions)
                got = self.store[g][blk, off]
                bad = np.nonzero(got != st.fp[positions])[0]
                if len(bad):
                    p = int(positions[bad[0]])
                    raise AssertionError(
                        f"step {step} group {self.layouts[g].name} request {st.spec.request_id} "
                        f"position {p}: logical store holds {int(got[bad[0]])}, want {int(st.fp[p])}")
        for ev in plan.events:
            if m := _FINISH.match(ev):
                st = self.req[self.by_id[m.group(1)]]
                assert st.num_output == st.spec.output_len, ev
                assert st.committed == st.spec.prompt_len + st.spec.output_len - 1, ev
                st.running = False
                st.finished = True
        for st in self.req.values():
            if st.running:
                assert st.num_output < st.spec.output_len
        # pool accounting after the step
        for g, m in enumerate(self.s.managers):
            held = {int(b) for row in m.blocks.values() for b in row if b}
            assert len(held) + m.pool.num_free == m.pool.num_blocks, (
                f"step {step} group {self.layouts[g].name}: {len(held)} held + "
                f"{m.pool.num_free} free != {m.pool.num_blocks}")
        assert plan.last == all(st.finished for st in self.req.values())

    def req_index(self, st):
        return self.by_id[st.spec.request_id]

    def check_hit(self, st: ReqState, hit: int, step: int) -> None:
        unit = math.lcm(*self.mbs)
        assert hit % unit == 0, f"hit {hit} is not a whole number of {unit}-token units"
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


def audit(sc: Scenario) -> tuple[Scheduler, Auditor]:
    sched = Scheduler(sc, build_layouts(sc))
    aud = Auditor(sched)
    for plan in sched.plans():
        aud.feed(plan)
    aud.finish()
    return sched, aud


# ----------------------------------------------------------------------------- scenarios

def mixed(W=2, I=2, **kw):
    """Every kind of group at once: sharded MLA, replicated full, window, chunk, ring."""
    layers = {
        "mla.0": mla(16), "mla.1": mla(16),
        "rep.0": full_rep(16),
        "swa.0": swa(8, window=20), "swa.1": swa(8, window=20),
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
    reqs = [R("x", 60, 120, acceptance=(2, 1)), R("y", 60, 120, acceptance=(0, 3)),
            R("z", 40, 10, arrival_step=2)]
    return scenario(layers, reqs, W=W, k=3, budget=64, num_gpu_blocks=num_gpu_blocks, **kw)


# ----------------------------------------------------------------------------- audit runs


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (2, 2), (3, 4), (4, 8)])
def test_audit_mixed_groups(W, I):
    sched, aud = audit(mixed(W=W, I=I))
    st = aud.req[aud.by_id["c"]]
    assert st.preemptions and st.preemptions[0] == (6, "scenario")
    assert sum(s.rewrites_after_rejection for s in aud.req.values()) > 0
    assert sched.summary["finished"] == 4


def _small_builtins():
    """Built-in scenarios small enough for the per-position audit (< 20k tokens in total)."""
    out = []
    for name in builtin_scenario_names():
        sc = load_scenario(name)
        if sum(r.prompt_len + r.output_len for r in sc.requests) < 20_000:
            out.append(name)
    return out


BUILTIN_CASES = [(n, W) for n in ("dsv3", "dsv41-hybrid") for W in (1, 2, 3, 4)] + [
    (n, None) for n in _small_builtins() if n not in ("dsv3", "dsv41-hybrid")]


@pytest.mark.parametrize("name,W", BUILTIN_CASES, ids=[f"{n}-W{w}" for n, w in BUILTIN_CASES])
def test_audit_builtin_scenarios(name, W):
    sc = load_scenario(name)
    if W is not None:
        sc = sc.with_overrides(decode_context_parallel_size=W)
    sched, aud = audit(sc)
    assert sched.summary["finished"] == len(sc.requests)
    if name in ("dsv3", "dsv41-hybrid"):  # these exercise preemption and rejected drafts
        assert sched.summary["preemptions"] >= 1
        assert sum(s.rewrites_after_rejection for s in aud.req.values()) > 0


@pytest.mark.parametrize("W", [1, 2, 4])
def test_audit_pool_pressure(W):
    # x and y each need cdiv(60 + 120 + 3, 16*W) blocks: 12 / 6 / 3 at W = 1 / 2 / 4; pools of
    # 14 / 8 / 4 hold one of them fully grown, never both.
    sc = pressure(W=W, num_gpu_blocks={1: 14, 2: 8, 4: 4}[W])
    sched, aud = audit(sc)
    kinds = [why for st in aud.req.values() for _, why in st.preemptions]
    assert "out of blocks" in kinds, aud.events
    victims = [st for st in aud.req.values() if st.preemptions]
    # a preempted request is readmitted once per preemption and restarts from 0 or a prefix hit
    for st in victims:
        assert st.admissions == len(st.preemptions) + 1
        assert st.writes_from_zero_after_preemption + sum(1 for h in st.hits[1:] if h) >= len(st.preemptions)
    assert sched.summary["reused_blocks"] > 0


def test_audit_random_acceptance_and_tiny_budget():
    # acceptance left empty: the seeded pattern; budget 4 = one speculative step (k = 3)
    layers = {"mla.0": mla(16), "swa.0": swa(8, window=9, extra=2), "ring.0": ring(5)}
    reqs = [R("p", 30, 20), R("q", 17, 25, arrival_step=2), R("r", 5, 8, arrival_step=4)]
    audit(scenario(layers, reqs, W=2, I=4, k=3, budget=4))


# ----------------------------------------------------------------------------- targeted checks


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (4, 2)])
def test_manager_block_size_sharded_vs_replicated(W, I):
    sc = mixed(W=W, I=I)
    layouts = build_layouts(sc)
    # MLA B=16: sharded when W > 1 -> 16*W; replicated full B=16 -> 16; window/chunk B=8 -> 8.
    mla_lay = next(lay for lay in layouts if isinstance(lay.spec, MLAAttentionSpec))
    assert mla_lay.manager_block_size == 16 * W
    assert mla_lay.sharded == (W > 1)
    rep = next(lay for lay in layouts if type(lay.spec) is FullAttentionSpec)
    assert rep.manager_block_size == 16 and not rep.sharded
    for lay in layouts:
        if isinstance(lay.spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
            assert lay.manager_block_size == 8 and not lay.sharded
        if isinstance(lay.spec, CircularBufferSpec):
            assert not lay.sharded and lay.blocks_needed(10_000) == 1


def test_block_zero_never_allocated():
    pool = BlockPool(5)
    got = pool.allocate(5)
    assert sorted(got) == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([0, got[0]])  # freeing the null block is a no-op
    assert pool.num_free == 1 and pool.allocate(1) == [got[0]]


def test_chunked_prefill_splits_under_budget():
    # budget 40, one request of 100 prompt tokens: chunks 40, 40, 20, then decode of 1 + 0.
    sc = scenario({"mla.0": mla(16)}, [R("a", 100, 3)], W=2, budget=40)
    sched = Scheduler(sc, build_layouts(sc))
    sizes = [[(w.start, len(w.contents)) for w in p.writes] for p in sched.plans()]
    assert sizes == [[(0, 40)], [(40, 40)], [(80, 20)], [(100, 1)], [(101, 1)]]


def test_decode_writes_one_plus_drafts_and_rejection_rewrites():
    # k = 3, acceptance (1,): prompt 10, output 9.
    # step 0: prefill [0,10), output 1, committed 10, known 11.
    # step 1: write [10,14) = 1 true + 3 drafts; accept 1 -> committed 12, output 3;
    #         positions 12, 13 are rejected drafts (wrong contents).
    # step 2: write [12,16): 12 rewritten with the true content, now accepted 1 -> committed 14.
    sc = scenario({"mla.0": mla(16)}, [R("a", 10, 9, acceptance=(1,))], W=2, k=3)
    sched = Scheduler(sc, build_layouts(sc))
    fp = sched.requests[0].fingerprints
    plans = list(sched.plans())
    w1, w2 = plans[1].writes[0], plans[2].writes[0]
    assert (w1.start, len(w1.contents)) == (10, 4)
    assert plans[1].views[0].num_committed == 12
    assert np.array_equal(w1.contents[:2], fp[10:12])
    assert w1.contents[2] != fp[12] and w1.contents[3] != fp[13]
    assert (w2.start, len(w2.contents)) == (12, 4)
    assert w2.contents[0] == fp[12] and w2.contents[0] != w1.contents[2]
    assert w2.contents[1] == fp[13] and w2.contents[1] != w1.contents[3]
    # the last steps cap the drafts at remaining_output - 1 (never past the final length 18)
    assert max(w.stop for p in plans for w in p.writes) == 10 + 9 - 1


@pytest.mark.parametrize("W,B,want", [(2, 64, 512), (1, 64, 512), (3, 64, 384), (4, 64, 512),
                                      (2, 16, 512), (2, 48, 480)])
def test_prefix_hit_whole_units_within_common_prefix(W, B, want):
    # 520 shared tokens; unit B*W: 128 -> 4 units = 512; 64 -> 512; 192 -> 2 units = 384;
    # 256 -> 2 units = 512; 32 -> 16 units = 512; 96 -> 5 units = 480.
    sc = prefix_scenario(W=W, B=B)
    sched, aud = audit(sc)
    st = aud.req[aud.by_id["second"]]
    assert st.hits == [want]
    assert want % (B * W) == 0 and want <= 520 < want + B * W
    assert aud.req[aud.by_id["other"]].hits == [0]
    assert sched.summary["prefix_hit_tokens"] == want


def test_prefix_hit_unit_is_lcm_of_manager_block_sizes():
    # sharded MLA B=16, W=2 -> 32; replicated full B=48 -> 48; lcm = 96 -> 5 units = 480.
    sc = prefix_scenario(W=2, B=16, extra_layers={"rep.0": full_rep(48)})
    sched, aud = audit(sc)
    assert aud.req[aud.by_id["second"]].hits == [480]
    # the hit blocks are the very blocks of "first", in both groups
    sched2 = Scheduler(sc, build_layouts(sc))
    for plan in sched2.plans():
        if any(e.startswith("admitted second") for e in plan.events):
            for g, table in enumerate(plan.rows_before):
                mbs = sched2.layouts[g].manager_block_size
                n = 480 // mbs
                assert list(table[1][:n]) == list(table[0][:n])
                assert not set(table[1][n:]) & set(table[0])
            break
    else:
        pytest.fail("second never admitted")


@pytest.mark.parametrize("why", ["disabled", "window", "ring"])
def test_no_prefix_hits_when_disabled_or_not_cacheable(why):
    extra = {"window": {"swa.0": swa(8, 20)}, "ring": {"ring.0": ring(8)}}.get(why)
    sc = prefix_scenario(W=2, B=64, extra_layers=extra, prefix=why != "disabled")
    sched, aud = audit(sc)
    assert sched.prefix_cache is None
    assert sched.summary["prefix_hit_tokens"] == 0
    assert all(h == 0 for st in aud.req.values() for h in st.hits)
    assert not any("prefix-cache hit" in e for e in aud.events)


def test_sliding_window_nulls_exactly_the_blocks_below_the_window():
    # window 20, B 8, W 2 (replicated -> entries of 8 tokens). After n committed tokens the
    # first needed position is n - 19; entry j is null iff 8*(j+1) <= n - 19.
    sc = scenario({"swa.0": swa(8, 20)}, [R("a", 50, 30)], W=2, budget=16)
    sched = Scheduler(sc, build_layouts(sc))
    seen = set()
    for plan in sched.plans():
        for v in plan.views:
            row = [int(b) for b in plan.rows_after[0][v.req_index]]
            n = v.num_committed
            want_nulls = max(0, (n - 19) // 8)
            assert row[:want_nulls] == [0] * want_nulls and 0 not in row[want_nulls:], (n, row)
            seen.add(want_nulls)
    # e.g. n = 50 -> first 31 -> 3 null entries (positions 0..23), entry 3 (24..31) kept
    assert {0, 3, 7} <= seen


def test_chunked_local_nulls_exactly_the_blocks_before_the_chunk():
    # chunk 24, B 8: after n tokens positions < 24*(n//24) are released; entry j null iff
    # 8*(j+1) <= 24*(n//24).
    sc = scenario({"chunk.0": chunked(8, 24)}, [R("a", 30, 40)], W=1, budget=16)
    sched = Scheduler(sc, build_layouts(sc))
    seen = set()
    for plan in sched.plans():
        for v in plan.views:
            row = [int(b) for b in plan.rows_after[0][v.req_index]]
            nulls = (24 * (v.num_committed // 24)) // 8
            assert row[:nulls] == [0] * nulls and 0 not in row[nulls:], (v.num_committed, row)
            seen.add(nulls)
    assert {0, 3, 6} <= seen


def test_ring_requests_hold_exactly_one_block():
    layers = {"ring.0": ring(8), "mla.0": mla(16)}
    reqs = [R("a", 40, 20), R("b", 33, 17, arrival_step=1), R("c", 5, 5, arrival_step=9)]
    sc = scenario(layers, reqs, W=2, k=3, budget=32)
    sched = Scheduler(sc, build_layouts(sc))
    ring_g = next(i for i, lay in enumerate(sched.layouts) if lay.storage == "ring")
    for plan in sched.plans():
        for rows in (plan.rows_before[ring_g], plan.rows_after[ring_g]):
            for row in rows.values():
                assert len(row) == 1 and row[0] != 0
        blocks = [int(r[0]) for r in plan.rows_before[ring_g].values()]
        assert len(blocks) == len(set(blocks))


def test_finished_requests_blocks_are_reused():
    # 4 blocks of 32 tokens (B=16, W=2); "a" needs cdiv(100, 32) = 4: all of them. "b" arrives
    # later and can only run on a's blocks once a finishes.
    layers = {"mla.0": mla(16)}
    reqs = [R("a", 90, 10), R("b", 90, 10, arrival_step=1)]
    sc = scenario(layers, reqs, W=2, num_gpu_blocks=4, budget=128, prefix=False)
    sched = Scheduler(sc, build_layouts(sc))
    a_blocks, b_blocks = set(), set()
    for plan in sched.plans():
        a_blocks |= {int(b) for b in plan.rows_before[0].get(0, [])}
        b_blocks |= {int(b) for b in plan.rows_before[0].get(1, [])}
    assert a_blocks == b_blocks == {1, 2, 3, 4}
    assert sched.summary["reused_blocks"] >= 4
    assert sched.summary["preemptions"] == 0


def test_forced_preemption_frees_everything_and_recomputes():
    # without prefix caching the victim restarts from 0 and every block goes back to the pool
    layers = {"mla.0": mla(16), "swa.0": swa(8, 20)}
    reqs = [R("a", 64, 20, preempt_at_steps=(3,)), R("b", 30, 30)]
    sc = scenario(layers, reqs, W=2, budget=32, prefix=False)
    sched = Scheduler(sc, build_layouts(sc))
    aud = Auditor(sched)
    starts = []
    for plan in sched.plans():
        aud.feed(plan)  # checks held + free == pool after every step
        starts += [(plan.step, w.start) for w in plan.writes if w.request_id == "a"]
        if plan.step == 3:
            assert "preempted a (scenario)" in plan.events
    aud.finish()
    st = aud.req[0]
    assert st.preemptions == [(3, "scenario")]
    after = [s for step, s in starts if step >= 3]
    assert after and after[0] == 0, starts


@pytest.mark.parametrize("sc", [load_scenario("dsv3"), mixed(W=2, I=2)], ids=["dsv3", "mixed"])
def test_no_admission_in_a_step_that_preempted(sc):
    # scheduler docstring: waiting requests are admitted "not in a step that preempted" -- for a
    # preempt_at_steps preemption too (dsv3: long-doc preempted at step 12 is not readmitted in
    # step 12 with a self prefix hit of 1408 tokens).
    sched = Scheduler(sc, build_layouts(sc))
    preempting_steps = 0
    for plan in sched.plans():
        if any(e.startswith("preempted") for e in plan.events):
            preempting_steps += 1
            assert not any(e.startswith("admitted") for e in plan.events), plan.events
    assert preempting_steps


def test_pool_pressure_preemption_restarts_from_zero_without_prefix_cache():
    sc = pressure(W=2, num_gpu_blocks=8, prefix=False)
    sched, aud = audit(sc)
    victims = [st for st in aud.req.values() if st.preemptions]
    assert victims and all(why == "out of blocks" for st in victims for _, why in st.preemptions)
    for st in victims:
        assert st.hits == [0] * st.admissions
        assert st.writes_from_zero_after_preemption == len(st.preemptions)


def test_max_num_seqs_and_late_arrival():
    # max_num_seqs = 1: never two requests holding blocks; "late" arrives at step 5 and nothing
    # runs before it (empty plans), "early" waits for "late" only if it arrives later.
    layers = {"mla.0": mla(16)}
    reqs = [R("late", 20, 4, arrival_step=5), R("later", 20, 4, arrival_step=6)]
    cfg = SimConfig(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=1)
    sc = Scenario(name="t", layers=layers, config=cfg, requests=tuple(reqs))
    sched = Scheduler(sc, build_layouts(sc))
    aud = Auditor(sched)
    plans = []
    for plan in sched.plans():
        aud.feed(plan)
        plans.append(plan)
        assert len(plan.rows_before[0]) <= 1
    aud.finish()
    assert all(p.writes == () and p.views == () for p in plans[:5])
    assert plans[5].writes[0].request_id == "late"
    first_later = next(p.step for p in plans if any(w.request_id == "later" for w in p.writes))
    last_late = max(p.step for p in plans if any(w.request_id == "late" for w in p.writes))
    assert first_later == last_late + 1


def test_determinism_two_schedulers_same_plans():
    for sc in (mixed(W=3, I=2), load_scenario("dsv3"), pressure(W=2, num_gpu_blocks=8)):
        a = list(Scheduler(sc, build_layouts(sc)).plans())
        b = list(Scheduler(sc, build_layouts(sc)).plans())
        assert len(a) == len(b)
        for p, q in zip(a, b):
            assert p.events == q.events and p.last == q.last
            assert [(w.req_index, w.start) for w in p.writes] == [(w.req_index, w.start) for w in q.writes]
            assert all(np.array_equal(w.contents, x.contents) for w, x in zip(p.writes, q.writes))
            for rows_p, rows_q in zip(p.rows_before + p.rows_after, q.rows_before + q.rows_after):
                assert rows_p.keys() == rows_q.keys()
                assert all(np.array_equal(rows_p[r], rows_q[r]) for r in rows_p)
            assert [(v.req_index, v.num_committed) for v in p.views] == \
                [(v.req_index, v.num_committed) for v in q.views]


def test_seed_changes_contents_not_shape():
    sc = mixed(W=2, I=2)
    a = list(Scheduler(sc, build_layouts(sc)).plans())
    sc2 = sc.with_overrides(seed=7)
    b = list(Scheduler(sc2, build_layouts(sc2)).plans())
    assert not np.array_equal(a[0].writes[0].contents, b[0].writes[0].contents)


def test_request_that_can_never_fit_raises_at_construction():
    # B=16, W=2: 32 tokens per block; 200 + 20 + 3 tokens need 7 blocks, the pool has 3.
    sc = scenario({"mla.0": mla(16)}, [R("small", 10, 5), R("huge-req", 200, 20)],
                  W=2, k=3, num_gpu_blocks=3)
    layouts = build_layouts(sc)
    with pytest.raises(ConfigError) as exc:
        Scheduler(sc, layouts)
    msg = str(exc.value)
    assert "'huge-req'" in msg and layouts[0].name in msg and "7" in msg and "3" in msg


def test_request_that_can_never_fit_names_the_right_group():
    # the MLA group fits (cdiv(223, 32) = 7 <= 8) but the replicated B=16 group needs 14 > 8
    layers = {"mla.0": mla(16), "rep.0": full_rep(16)}
    sc = scenario(layers, [R("r", 200, 20)], W=2, k=3, num_gpu_blocks=8)
    layouts = build_layouts(sc)
    with pytest.raises(ConfigError) as exc:
        Scheduler(sc, layouts)
    rep = next(lay for lay in layouts if lay.replicated)
    assert rep.name in str(exc.value) and "'r'" in str(exc.value)


# ----------------------------------------------------------------------------- the auditor bites
# Each mutation below plants a known scheduler bug with monkeypatch; the audit must reject it
# (proof that the invariants above can fail).


def _hash_first_token_of_unit(self, req, unit):
    # bug class 1 in spirit: the key does not cover the whole unit -> hits past the common prefix
    return (unit, int(req.fingerprints[unit * self.unit]))


def _release_one_block_early(self, num_committed):
    first = self.spec.first_needed_position(num_committed) if self.retention in ("window", "chunk") else 0
    return first + self.manager_block_size if first else 0


def _true_drafts(self, start, num_drafts, accepted, step):
    return self.fingerprints[start:start + num_drafts].copy()


def _free_nothing(self, req):
    self.blocks.pop(req, None)


def _double_hand_out(self, n):
    out = _orig_allocate(self, n)
    if self.num_free == 0 and out:
        out[-1] = 1  # hand out a block that may still be held
    return out


_orig_allocate = BlockPool.allocate


def _ignore_budget(self, req, budget):
    todo = req.num_known - req.num_computed
    return todo, 0


MUTATIONS = {
    "prefix-key-misses-tail": ("dcpsim.scheduler.prefix_cache.PrefixCache._key", _hash_first_token_of_unit),
    "window-released-early": ("dcpsim.group_layout.GroupLayout.first_needed_position", _release_one_block_early),
    "rejected-drafts-true": ("dcpsim.scheduler.request.Request.draft_contents", _true_drafts),
    "finished-blocks-leak": ("dcpsim.scheduler.managers.GroupManager.free", _free_nothing),
    "block-handed-twice": ("dcpsim.scheduler.block_pool.BlockPool.allocate", _double_hand_out),
    "budget-ignored": ("dcpsim.scheduler.scheduler.Scheduler._tokens_for", _ignore_budget),
}


def _mutation_scenario(name):
    if name == "prefix-key-misses-tail":
        # 400 shared tokens, unit 128: true hit 384; the broken key also matches unit 3 -> 512
        layers = {"mla.0": mla(64)}
        reqs = [R("first", 600, 10, prefix="s", shared_prefix_len=400),
                R("second", 600, 10, prefix="s", shared_prefix_len=400, arrival_step=6)]
        return scenario(layers, reqs, W=2, budget=256)
    if name == "window-released-early":
        return mixed(W=2, I=2)
    if name in ("finished-blocks-leak", "block-handed-twice"):
        return pressure(W=2, num_gpu_blocks=8, prefix=False)
    return mixed(W=2, I=2)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_auditor_rejects_planted_scheduler_bug(name, monkeypatch):
    target, fn = MUTATIONS[name]
    monkeypatch.setattr(target, fn)
    sc = _mutation_scenario(name)
    with pytest.raises(AssertionError):
        audit(sc)


# ----------------------------------------------------------------------------- random scenarios

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def random_scenarios(draw):
    W = draw(st.sampled_from([1, 2, 3, 4]))
    B = draw(st.sampled_from([8, 16, 32]))
    I = draw(st.sampled_from([i for i in (1, 2, 4, 8) if i <= B]))
    k = draw(st.sampled_from([0, 1, 3]))
    layers = {"mla.0": mla(B)}
    if draw(st.booleans()):
        layers["rep.0"] = full_rep(draw(st.sampled_from([8, 16, 24])))
    if draw(st.booleans()):
        layers["swa.0"] = swa(draw(st.sampled_from([4, 8])), window=draw(st.integers(2, 40)),
                              extra=draw(st.integers(0, 5)))
    if draw(st.booleans()):
        layers["chunk.0"] = chunked(draw(st.sampled_from([4, 8])), size=draw(st.sampled_from([8, 16, 24])))
    if draw(st.booleans()):
        layers["ring.0"] = ring(max(k + 2, draw(st.sampled_from([4, 8]))))
    reqs = []
    for i in range(draw(st.integers(1, 5))):
        P = draw(st.integers(1, 150))
        kw = dict(arrival_step=draw(st.integers(0, 10)))
        if draw(st.booleans()):
            kw.update(prefix="s", shared_prefix_len=draw(st.integers(0, P)))
        if k and draw(st.booleans()):
            kw["acceptance"] = tuple(draw(st.lists(st.integers(0, k), min_size=1, max_size=4)))
        if draw(st.booleans()):
            kw["preempt_at_steps"] = tuple(draw(st.lists(st.integers(0, 30), max_size=2)))
        reqs.append(R(f"r{i}", P, draw(st.integers(1, 40)), **kw))
    return dict(layers=layers, requests=reqs, W=W, I=I, k=k, budget=draw(st.integers(k + 1, 80)),
                max_len=256, num_gpu_blocks=draw(st.one_of(st.none(), st.integers(3, 30))),
                prefix=draw(st.booleans()), seed=draw(st.integers(0, 3)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_scenarios())
def test_audit_random_scenarios(kw):
    try:
        sc = scenario(kw.pop("layers"), kw.pop("requests"), **kw)
        sched = Scheduler(sc, build_layouts(sc))
    except ConfigError:
        event("rejected at construction")
        return  # an invalid combination or a request that can never fit: rejected up front
    aud = Auditor(sched)
    # a request that passed the construction check always gets in once the others are done:
    # no "can never be admitted" (nor any other) error is acceptable here
    for plan in sched.plans():
        aud.feed(plan)
    aud.finish()
    event("audited")


# ----------------------------------------------------------------------------- registered faults


def _scheduler_fault_names():
    try:
        from dcpsim.faults import FAULTS, Fault
    except ImportError:  # pragma: no cover
        return []
    hooks = ("prefix_key_position", "num_released_blocks", "engine_layouts")
    return sorted(n for n, f in FAULTS.items()
                  if any(getattr(type(f), h, None) is not getattr(Fault, h, None) for h in hooks))


@pytest.mark.parametrize("fault", _scheduler_fault_names())
def test_auditor_rejects_registered_scheduler_faults(fault):
    """Faults of the engine's registry that act on the scheduler side (prefix keys, releases,
    group layouts) must be rejected by the audit alone, before any rank writes anything."""
    import dataclasses
    import inspect

    from dcpsim.faults import FAULTS

    f = FAULTS[fault]
    ov_names = set(inspect.signature(Scenario.with_overrides).parameters) - {"self"}
    tried = 0
    for name in builtin_scenario_names():
        if "256k" in name or (getattr(f, "scenarios", None) and name not in f.scenarios):
            continue
        for config in getattr(f, "configs", ({},)):
            options = {**config, **getattr(f, "needs", {})}
            sc = load_scenario(name).with_overrides(**{k: v for k, v in options.items() if k in ov_names})
            cfg = {k: v for k, v in options.items() if k not in ov_names and hasattr(sc.config, k)}
            if cfg:
                sc = dataclasses.replace(sc, config=dataclasses.replace(sc.config, **cfg))
            layouts = build_layouts(sc)
            if not f.applies_to_scenario(sc, layouts):
                continue
            tried += 1
            sched = Scheduler(sc, f.engine_layouts(sc, layouts), f)
            with pytest.raises(AssertionError):
                aud = Auditor(sched, true_layouts=layouts)
                for plan in sched.plans():
                    aud.feed(plan)
                aud.finish()
        if tried:
            break
    if not tried:
        pytest.skip(f"{fault} cannot show on any small built-in")
