"""``StateManager``: a Mamba group's blocks. A request holds ``1 + k`` state blocks whatever its
length and whatever ``W`` (the block size is never scaled); in ``align`` mode the row is indexed
by position, null below the state window, and released below the committed state. Every
schedule here also goes through the independent auditor."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.block_pool import NULL_BLOCK, BlockPool
from dcpsim.engine.scheduler.managers import StateManager
from dcpsim.engine.scheduler.scheduler import pool_sizes
from dcpsim.model.kinds import Storage
from support.helpers import geometries, scheduler
from support.helpers import make_scenario as scenario
from support.helpers import mamba_spec as mamba
from support.helpers import mla_spec as mla
from support.helpers import request_spec as R
from support.helpers import swa_spec as swa


def hybrid(W=2, k=2, mode="none", B=None, **kw):
    """Sharded MLA + a replicated window + a Mamba state; 2048-token model."""
    B = B or (2048 if mode == "none" else 16)
    layers = {"attn": mla(16), "swa": swa(), "gdn": mamba(B, k, mode)}
    reqs = [R("a", 300, 20, acceptance=(2, 0, 1)), R("b", 150, 30, arrival_step=1, preempt_at_steps=(6,)), R("c", 40, 12, arrival_step=9)]
    return scenario(layers, reqs, W=W, k=k, budget=64, prefix=False, **kw)


def plans(sc):
    return list(scheduler(sc).plans())


def state_geometry(sc):
    (g,) = [g for g in geometries(sc) if g.storage is Storage.STATE]
    return g


@pytest.mark.parametrize("W", [1, 2, 4])
def test_none_mode_holds_one_plus_k_blocks_never_scaled_by_W(W, audit):
    sc = hybrid(W=W)
    g = state_geometry(sc)
    assert g.replicated and g.manager_block_size == 2048 and g.block_table_width == 3
    sched, _ = audit(sc)
    seen = 0
    for plan in plans(sc):
        for rows in (plan.rows_before[g.group_id], plan.rows_after[g.group_id]):
            for row in rows.values():
                assert len(row) == 3 and NULL_BLOCK not in row.tolist()  # 1 state + 2 speculative
                seen += 1
    assert seen > 50 and sched.summary["preemptions"] >= 1


@pytest.mark.parametrize("W", [1, 2, 4])
def test_align_mode_rows_are_position_indexed_and_released_below_the_state(W, audit):
    sc = hybrid(W=W, mode="align")
    g = state_geometry(sc)
    assert g.manager_block_size == 16 and g.block_table_width == 2048 // 16 + 2
    audit(sc)  # row lengths, the state window, releases and the state's content, independently
    for plan in plans(sc):
        for w in plan.writes:
            row = plan.rows_before[g.group_id][w.req_index]
            assert len(row) == -(-w.stop // 16) + 2  # cdiv(stop, B) + k entries
            assert NULL_BLOCK not in row[-3:].tolist()  # the state window holds blocks
            assert np.count_nonzero(row) <= 2 * 3 + 1  # at most the old and the new window, and one more


def test_state_manager_allocation_by_hand():
    sc = hybrid(W=2, mode="align")
    g = state_geometry(sc)
    m = StateManager(g, BlockPool(20), ReferenceEngine())
    assert m.num_new_blocks(0, 100) == 3  # cdiv(100, 16) + 2 = 9 entries: 6 null, 3 blocks
    m.allocate(0, 100)
    row = m.held(0)
    assert len(row) == 9 and row[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in row[6:]
    assert m.num_new_blocks(0, 103) == 0  # still 9 entries
    m.allocate(0, 120)  # cdiv(120, 16) + 2 = 10 entries: one more block, the window shifts by one
    assert len(m.held(0)) == 10 and NULL_BLOCK not in m.held(0)[6:]
    # after committing 118 tokens the state after 117 lives in entry >= 117 // 16 = 7: 7 entries go
    assert m.release_skipped(0, 118) == 1  # only entry 6 held a block
    assert m.held(0)[:7] == [NULL_BLOCK] * 7 and m.pool.num_free == 20 - 3
    m.free(0)
    assert m.pool.num_free == 20


def test_pools_give_each_request_its_state_blocks():
    none, align = hybrid(W=4), hybrid(W=4, mode="align")
    engine = ReferenceEngine()
    gn, ga = state_geometry(none), state_geometry(align)
    assert pool_sizes(none, engine, geometries(none))[gn.group_id] == 3 * 3  # 3 requests x (1 + k)
    assert pool_sizes(align, engine, geometries(align))[ga.group_id] == 3 * 7  # 3 x (2 (1 + k) + 1)


def test_the_state_fault_scales_the_manager_but_not_the_kernel():
    from dcpsim.engine.faults import FAULTS

    sc = hybrid(W=2, mode="align")
    fault = FAULTS["mamba-block-size-scaled-by-w"]
    (bad,) = [g for g in fault.geometries(sc.layers, sc.config) if g.storage is Storage.STATE]
    good = state_geometry(sc)
    assert (good.manager_block_size, bad.manager_block_size) == (16, 32)
    assert bad.block_size == good.block_size == 16 and bad.block_table_width == good.block_table_width
    # the manager believes 300 tokens need cdiv(300, 32) + 2 = 12 entries, the kernel indexes 299 // 16 = 18
    assert fault.blocks_needed(bad, 300) == 12 and ReferenceEngine().blocks_needed(good, 300) == 21
    # in none mode one block spans the whole request, so the scaled size changes nothing
    nb = [g for g in fault.geometries(hybrid(W=2).layers, hybrid(W=2).config) if g.storage is Storage.STATE][0]
    assert fault.blocks_needed(nb, 2048) == ReferenceEngine().blocks_needed(state_geometry(hybrid(W=2)), 2048) == 3
