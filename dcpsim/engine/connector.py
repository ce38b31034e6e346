"""The engine side of a KV connector (disaggregated prefill/decode).

* ``KVConnector.routes``: which prefill rank's local indices go to which decode rank's
  (``NixlConnector``: whole blocks, ``ReshardingConnector``: position by position; the math
  is ``dcpsim.model.connector``).
* ``read_pages``: a prefill rank reads a finished prompt's pages through its block table,
  as NIXL reads the remote blocks: entry ``l`` of the result is local index ``l``.
* ``PromptLoads``: the scheduler side of the decode instance's connector (vLLM's
  ``get_num_new_matched_tokens``): a request's prompt KV is loaded on its first admission,
  all but the last prompt token counted as computed (vLLM recomputes that one so the next
  token can be sampled: ``Scheduler._update_waiting_for_remote_kv``). Every engine's
  scheduler takes it (``Engine.make_scheduler(..., connector=...)``); ``LoadedScheduler``
  is dcpsim's scheduler with it.
* ``write_loaded``: a decode rank writes the received entries at the slots its own block
  table gives for their local indices, before the step that admitted the request runs.
"""

from __future__ import annotations

import numpy as np

from dcpsim.engine.scheduler.request import Request
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.model.connector import InstanceLayout, Route, block_matches, token_routes
from dcpsim.model.kv_entry import EMPTY, FIELDS, GROUP
from dcpsim.model.plan import StepPlan


class KVConnector:
    name = ""

    def routes(self, num_tokens: int, src: InstanceLayout, dst: InstanceLayout) -> list[Route]:
        raise NotImplementedError


class NixlConnector(KVConnector):
    """vLLM's NixlConnector: decode rank ``d`` pulls global blocks ``d, d + N_dst, ...``,
    each whole from the prefill rank holding it."""

    name = "nixl"

    def routes(self, num_tokens, src, dst):
        return block_matches(num_tokens, src, dst)


class ReshardingConnector(KVConnector):
    """Moves every position from its prefill owner to its decode owner: any two layouts."""

    name = "resharding"

    def routes(self, num_tokens, src, dst):
        return token_routes(num_tokens, src, dst)


CONNECTORS = {c.name: c for c in (NixlConnector, ReshardingConnector)}


def read_pages(runner: ModelRunner, group: int, row: np.ndarray) -> np.ndarray:
    """``[len(row) * B, 5]``: the entries of the blocks of ``row`` of one group, in local order."""
    store = runner.stores[group]
    row = np.asarray(row, dtype=np.int64)
    return store.data[row].reshape(-1, len(FIELDS)).numpy().copy()


def gather_entries(pages: np.ndarray, local: np.ndarray) -> np.ndarray:
    """The entries at local indices ``local`` (EMPTY rows past the pages)."""
    out = np.full((len(local), len(FIELDS)), EMPTY, dtype=np.int64)
    ok = (local >= 0) & (local < len(pages))
    out[ok] = pages[local[ok]]
    return out


class PromptLoads:
    """The decode instance's connector, as its scheduler sees it: prompts arrive with their
    KV (see the module doc). A preempted request recomputes locally, as in vLLM."""

    def external_tokens(self, req: Request) -> int:
        """Tokens of ``req`` the connector loads on admission (vLLM's ``get_num_new_matched_tokens``)."""
        return 0 if req.num_preemptions else req.spec.prompt_len - 1


PROMPT_LOADS = PromptLoads()


class LoadedScheduler(Scheduler):
    """dcpsim's scheduler of a decode instance (``PromptLoads``): the parent's dry run."""

    def __init__(self, scenario, engine, geometries):
        super().__init__(scenario, engine, geometries, connector=PROMPT_LOADS)


def write_loaded(plan: StepPlan, runner: ModelRunner, received: dict) -> int:
    """Write the entries of every request ``plan`` admits with loaded KV; ``received[req][group]``
    is (decode local indices, entries). Returns the entries written."""
    count = 0
    for req_index, _ in plan.loaded:
        for g, (geometry, store) in enumerate(zip(runner.geometries, runner.stores)):
            local, entries = received.get(req_index, {}).get(g, (np.zeros(0, np.int64), None))
            if not len(local):
                continue
            row = np.asarray(plan.rows_before[g][req_index], dtype=np.int64)
            page = store.states_per_page
            block = local // page
            ok = (block < len(row)) & (entries[:, GROUP] != EMPTY)
            slots = row[block[ok]] * page + local[ok] % page
            rows = entries[ok].copy()
            rows[:, GROUP] = geometry.group_id
            store.write(slots, rows)
            count += len(slots)
    return count
