"""The whole schedule, audited step by step against the semantics doc (section 5).

The auditor itself (an independent model of the invariants, written from the doc and
the scheduler's documented contract) lives in ``tests/support/schedule_auditor.py``. Here it runs on every kind
of group, the small built-ins, pool pressure and Hypothesis' random scenarios; and it
bites: planted scheduler bugs and the registered faults that act on the scheduler side
must be rejected by the audit alone.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dcpsim.campaigns.selftest_options import apply_options
from dcpsim.engine.faults import FAULTS, Fault
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.block_pool import BlockPool
from dcpsim.engine.scheduler.managers import GroupManager
from dcpsim.engine.scheduler.request import Request
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Retention
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names
from support.helpers import chunked_spec as chunked
from support.helpers import full_rep_spec as full_rep
from support.helpers import geometries, scheduler
from support.helpers import make_scenario as scenario
from support.helpers import mla_spec as mla
from support.helpers import request_spec as R
from support.helpers import ring_spec as ring
from support.helpers import swa_spec as swa

# ----------------------------------------------------------------------------- audit runs


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (2, 2), (3, 4), (4, 8)])
def test_audit_mixed_groups(W, I, audit, mixed):
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
    (n, None) for n in _small_builtins() if n not in ("dsv3", "dsv41-hybrid")
]


@pytest.mark.parametrize("name,W", BUILTIN_CASES, ids=[f"{n}-W{w}" for n, w in BUILTIN_CASES])
def test_audit_builtin_scenarios(name, W, audit):
    sc = load_scenario(name)
    if W is not None:
        sc = sc.with_overrides(ScenarioOverrides(decode_context_parallel_size=W))
    sched, aud = audit(sc)
    assert sched.summary["finished"] == len(sc.requests)
    if name in ("dsv3", "dsv41-hybrid"):  # these exercise preemption and rejected drafts
        assert sched.summary["preemptions"] >= 1
        assert sum(s.rewrites_after_rejection for s in aud.req.values()) > 0


@pytest.mark.parametrize("W", [1, 2, 4])
def test_audit_pool_pressure(W, audit, pressure):
    # x and y each need cdiv(60 + 120 + 3, 16*W) blocks: 12 / 6 / 3 at W = 1 / 2 / 4; pools of
    # 14 / 8 / 4 hold one of them fully grown, never both.
    sc = pressure(W=W, num_gpu_blocks={1: 14, 2: 8, 4: 4}[W])
    sched, aud = audit(sc)
    kinds = [why for state in aud.req.values() for _, why in state.preemptions]
    assert "out of blocks" in kinds, aud.events
    victims = [state for state in aud.req.values() if state.preemptions]
    # a preempted request is readmitted once per preemption and restarts from 0 or a prefix hit
    for state in victims:
        assert state.admissions == len(state.preemptions) + 1
        assert state.writes_from_zero_after_preemption + sum(1 for h in state.hits[1:] if h) >= len(state.preemptions)
    assert sched.summary["reused_blocks"] > 0


def test_audit_random_acceptance_and_tiny_budget(audit):
    # acceptance left empty: the seeded pattern; budget 4 = one speculative step (k = 3)
    layers = {"mla.0": mla(16), "swa.0": swa(8, window=9, extra=2), "ring.0": ring(5)}
    reqs = [R("p", 30, 20), R("q", 17, 25, arrival_step=2), R("r", 5, 8, arrival_step=4)]
    audit(scenario(layers, reqs, W=2, I=4, k=3, budget=4))


# ----------------------------------------------------------------------------- the auditor bites
# Each mutation below plants a known scheduler bug; the audit must reject it (proof that the
# invariants can fail). A bug in an engine decision is an engine variant handed to the
# scheduler; a bug in the scheduler's own machinery is a method patched on its class.


class PrefixKeyMissesTail(ReferenceEngine):
    """Bug class 1 in spirit: the key does not cover the whole unit (it is the fingerprint
    at the unit's first token) -> hits past the common prefix."""

    def prefix_key_position(self, geometries, unit):
        return unit * self.prefix_hash_block_size(geometries)


class WindowReleasedEarly(ReferenceEngine):
    """Window and chunk groups consider one more block no longer needed."""

    def first_needed_position(self, geometry, num_committed):
        first = super().first_needed_position(geometry, num_committed) if geometry.retention in (Retention.WINDOW, Retention.CHUNK) else 0
        return first + geometry.manager_block_size if first else 0


def _true_drafts(self, start, num_drafts, accepted, step):
    return self.fingerprints[start : start + num_drafts].copy()


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


ENGINE_MUTATIONS = {
    "prefix-key-misses-tail": PrefixKeyMissesTail,
    "window-released-early": WindowReleasedEarly,
}
PATCHED_MUTATIONS = {
    "rejected-drafts-true": (Request, "draft_contents", _true_drafts),
    "finished-blocks-leak": (GroupManager, "free", _free_nothing),
    "block-handed-twice": (BlockPool, "allocate", _double_hand_out),
    "budget-ignored": (Scheduler, "_tokens_for", _ignore_budget),
}
MUTATIONS = {**ENGINE_MUTATIONS, **PATCHED_MUTATIONS}


def _mutation_scenario(name, mixed, pressure):
    if name == "prefix-key-misses-tail":
        # 400 shared tokens, unit 128: true hit 384; the broken key also matches unit 3 -> 512
        layers = {"mla.0": mla(64)}
        reqs = [
            R("first", 600, 10, prefix="s", shared_prefix_len=400),
            R("second", 600, 10, prefix="s", shared_prefix_len=400, arrival_step=6),
        ]
        return scenario(layers, reqs, W=2, budget=256)
    if name == "window-released-early":
        return mixed(W=2, I=2)
    if name in ("finished-blocks-leak", "block-handed-twice"):
        return pressure(W=2, num_gpu_blocks=8, prefix=False)
    return mixed(W=2, I=2)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_auditor_rejects_planted_scheduler_bug(name, monkeypatch, audit, mixed, pressure):
    sc = _mutation_scenario(name, mixed, pressure)
    audit(sc)  # the scenario itself is sound: what the audit rejects below is the bug
    engine = None
    if name in ENGINE_MUTATIONS:
        engine = ENGINE_MUTATIONS[name]()
    else:
        owner, attr, fn = PATCHED_MUTATIONS[name]
        monkeypatch.setattr(owner, attr, fn)  # raising=True: fails if the method was renamed
    with pytest.raises(AssertionError):
        audit(sc, engine)


# ----------------------------------------------------------------------------- random scenarios


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
        layers["swa.0"] = swa(draw(st.sampled_from([4, 8])), window=draw(st.integers(2, 40)), extra=draw(st.integers(0, 5)))
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
    return dict(
        layers=layers,
        requests=reqs,
        W=W,
        I=I,
        k=k,
        budget=draw(st.integers(k + 1, 80)),
        max_len=256,
        num_gpu_blocks=draw(st.one_of(st.none(), st.integers(3, 30))),
        prefix=draw(st.booleans()),
        seed=draw(st.integers(0, 3)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_scenarios())
def test_audit_random_scenarios(auditor, kw):
    try:
        sc = scenario(kw.pop("layers"), kw.pop("requests"), **kw)
        sched = scheduler(sc)
    except ConfigError:
        event("rejected at construction")
        return  # an invalid combination or a request that can never fit: rejected up front
    aud = auditor(sched)
    # a request that passed the construction check always gets in once the others are done:
    # no "can never be admitted" (nor any other) error is acceptable here
    for plan in sched.plans():
        aud.feed(plan)
    aud.finish()
    event("audited")


# ----------------------------------------------------------------------------- registered faults

SCHEDULER_DECISIONS = (
    "kv_cache_groups",
    "blocks_needed",
    "first_needed_position",
    "num_released_blocks",
    "prefix_block_tokens",
    "prefix_hash_unit",
    "prefix_key_position",
)
"""The ``Engine`` decisions the scheduler makes (besides ``group_geometry``, whose
block-table width only the worker reads: a fault there shows in the worker, not here)."""


def _scheduler_fault_names():
    return sorted(n for n, f in FAULTS.items() if any(getattr(type(f), h) is not getattr(Fault, h) for h in SCHEDULER_DECISIONS))


@pytest.mark.parametrize("fault", _scheduler_fault_names())
def test_auditor_rejects_registered_scheduler_faults(fault, auditor):
    """Faults of the engine's registry that act on the scheduler side (prefix keys, releases,
    group layouts) must be rejected by the audit alone, before any rank writes anything."""
    f = FAULTS[fault]
    tried = 0
    for name in builtin_scenario_names():
        if "256k" in name or (getattr(f, "scenarios", None) and name not in f.scenarios):
            continue
        for config in getattr(f, "configs", ({},)):
            options = {**config, **getattr(f, "needs", {})}
            sc, _ = apply_options(load_scenario(name), options)
            layouts = geometries(sc)
            if not f.applies_to_scenario(sc, layouts):
                continue
            tried += 1
            sched = Scheduler(sc, f, f.geometries(sc.layers, sc.config))
            with pytest.raises(AssertionError):
                aud = auditor(sched, true_geometries=layouts)
                for plan in sched.plans():
                    aud.feed(plan)
                aud.finish()
        if tried:
            break
    if not tried:
        pytest.skip(f"{fault} cannot show on any small built-in")
