"""The checker as a KV-aware router: the engine's advertised prefix-cache events must be
hashed at the GCD of the manager block sizes, key the true prefix, and end on whole hit
units (the LCM); a unit mismatch (a router's hit rate silently 0) is caught."""

from __future__ import annotations

import dataclasses

import numpy as np

from dcpsim.engine.faults import FAULTS
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import KVEvent, RequestView, StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.kv_events import KVEventRouter, hash_block_size, hit_alignment
from support.helpers import builtin, run, scheduler


def group(B, W, sharded):
    return ExpectedGroup(
        name=f"g{B}",
        layer_names=("l",),
        storage=Storage.PAGED,
        retention=Retention.FULL,
        sharded=sharded,
        dcp_size=W,
        interleave_size=1,
        tokens_per_state=1,
        block_size=B,
        kernel_block_size=None,
    )


def test_hash_unit_is_the_gcd_and_hits_the_lcm():
    # llama-draft at W = 2: sharded target B = 32 (64 tokens an entry), replicated draft B = 32
    groups = [group(32, 2, True), group(32, 2, False)]
    assert (hash_block_size(groups), hit_alignment(groups)) == (32, 64)


def _plan(events, fingerprints):
    view = RequestView(req_index=0, request_id="a", num_committed=len(fingerprints), fingerprints=fingerprints)
    return StepPlan(step=3, writes=(), rows_before=(), views=(view,), rows_after=(), kv_events=tuple(events))


def test_router_accepts_right_events_and_names_wrong_ones():
    fp = np.arange(100, 400, dtype=np.int64)
    router = KVEventRouter(0, [group(32, 2, True), group(32, 2, False)])
    good = [KVEvent("a", 0, 32, int(fp[31])), KVEvent("a", 32, 64, int(fp[63]))]
    router.judge(_plan(good, fp))
    assert router.count == 0 and router.events == 2
    router.judge(_plan([KVEvent("a", 64, 80, int(fp[79]))], fp))  # B-sized (16), not 32
    assert router.count == 1 and "not one hash block of 32 tokens" in str(router.kept[-1])
    router.judge(_plan([KVEvent("a", 64, 96, 7), KVEvent("a", 96, 128, int(fp[127]))], fp))  # a wrong key
    assert router.count == 2 and "not the fingerprint of the prefix ending at position 95" in str(router.kept[-1])
    router.judge(_plan([KVEvent("a", 128, 160, int(fp[159]))], fp))  # ends inside a 64-token hit unit
    assert "events end at 160, not on a whole hit unit of 64" in str(router.kept[-1])
    router.judge(_plan([KVEvent("a", 224, 256, int(fp[255]))], fp))  # skips [160, 224)
    assert "does not continue a prefix advertised before (nothing ends at 224)" in str(router.kept[-1])


def test_the_reference_advertises_what_a_router_expects():
    s = builtin("llama-draft", 2)
    events = [e for plan in scheduler(s).plans() for e in plan.kv_events]
    assert events and {e.stop - e.start for e in events} == {32}
    assert run(s).passed


def test_events_at_the_spec_block_size_are_caught():
    report = run(builtin("dsv3", 2), inject="kv-events-hash-unit-b")
    assert report.failure.kind == "kv-events"
    assert any("not one hash block" in d for d in report.failure.details)


def test_each_wrong_event_counts_once_whatever_the_number_of_ranks():
    """Every rank's plans hold the same events: rank 0 judges them (each rank did, and the count
    was W times the events)."""
    for W in (2, 4):
        sc = builtin("kv-events-full", W)
        report = run(sc, inject="kv-events-hash-unit-b")
        assert report.failure.kind == "kv-events" and all(d.startswith("rank 0 ") for d in report.failure.details[:10])
        plans = scheduler(sc, FAULTS["kv-events-hash-unit-b"]).plans()
        wrong = [e for plan in plans if plan.step == report.failure.step for e in plan.kv_events]  # 16 tokens each: all wrong
        assert report.failure.message == f"{len(wrong)} advertised prefix-cache event(s) a router cannot match", (W, len(wrong))


def test_group_events_are_held_to_their_groups_manager_block_size():
    # dsv3-like at W = 2 with a replicated indexer: group 0 B * W = 64, group 1 B = 32; hash unit 32
    fp = np.arange(1000, 1300, dtype=np.int64)
    router = KVEventRouter(0, [group(32, 2, True), group(32, 2, False)])
    ok = [KVEvent("a", 0, 64, int(fp[63]), group=0), KVEvent("a", 0, 32, int(fp[31]), group=1), KVEvent("a", 32, 64, int(fp[63]), group=1)]
    router.judge(_plan(ok, fp))
    assert router.count == 0 and router.events == 3
    router.judge(_plan([KVEvent("a", 64, 96, int(fp[95]), group=0)], fp))  # a partial prompt tail of group 0
    assert router.count == 0
    router.judge(_plan([KVEvent("a", 64, 80, int(fp[79]), group=0)], fp))  # not whole hash blocks
    assert router.count == 1 and "neither one block of 64 tokens" in str(router.kept[-1])
    router.judge(_plan([KVEvent("a", 96, 160, int(fp[159]), group=0)], fp))  # spans two of group 0's blocks
    assert router.count == 2 and "of group g32" in str(router.kept[-1])
    router.judge(_plan([KVEvent("a", 0, 64, int(fp[63]), group=5)], fp))
    assert router.count == 3 and "names group 5; the model has 2" in str(router.kept[-1])


def test_a_steps_events_chain_in_any_order_and_unseen_requests_wait():
    fp = np.arange(7, 307, dtype=np.int64)
    router = KVEventRouter(0, [group(32, 1, True)])
    router.judge(_plan([KVEvent("a", 32, 64, int(fp[63])), KVEvent("a", 0, 32, int(fp[31]))], fp))  # later first
    assert router.count == 0 and router.events == 2
    early = StepPlan(step=1, writes=(), rows_before=(), views=(), rows_after=(), kv_events=(KVEvent("b", 0, 32, int(fp[31])),))
    router.judge(early)  # "b" has run in no step yet: judged when it does
    assert router.events == 2 and router.count == 0
    view = RequestView(req_index=1, request_id="b", num_committed=40, fingerprints=fp[:40])
    router.judge(StepPlan(step=2, writes=(), rows_before=(), views=(view,), rows_after=(), kv_events=()))
    assert router.events == 3 and router.count == 0


def test_full_report_mode_readvertises_the_hit_blocks():
    full = builtin("kv-events-full", 4)
    incremental = dataclasses.replace(full, config=dataclasses.replace(full.config, kv_cache_report_mode="incremental"))

    def readvertised(s):  # chat-1's events from 0: its 320-token hit on chat-0's system prompt
        return [e for p in scheduler(s).plans() for e in p.kv_events if e.request_id == "chat-1" and e.start == 0]

    assert full.config.kv_cache_report_mode == "full" and readvertised(full)
    assert not readvertised(incremental)  # incremental: only the blocks chat-1 computed itself
    assert run(full).passed and run(incremental).passed
