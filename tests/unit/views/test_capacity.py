"""The capacity planner's figures: tied to the spec model, to the pools and stores a run
actually allocates, and to hand-computed examples of semantics section 3."""

from __future__ import annotations

import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import pool_sizes
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Retention, Storage
from dcpsim.scenarios.registry import builtin_scenario_names
from dcpsim.views import capacity as cap
from support.helpers import (
    builtin,
    full_rep_spec,
    geometries,
    make_scenario,
    mla_spec,
    request_spec,
    ring_spec,
    scheduler,
    swa_spec,
)

CELLS = [(name, W) for name in builtin_scenario_names() for W in (1, 2, 4, 8)]


def valid(name, W):
    try:
        sc = builtin(name, W)  # a stated head layout may be refused at this W (gqa-pcp2-heads at W = 4, 8)
        geometries(sc)
    except ConfigError:
        pytest.skip(f"{name} is not valid at W={W}")
    return sc


@pytest.mark.parametrize("name,W", CELLS)
def test_the_planner_agrees_with_the_spec_model_and_the_run_pools(name, W):
    sc = valid(name, W)
    sched = scheduler(sc)
    col = cap.column(sc, None)
    assert [g.name for g in col.groups] == [m.geometry.name for m in sched.managers]
    runner = ModelRunner(sched.engine, sched.geometries, pool_sizes(sc, sched.engine, sched.geometries), 0, max_num_reqs=len(sc.requests))
    for g, m, store in zip(col.groups, sched.managers, runner.stores):
        geo, config = m.geometry, sc.config
        layer_specs = [sc.layers[n] for n in geo.layer_names]
        # the spec model, layer by layer
        assert g.layer_page_size_bytes == geo.page_size_bytes
        assert g.layer_max_memory_usage_bytes == geo.max_memory_usage_bytes
        assert g.page_size_bytes == sum(s.page_size_bytes for s in layer_specs)
        assert g.max_memory_usage_bytes == sum(s.max_memory_usage_bytes(config) for s in layer_specs)
        assert g.layers == len(geo.layer_names) and g.sharded == geo.sharded
        # what the run allocates: the scheduler's pool and the worker's store
        assert g.pool_blocks == m.pool.num_blocks
        assert tuple(store.data.shape[:2]) == (g.pool_blocks + 1, g.states_per_page)  # + the null block
        assert g.pool_bytes == m.pool.num_blocks * g.page_size_bytes
        if geo.storage is Storage.RING:
            assert g.blocks_per_request == 1 and g.pool_tokens is None and g.bytes_per_token is None
            continue
        if geo.storage is Storage.STATE:  # Mamba: a few state blocks a request, no token capacity
            assert g.pool_tokens is None and g.bytes_per_token is None
            continue
        assert g.tokens_per_block_entry == geo.manager_block_size
        assert g.pool_tokens == m.pool.num_blocks * geo.manager_block_size
        assert g.bytes_per_token == g.page_size_bytes / geo.manager_block_size
        if geo.retention is Retention.FULL:  # a request at max_model_len fills a row (widened to 128 tokens)
            need = sched.engine.blocks_needed(geo, config.max_model_len)
            spare = 1 if config.kv_cache_layout == "helix" else 0  # Helix's spare entry a row (semantics section 15)
            assert g.blocks_per_request == need == geo.group_spec.max_num_blocks_per_req(config, config.max_model_len) + spare
            assert need <= geo.block_table_width < need + 128
    assert col.concurrency == min(g.concurrency for g in col.groups)
    assert col.context_tokens == int(col.concurrency * sc.config.max_model_len)
    assert col.max_memory_per_request == sum(g.max_memory_usage_bytes for g in col.groups)


def test_semantics_section_3_example_sharded_and_replicated():
    """max_model_len 1000, W = 2, B = 16: 32 pages sharded, 63 pages replicated."""
    sc = make_scenario(
        {"mla": mla_spec(16), "rep": full_rep_spec(16)}, [request_spec("a", 100, 10)], W=2, max_len=1000, kv_cache_tokens=2000
    )
    sharded, replicated = cap.column(sc, None).groups
    assert (sharded.sharded, sharded.blocks_per_request) == (True, 32)
    assert (replicated.sharded, replicated.dcp_replicated, replicated.blocks_per_request) == (False, True, 63)
    # MLA: one latent head of 64 bf16 values per state; full: 1 head, K and V of 8 bf16 each
    assert sharded.page_size_bytes == 16 * 64 * 2 and sharded.bytes_per_token == 2048 / 32
    assert replicated.page_size_bytes == 16 * 16 * 2 and replicated.bytes_per_token == 512 / 16
    assert replicated.if_sharded_bytes == 32 * 512  # the spec model with dcp_replicated off
    # the scenario's pools: cdiv(2000, B * W) and cdiv(2000, B) blocks
    assert (sharded.pool_blocks, replicated.pool_blocks) == (63, 125)
    assert (sharded.pool_tokens, replicated.pool_tokens) == (63 * 32, 125 * 16)
    col = cap.column(sc, None)
    assert col.concurrency == min(63 / 32, 125 / 63)
    assert col.replicated_per_request == 63 * 512 and col.replicated_if_sharded == 32 * 512


def test_a_budget_is_one_shared_pool_of_blocks_as_large_as_the_largest_page():
    layers = {f"mla.{i}": mla_spec(16) for i in range(3)} | {"rep": full_rep_spec(16)}
    sc = make_scenario(layers, [request_spec("a", 100, 10)], W=4, max_len=1000)
    col = cap.column(sc, cap.Budget(1, 0.5))
    mla, rep = col.groups
    assert mla.page_size_bytes == 3 * 2048 and rep.page_size_bytes == 512
    assert col.block_bytes == 3 * 2048 and col.num_blocks == (1 << 29) // (3 * 2048)
    assert (mla.blocks_per_request, rep.blocks_per_request) == (16, 63)
    assert col.concurrency == col.num_blocks / (16 + 63)
    assert col.context_tokens == int(col.num_blocks / 79 * 1000)
    assert (mla.padding_bytes_per_block, rep.padding_bytes_per_block) == (0, 3 * 2048 - 512)
    # without padding: the budget over 16 pages of 6 KiB and 63 of 512 bytes
    assert col.concurrency_without_padding == (1 << 29) / (16 * 3 * 2048 + 63 * 512)
    assert col.concurrency_without_padding > col.concurrency
    # each group's share of the pool at that concurrency
    assert mla.pool_blocks == col.num_blocks * 16 // 79 and rep.pool_blocks == col.num_blocks * 63 // 79
    # equal group pages (one MLA layer, four sliding-window layers) share the pool without padding
    even = make_scenario(
        {"mla": mla_spec(16)} | {f"swa.{i}": swa_spec(B=16, window=64) for i in range(4)}, [request_spec("a", 100, 10)], W=2, max_len=1000
    )
    same = cap.column(even, cap.Budget(1))
    assert [g.page_size_bytes for g in same.groups] == [2048, 2048] and same.block_bytes == 2048
    assert [g.padding_bytes_per_block for g in same.groups] == [0, 0]
    # the window's admission cap: cdiv(min(63 + 64 in flight, 1000), 16) + 1 blocks
    assert same.groups[1].blocks_per_request == 9 and same.num_blocks == (1 << 30) * 9 // 10 // 2048


def test_the_budget_column_of_dsv3_matches_bytes_per_token():
    """dsv3 at W = 4 on 80 GiB * 0.9: one group, so the context is the budget over bytes per token."""
    sc = builtin("dsv3", 4)
    col = cap.column(sc, cap.Budget(80))
    (g,) = col.groups
    assert g.page_size_bytes == 61 * 64 * 656 and col.num_blocks == int(80 * 0.9 * (1 << 30)) // g.page_size_bytes
    assert g.padding_bytes_per_block == 0
    assert col.context_tokens == int(col.num_blocks / g.blocks_per_request * 4096)
    assert abs(col.context_tokens * g.bytes_per_token - 80 * 0.9 * (1 << 30)) < g.page_size_bytes


@pytest.mark.parametrize("pool", [{"num_gpu_blocks": 40}, {"kv_cache_tokens": 300}, {}])
def test_every_pool_setting_gives_the_run_pools(pool):
    """num_gpu_blocks, kv_cache_tokens, or room for every request at once; a ring holds a block a request."""
    layers = {"mla": mla_spec(16), "rep": full_rep_spec(16), "swa": swa_spec(B=16, window=32), "ring": ring_spec(8)}
    requests = [request_spec(f"r{i}", 40 + 30 * i, 6) for i in range(3)]
    sc = make_scenario(layers, requests, W=2, k=2, max_len=512, **pool)
    col = cap.column(sc, None)
    assert [g.pool_blocks for g in col.groups] == [m.pool.num_blocks for m in scheduler(sc).managers]
    assert [g.pool_blocks for g in col.groups] == pool_sizes(sc, ReferenceEngine(), geometries(sc))
