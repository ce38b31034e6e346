"""``GroupManager``: the blocks a request holds in one group (manager block size, released
leading blocks of window / chunk groups, a ring's single block)."""

from __future__ import annotations

import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage
from dcpsim.model.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from support.helpers import chunked_spec as chunked
from support.helpers import geometries, scheduler
from support.helpers import make_scenario as scenario
from support.helpers import mla_spec as mla
from support.helpers import request_spec as R
from support.helpers import ring_spec as ring
from support.helpers import swa_spec as swa


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (4, 2)])
def test_manager_block_size_sharded_vs_replicated(W, I, mixed):
    sc = mixed(W=W, I=I)
    layouts = geometries(sc)
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
            assert not lay.sharded and ReferenceEngine().blocks_needed(lay, 10_000) == 1


def test_sliding_window_nulls_exactly_the_blocks_below_the_window():
    # window 20, B 8, W 2 (replicated -> entries of 8 tokens). After n committed tokens the
    # first needed position is n - 19; entry j is null iff 8*(j+1) <= n - 19.
    sc = scenario({"swa.0": swa(8, 20)}, [R("a", 50, 30)], W=2, budget=16)
    sched = scheduler(sc)
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
    sched = scheduler(sc)
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
    sched = scheduler(sc)
    ring_g = next(i for i, lay in enumerate(sched.geometries) if lay.storage is Storage.RING)
    for plan in sched.plans():
        for rows in (plan.rows_before[ring_g], plan.rows_after[ring_g]):
            for row in rows.values():
                assert len(row) == 1 and row[0] != 0
        blocks = [int(r[0]) for r in plan.rows_before[ring_g].values()]
        assert len(blocks) == len(set(blocks))
