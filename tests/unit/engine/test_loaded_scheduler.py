"""The decode instance's scheduler: each prompt arrives with its KV, all but the last token computed."""

from __future__ import annotations

from dcpsim.engine.connector import LoadedScheduler, gather_entries
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kv_entry import EMPTY
from dcpsim.model.plan import EventKind
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.pd import instance_scenario


def test_admission_loads_all_but_the_last_prompt_token_and_the_plan_says_so():
    scenario = instance_scenario(load_scenario("pd-dsv3"), "decode")
    engine = ReferenceEngine()
    scheduler = LoadedScheduler(scenario, engine, engine.geometries(scenario.layers, scenario.config))
    first = scheduler.step()
    prompts = {r.request_id: r.prompt_len for r in scenario.requests}
    assert {(scheduler.requests[i].request_id, n) for i, n in first.loaded} == {(k, v - 1) for k, v in prompts.items()}
    for w in first.writes:  # the step recomputes the last prompt token (plus a draft)
        assert w.start == prompts[w.request_id] - 1
    assert any(e.kind is EventKind.ADMITTED and e.loaded for e in first.events)
    assert any("from the kv connector" in str(e) for e in first.events)  # as a timeline shows it
    assert all(not scheduler.step().loaded for _ in range(3))


def test_entries_past_the_pages_read_as_empty():
    import numpy as np

    pages = np.arange(10).reshape(2, 5)
    got = gather_entries(pages, np.array([1, 0, 7]))
    assert got[:2].tolist() == [[5, 6, 7, 8, 9], [0, 1, 2, 3, 4]] and (got[2] == EMPTY).all()
