"""``PrefixCache``: hits in whole hash units (the LCM of the manager block sizes) within the
true common prefix, the very blocks of the earlier request, none where caching is off or a
group is not cacheable. Every run also goes through the auditor (``tests/support/schedule_auditor.py``)."""

from __future__ import annotations

import pytest

from dcpsim.model.plan import EventKind
from support.helpers import full_rep_spec as full_rep
from support.helpers import ring_spec as ring
from support.helpers import scheduler
from support.helpers import swa_spec as swa


@pytest.mark.parametrize("W,B,want", [(2, 64, 512), (1, 64, 512), (3, 64, 384), (4, 64, 512), (2, 16, 512), (2, 48, 480)])
def test_prefix_hit_whole_units_within_common_prefix(W, B, want, audit, prefix_scenario):
    # 520 shared tokens; unit B*W: 128 -> 4 units = 512; 64 -> 512; 192 -> 2 units = 384;
    # 256 -> 2 units = 512; 32 -> 16 units = 512; 96 -> 5 units = 480.
    sc = prefix_scenario(W=W, B=B)
    sched, aud = audit(sc)
    st = aud.req[aud.by_id["second"]]
    assert st.hits == [want]
    assert want % (B * W) == 0 and want <= 520 < want + B * W
    assert aud.req[aud.by_id["other"]].hits == [0]
    assert sched.summary["prefix_hit_tokens"] == want


def test_prefix_hit_unit_is_lcm_of_manager_block_sizes(audit, prefix_scenario):
    # sharded MLA B=16, W=2 -> 32; replicated full B=48 -> 48; lcm = 96 -> 5 units = 480.
    sc = prefix_scenario(W=2, B=16, extra_layers={"rep.0": full_rep(48)})
    sched, aud = audit(sc)
    assert aud.req[aud.by_id["second"]].hits == [480]
    # the hit blocks are the very blocks of "first", in both groups
    sched2 = scheduler(sc)
    for plan in sched2.plans():
        if any(e.kind is EventKind.ADMITTED and e.request_id == "second" for e in plan.events):
            for g, table in enumerate(plan.rows_before):
                mbs = sched2.geometries[g].manager_block_size
                n = 480 // mbs
                assert list(table[1][:n]) == list(table[0][:n])
                assert not set(table[1][n:]) & set(table[0])
            break
    else:
        pytest.fail("second never admitted")


@pytest.mark.parametrize("why", ["disabled", "window", "ring"])
def test_no_prefix_hits_when_disabled_or_not_cacheable(why, audit, prefix_scenario):
    extra = {"window": {"swa.0": swa(8, 20)}, "ring": {"ring.0": ring(8)}}.get(why)
    sc = prefix_scenario(W=2, B=64, extra_layers=extra, prefix=why != "disabled")
    sched, aud = audit(sc)
    assert sched.prefix_cache is None
    assert sched.summary["prefix_hit_tokens"] == 0
    assert all(h == 0 for st in aud.req.values() for h in st.hits)
    assert not any(e.prefix_hit for e in aud.events)


@pytest.mark.parametrize("W", [1, 2, 4, 8])
def test_compressed_cache_hits_come_in_whole_compressed_blocks(W, audit):
    # compressed-prefix: MLA pages of 16 tokens beside C4 pages of 64 tokens (16 records), so
    # a compressed entry covers 64 * W tokens and every hit is a whole number of them
    from support.helpers import builtin

    sc = builtin("compressed-prefix", W)
    sched, aud = audit(sc)
    spans = [g.manager_block_size for g in sched.geometries]
    assert spans == [16 * W, 64 * W]
    hits = [h for st in aud.req.values() for h in st.hits if h]
    assert hits and all(h % (64 * W) == 0 for h in hits), hits
    # the two families share 600 and 300 tokens: the first hits are the longest whole units
    # within them (a preempted request later finds more, its own prompt)
    best = {rid: aud.req[i].hits[0] for rid, i in aud.by_id.items()}
    assert best["doc-0"] == 600 // (64 * W) * 64 * W
    if 64 * W <= 300:
        assert best["sys-1"] == 300 // (64 * W) * 64 * W


def test_compressed_hit_reuses_the_blocks_of_both_groups():
    from support.helpers import builtin

    sc = builtin("compressed-prefix", 2)
    sched = scheduler(sc)
    for plan in sched.plans():
        if any(e.kind is EventKind.ADMITTED and e.request_id == "sys-1" and e.prefix_hit for e in plan.events):
            a, b = (next(r.index for r in sched.requests if r.request_id == rid) for rid in ("sys-0", "sys-1"))
            for g, table in enumerate(plan.rows_after):
                n = 256 // sched.geometries[g].manager_block_size  # 8 plain blocks, 2 compressed
                assert list(table[b][:n]) == list(table[a][:n])
                assert not set(table[b][n:]) & set(table[a])
            break
    else:
        pytest.fail("sys-1 never hit its prefix")
