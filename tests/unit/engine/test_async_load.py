"""Asynchronous P/D loads into recycled blocks (``engine.async_load``, P/D class 8, vllm#54875): the
scheduler's loads and the blocks it has cleared, what a completed load clears, the checker's page-tail
judge over a stand-in rank, and the ``load_steps`` field's rules (no worlds)."""

from __future__ import annotations

import dataclasses
import tomllib

import numpy as np
import pytest

from dcpsim.engine.async_load import AsyncLoadEngine, AsyncLoadScheduler, LoadClear, clear_slots
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.connector import PromptLoads
from dcpsim.engine.faults import get_pd_fault
from dcpsim.engine.worker.kv_store import KVStore
from dcpsim.errors import ConfigError
from dcpsim.harness.pd_job import PDJob, prepare_pd
from dcpsim.model.kv_entry import EMPTY
from dcpsim.model.plan import RequestView
from dcpsim.scenarios.dump import scenario_to_toml
from dcpsim.scenarios.load import load_scenario, scenario_from_dict
from dcpsim.scenarios.pd import instance_scenario
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.page_tail import judge_page_tails, local_length

BUILTIN = "pd-async-recycled"


def decode_schedule(load_steps: int = 2, decode_w: int = 4):
    s = load_scenario(BUILTIN)
    pd = s.disaggregated
    s = dataclasses.replace(
        s, disaggregated=dataclasses.replace(pd, decode=dataclasses.replace(pd.decode, decode_context_parallel_size=decode_w))
    )
    sc = instance_scenario(s, "decode")
    engine, loads = AsyncLoadEngine(), PromptLoads(load_steps=load_steps)
    scheduler = engine.make_scheduler(sc, engine.geometries(sc.layers, sc.config), connector=loads)
    return sc, scheduler, loads, list(scheduler.plans())


def test_a_load_holds_its_blocks_unscheduled_while_its_parts_arrive_then_the_request_is_admitted():
    sc, scheduler, loads, plans = decode_schedule(load_steps=2)
    assert isinstance(scheduler, AsyncLoadScheduler)
    names = {r.request_id: i for i, r in enumerate(sc.requests)}
    early = names["early-0"]
    # step 0: the blocks of its 119 loaded tokens (two blocks of 64 at W = 4), no write, not running
    assert len(plans[0].rows_before[0][early]) == 2 and not plans[0].writes and not plans[0].views
    assert plans[0].loaded == ()  # not the synchronous path
    parts = {}
    for plan in plans:
        for req, part, of in loads.load_parts.get(plan.step, []):  # already consumed? the scheduler keeps them
            parts.setdefault(req, []).append((plan.step, part, of))
    first_write = {}
    for plan in plans:
        for w in plan.writes:
            first_write.setdefault(w.request_id, (plan.step, w.start))
    # two parts, before steps s and s + 1; scheduled from s + 2, computing its last prompt token
    assert parts[early] == [(0, 0, 2), (1, 1, 2)]
    assert first_write["early-0"] == (2, 119)
    assert plans[2].loaded == ((early, 119), (names["early-1"], 119))  # its admission reports the loaded tokens
    assert "admitted early-0 with 119 tokens from the kv connector" in [str(e) for e in plans[2].events]
    late = names["late-0"]
    assert parts[late] == [(6, 0, 2), (7, 1, 2)] and first_write["late-0"] == (8, 99)
    with_three = decode_schedule(load_steps=3)[3]
    assert min(p.step for p in with_three if any(w.request_id == "early-0" for w in p.writes)) == 3


def test_new_blocks_are_cleared_before_use_except_those_a_load_fills():
    sc, _, loads, plans = decode_schedule(load_steps=2)
    zeroed = {step: ids for step, by_group in loads.to_zero.items() for ids in by_group.values() if ids}
    # late-1 (62 tokens) reaches position 64 while decoding: its second block, recycled, is cleared that step
    late1 = [i for i, r in enumerate(sc.requests) if r.request_id == "late-1"][0]
    grown = [p.step for p in plans if late1 in p.rows_before[0] and len(p.rows_before[0][late1]) == 2]
    assert grown and zeroed == {grown[0]: [int(plans[grown[0]].rows_before[0][late1][1])]}
    # the blocks the loads filled, all recycled at step 6, were not on the list of the steps that allocated them
    starts = [p.step for p in plans if any(part == 0 for _, part, _ in loads.load_parts.get(p.step, []))]
    assert starts == [0, 6] and not any(zeroed.get(step) for step in starts)
    assert plans[-1].step >= 6 and scheduler_reused(sc) > 0


def scheduler_reused(sc) -> int:
    _, scheduler, _, _ = decode_schedule()
    return scheduler.summary["reused_blocks"]


def test_a_completed_load_clears_everything_it_did_not_write_and_the_fault_keeps_the_tails():
    written = np.array([0, 1, 2, 3, 16, 17, 18, 19, 20], np.int64)  # 3 pages of 16: page 1 partly, page 2 empty
    cleared = LoadClear().cleared(3, 16, written)
    assert set(cleared.tolist()) == set(range(48)) - set(written.tolist())
    kept = get_pd_fault("nixl-page-tail-not-cleared").load_clear().cleared(3, 16, written)
    assert kept.tolist() == list(range(32, 48))  # only the empty page: the tails of pages 0 and 1 stay


def stale_store(page: int = 4) -> KVStore:
    store = KVStore(0, 4, page)
    rows = np.tile(np.array([0, 7, 70, 9, 3], np.int64), (4 * page, 1))
    rows[:, 1] = np.arange(4 * page)
    store.write(np.arange(4 * page), rows)  # every slot holds an earlier request's entry
    return store


class OneStoreView:
    """A stand-in ``RankView`` over one store and a block table."""

    def __init__(self, store, rows):
        self.store, self.rows = store, rows

    def group_of_layer(self, name):
        return 0

    def block_table_row(self, group, req):
        return np.asarray(self.rows[req], np.int64)

    def read_entries(self, group, slots):
        return self.store.read(slots)


def test_the_page_tail_judge_names_a_stale_slot_past_the_local_length_and_passes_cleared_pages():
    s = load_scenario(BUILTIN)
    sc = instance_scenario(s, "decode")  # W = 4, I = B = 16
    group = expected_groups(sc)[0]
    view = RequestView(0, "late-0", 100, np.zeros(100, np.int64))
    assert [local_length(group, view, r) for r in range(4)] == [32, 32, 20, 16]
    store = KVStore(0, 4, 16)
    for rank, want in ((2, 20), (3, 16)):
        store = stale_store(16)
        rank_view = OneStoreView(store, {0: [1, 2]})
        found = judge_page_tails([group], rank_view, [view], rank, {9: "early-0"})
        assert len(found) == 1 and f"past its {want} local entries" in found[0] and "request early-0" in found[0]
        assert f"decode rank {rank}: request late-0" in found[0]
        clear_slots(store, np.array([1, 2]), LoadClear().cleared(2, 16, np.arange(want)))
        assert judge_page_tails([group], rank_view, [view], rank) == []
        assert (store.read(np.arange(16, 16 + want)) != EMPTY).all()  # the entries it holds are kept
    # a page past the length on a rank that holds the request's whole row (rank 0: 32 entries, 2 pages)
    assert judge_page_tails([group], OneStoreView(stale_store(16), {0: [1, 2]}), [view], 0) == []


def test_load_steps_parses_dumps_and_is_refused_where_it_cannot_hold():
    s = load_scenario(BUILTIN)
    assert s.disaggregated.load_steps == 2 and load_scenario("pd-dsv3").disaggregated.load_steps == 0
    again = scenario_from_dict(tomllib.loads(scenario_to_toml(s)), source="again.toml")
    assert again.disaggregated.load_steps == 2
    bad = scenario_to_toml(s).replace("load_steps = 2", "load_steps = -1")
    with pytest.raises(ConfigError, match=r"disaggregated.load_steps: must be an integer >= 0"):
        scenario_from_dict(tomllib.loads(bad), source="bad.toml")
    plugin = "the asynchronous loads are dcpsim's scheduler's; --engine dcpsim.engine.example_plugin"
    with pytest.raises(ConfigError, match=f"disaggregated.load_steps 2: {plugin}"):
        PDJob(s, engine=EngineChoice(name="dcpsim.engine.example_plugin:ExampleEngine"))
    for field, value, why in (
        ("num_speculative_tokens", 1, "num_speculative_tokens must be 0"),
        ("enable_prefix_caching", True, "enable_prefix_caching must be false"),
    ):
        other = dataclasses.replace(s, config=dataclasses.replace(s.config, **{field: value}))
        with pytest.raises(ConfigError, match=why):
            PDJob(other)
    with pytest.raises(ConfigError, match="changes the decode instance's engine"):
        PDJob(s, inject="nixl-interleave-not-block-size")
    summaries = prepare_pd(PDJob(s))
    assert summaries["decode"]["finished"] == len(s.requests) and summaries["decode"]["reused_blocks"] > 0
