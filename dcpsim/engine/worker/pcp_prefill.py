"""Prefill context parallelism on one rank: compute this PCP rank's chunks of every split
prefill row, all-gather the chunks' KV across the PCP group, and put the gathered rows back
in query order, so the worker then writes what the DCP slot mapping gives this rank.

"Computing" a token's KV is producing its fingerprint (``ReqWrite.contents``, a function
of the position and the token prefix), so a correct split, gather and restore hands the
worker exactly the plan's contents; a rank that gathers wrongly hands it other rows' KV or
``MISSING_KV`` (no rank computed that token), which the checker sees as wrong content.
The engine makes every decision (``Engine.pcp_*``); the gather is one real collective
over the PCP group (``pcp``, a ``Collectives``) per step that has split rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from dcpsim.engine.interface import Engine
from dcpsim.model.plan import PcpQueryKeys, StepPlan

MISSING_KV = 0
"""The content of a query token whose KV no PCP rank produced (never a real fingerprint)."""

GATHER_PHASE = "pcp kv gather"
"""The progress phase of a rank inside the PCP all-gather (named in hang reports)."""


def split_rows(engine: Engine, plan: StepPlan, pcp: int, dcp: int) -> list[int]:
    """Indices of the step's writes the PCP group splits (the rest are replicated)."""
    if pcp == 1:
        return []
    return [i for i, w in enumerate(plan.writes) if not engine.pcp_replicated(len(w.contents), w.prefill, pcp, dcp)]


def pcp_prefill(
    engine: Engine,
    plan: StepPlan,
    pcp_coll,
    pcp_rank: int,
    pcp: int,
    dcp: int,
    on_phase: Callable[[str], None] = lambda what: None,
    keys_log: list[PcpQueryKeys] | None = None,
) -> StepPlan:
    """The step's plan with each split row's contents as this rank holds them after the
    PCP gather (the plan itself when nothing is split); ``keys_log`` gets each split row's
    PCP attention metadata (``Engine.pcp_query_keys``), which the checker judges."""
    split = split_rows(engine, plan, pcp, dcp)
    if not split:
        return plan
    if keys_log is not None:
        for i in split:
            w = plan.writes[i]
            queries, spans = engine.pcp_query_keys(len(w.contents), pcp, pcp_rank)
            queries, spans = np.asarray(queries, np.int64), np.asarray(spans, np.int64)
            keys_log.append(PcpQueryKeys(w.request_id, w.start, len(w.contents), queries, spans))
    writes = list(plan.writes)
    mine = []
    for i in split:
        w = writes[i]
        pieces = engine.pcp_chunks(len(w.contents), pcp, pcp_rank)
        mine.append(np.concatenate([w.contents[o : o + n] for o, n in pieces] or [np.zeros(0, np.int64)]).astype(np.int64))
    rows = [(writes[i].start, len(writes[i].contents)) for i in split]
    if engine.pcp_enters_gather(rows, pcp, pcp_rank):
        on_phase(GATHER_PHASE)
        gathered = pcp_coll.all_gather_object(mine)
    else:  # the rank holds only what it computed
        gathered = [mine if r == pcp_rank else [np.zeros(0, np.int64)] * len(split) for r in range(pcp)]
    for k, i in enumerate(split):
        w = writes[i]
        q = len(w.contents)
        rows_in = np.concatenate([np.asarray(gathered[r][k], np.int64) for r in range(pcp)])
        offsets = np.asarray(engine.pcp_restore_offsets(q, pcp), np.int64)
        n = min(len(rows_in), len(offsets))
        contents = np.full(q, MISSING_KV, np.int64)
        keep = (offsets[:n] >= 0) & (offsets[:n] < q)
        contents[offsets[:n][keep]] = rows_in[:n][keep]
        writes[i] = dataclasses.replace(w, contents=contents)
    return dataclasses.replace(plan, writes=tuple(writes))
