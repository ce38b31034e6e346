"""``BlockPool``: block ids of one group, the reserved null block, ref counts."""

from __future__ import annotations

import pytest

from dcpsim.engine.scheduler.block_pool import BlockPool
from support.helpers import make_scenario as scenario
from support.helpers import mla_spec as mla
from support.helpers import request_spec as R
from support.helpers import scheduler


def test_block_zero_never_allocated():
    pool = BlockPool(5)
    got = pool.allocate(5)
    assert sorted(got) == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([0, got[0]])  # freeing the null block is a no-op
    assert pool.num_free == 1 and pool.allocate(1) == [got[0]]


def test_finished_requests_blocks_are_reused():
    # 4 blocks of 32 tokens (B=16, W=2); "a" needs cdiv(100, 32) = 4: all of them. "b" arrives
    # later and can only run on a's blocks once a finishes (the pool counts the reuse).
    layers = {"mla.0": mla(16)}
    reqs = [R("a", 90, 10), R("b", 90, 10, arrival_step=1)]
    sc = scenario(layers, reqs, W=2, num_gpu_blocks=4, budget=128, prefix=False)
    sched = scheduler(sc)
    a_blocks, b_blocks = set(), set()
    for plan in sched.plans():
        a_blocks |= {int(b) for b in plan.rows_before[0].get(0, [])}
        b_blocks |= {int(b) for b in plan.rows_before[0].get(1, [])}
    assert a_blocks == b_blocks == {1, 2, 3, 4}
    assert sched.summary["reused_blocks"] >= 4
    assert sched.summary["preemptions"] == 0


def test_a_key_stays_findable_while_any_block_holding_it_is_cached():
    # two requests computed the same prefix block before either found it cached: both blocks
    # hold the key (vLLM's BlockHashToBlockMap keeps every one); handing out the first leaves
    # the key findable through the second, handing out both drops it (fuzz --seed 5 found the
    # reference losing a hit the cache allowed when the pool kept one block a key)
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache("prefix", a)
    pool.cache("prefix", b)
    pool.cache("other", a)  # a block holds one key: the first it was cached under
    assert pool.lookup("prefix") == a
    pool.free([a, b, c])  # the free queue's order: a, b, c
    assert pool.allocate(1) == [a] and pool.lookup("prefix") == b
    assert pool.allocate(1) == [b] and pool.lookup("prefix") is None
