"""Speculative decoding under Helix's layout end to end, in process (test_helix_runs has the
reference passing the built-in ``helix-spec-decode``, with ``--attention`` too):
``helix-verify-fixed-draft-len`` (bug class 51) and an engine whose verify
mask follows vLLM's layout are caught by the checker's own Helix derivation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcpsim.engine.faults.registry import get_fault
from dcpsim.engine.interface import Engine
from dcpsim.engine.reference import HelixGeometry, ReferenceEngine
from dcpsim.model.scenario import ScenarioOverrides
from dcpsim.scenarios.load import load_scenario
from support.helpers import run

FAULT = "helix-verify-fixed-draft-len"


def helix_spec(W: int, **changes):
    return load_scenario("helix-spec-decode").with_overrides(ScenarioOverrides(decode_context_parallel_size=W, **changes))


class VllmMaskUnderHelix(ReferenceEngine):
    """Builds the verify mask from vLLM's layout (``Engine``'s default, I = B) under Helix."""

    def spec_decode_mask(self, geometry, context_lens, query_lens, dcp_rank):
        return Engine.spec_decode_mask(self, geometry, context_lens, query_lens, dcp_rank)


def verify_rows(scenario):
    """Each step's decode rows ``(request, tokens)`` in batch order, on the reference's schedule."""
    engine = ReferenceEngine()
    scheduler = engine.make_scheduler(scenario, engine.geometries(scenario.layers, scenario.config))
    return [[(w.request_id, len(w.contents)) for w in plan.writes if not w.prefill] for plan in scheduler.plans()]


def test_the_builtin_runs_rows_of_different_draft_lengths_in_one_step():
    """The rows the fault misplaces: a row shorter than 1 + k before another row of the step."""
    k = helix_spec(2).config.num_speculative_tokens
    steps = verify_rows(helix_spec(2))
    short_first = [rows for rows in steps if len(rows) > 1 and any(n < 1 + k for _, n in rows[:-1])]
    assert len(short_first) >= 2, steps
    assert {n for rows in steps for _, n in rows} >= {1, 3, 4}


@pytest.mark.parametrize("W", [2, 4])
def test_fixed_draft_len_fault_is_caught(W):
    report = run(helix_spec(W), engine=get_fault(FAULT))
    assert not report.passed and report.failure.kind in ("write-violation", "wrong-content"), report.failure
    assert report.failure.step == 4  # request a's row of 1 token comes before b's and c's rows of 4


def test_fixed_draft_len_fault_is_the_reference_where_every_row_runs_every_draft():
    """Rows of 1 + k tokens everywhere (outputs of 1 + m (1 + k) tokens, every draft accepted):
    the fixed grouping is right and the fault passes; so what it is caught for is the rows'
    own draft counts."""
    sc = helix_spec(2)
    k = sc.config.num_speculative_tokens
    requests = tuple(dataclasses.replace(r, output_len=1 + 3 * (1 + k), acceptance=(k,), arrival_step=0) for r in sc.requests)
    sc = dataclasses.replace(sc, requests=requests)
    assert all(n == 1 + k for rows in verify_rows(sc) for _, n in rows)
    assert run(sc, engine=get_fault(FAULT)).passed


@pytest.mark.parametrize("W", [2, 4])
def test_a_verify_mask_from_vllms_layout_is_caught(W):
    """The checker judges each verify row's mask by Helix's placement of the row's request."""
    report = run(helix_spec(W), engine=VllmMaskUnderHelix())
    assert not report.passed and report.failure.kind == "attention-mask", report.failure


def test_reference_mask_rows_follow_the_rows_of_the_step():
    """The reference's Helix mask is asked by (context, tokens) alone; it takes each row's request
    from the step's writes and refuses rows that are not the step's verify rows."""
    sc = helix_spec(2)
    engine = ReferenceEngine()
    geometries = engine.geometries(sc.layers, sc.config)
    g = next(g for g in geometries if isinstance(g, HelixGeometry))
    scheduler = engine.make_scheduler(sc, geometries)
    plans = list(scheduler.plans())
    plan = next(p for p in plans if sum(not w.prefill for w in p.writes) > 1)
    rows = [np.zeros(8, np.int64) + i for i in range(len(plan.writes))]
    engine.step_write_slots(g, list(plan.writes), rows, 0)
    decodes = [w for w in plan.writes if not w.prefill]
    ctx = np.array([w.start for w in decodes])
    q = np.array([len(w.contents) for w in decodes])
    masks = engine.spec_decode_mask(g, ctx, q, 0)
    assert [m.shape[0] for m in masks] == q.tolist()
    with pytest.raises(ValueError, match="verify mask asked for rows"):
        engine.spec_decode_mask(g, ctx[::-1].copy(), q[::-1].copy(), 0)
