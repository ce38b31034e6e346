"""Asynchronous P/D loads into recycled blocks (vLLM's ``WAITING_FOR_REMOTE_KVS``; P/D class 8, vllm#54875).

With ``[disaggregated] load_steps = L`` (``L >= 1``) the decode instance's KV connector loads a
prompt asynchronously, as vLLM's NixlConnector does (``load_kv_async``):

* ``AsyncLoadScheduler``: a waiting request whose prompt KV the connector loads gets the blocks of
  its loaded tokens at once (``allocate_slots`` with the external tokens, no new tokens) and waits
  for its KV without being scheduled; its entries arrive in ``L`` parts, one before each of the next
  ``L`` steps' writes (the first in the step that allocated the blocks); after the last part the
  request waits again, with its loaded tokens computed, and is admitted as any waiting request (it
  computes its last prompt token). Loads in flight count against ``max_num_seqs``.
* Recycled blocks hold what their last request wrote (a freed block keeps its KV). The decode
  instance clears every block newly allocated in a step before the step writes (vLLM's
  ``new_block_ids_to_zero``, needed where a kernel reads whole pages: FlashInfer-TRTLLM or FA3
  with an FP8 cache mask unused slots by multiplying by zero, and ``0 * NaN`` is NaN), except the
  blocks an asynchronous load fills (``skip_zeroing_group_ids``: clearing them would race the
  transfer). ``PromptLoads.to_zero`` carries them per step.
* ``LoadClear``: when the load completes, each rank clears every slot of the request's blocks the
  load did not write: the tail of a partly filled page and any page the load left empty (vLLM 0.34.0
  ``NixlConnectorWorker.post_process_device_kv_on_receive``: "Stale bytes would otherwise surface as
  garbage or NaNs once decode grows into the untransferred tail"). The fault
  ``nixl-page-tail-not-cleared`` keeps the tails.

The checker judges the pages (``verify.page_tail``), not an attention reading them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from dcpsim.engine.connector import PromptLoads, write_entries
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.request import Request
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.model.kv_entry import EMPTY, FIELDS


class AsyncLoadScheduler(Scheduler):
    """dcpsim's scheduler with asynchronous prompt loads (see the module doc); ``connector`` is the
    decode instance's ``PromptLoads`` with ``load_steps >= 1``, and gets the loads' parts and the
    blocks to clear of every step."""

    def __init__(self, scenario, engine, geometries, connector: PromptLoads):
        super().__init__(scenario, engine, geometries, connector=connector)
        self.loading: dict[int, int] = {}
        """Request index -> the step whose write its load's last part arrives before."""
        self._starting = False
        self._parked: list[Request] = []
        self._landed: set[int] = set()
        """Requests whose load completed, not admitted since: their admission reports the loaded tokens."""

    # --- the loads ------------------------------------------------------------------------

    def _arrive(self, step: int) -> None:
        """Requests parked by an idle step wait again, ahead of the arrivals; loads whose last part
        arrived before the previous step's write wait again (first, in the order they started)."""
        self.waiting.extendleft(reversed(self._parked))
        self._parked = []
        super()._arrive(step)
        landed = [self.requests[i] for i, last in self.loading.items() if last < step]
        for req in landed:
            del self.loading[req.index]
            self._landed.add(req.index)
        self.waiting.extendleft(reversed(landed))

    def _admit_waiting(self, budget, scheduled, loaded, events) -> None:
        """Start the loads of the waiting requests first (in order, while the blocks and
        ``max_num_seqs`` allow), then admit the rest. A step where nothing runs while loads are in
        flight is idle: the requests still waiting are parked until the next step (they are not
        stuck, the loads will land)."""
        self._start_loads()
        head = self.waiting[0] if self.waiting else None
        if head is None or not self._needs_load(head):  # a load that could not start holds back those behind it
            super()._admit_waiting(budget, scheduled, loaded, events)
        if not scheduled and not self.running and self.loading and self.waiting:
            self._parked = list(self.waiting)
            self.waiting = deque()

    def _start_from_cache(self, req: Request) -> tuple[int, int]:
        """A request whose load completed starts from its loaded tokens (its admission event and
        ``StepPlan.loaded`` say so; the entries were written as the parts arrived)."""
        if req.index in self._landed:
            self._landed.discard(req.index)
            return 0, req.num_computed
        return super()._start_from_cache(req)

    def _needs_load(self, req: Request) -> bool:
        return not req.num_computed and self.external_tokens(req) > 0

    def _start_loads(self) -> None:
        steps = self.connector.load_steps
        kept: deque[Request] = deque()
        blocked = False
        while self.waiting:
            req = self.waiting.popleft()
            if blocked or not self._needs_load(req):
                kept.append(req)
                continue
            if len(self.running) + len(self.loading) >= self.config.max_num_seqs or self.refused(req):
                blocked = True
                kept.append(req)
                continue
            external = self.external_tokens(req)
            self._starting = True
            try:
                ok = self._try_allocate(req, external)
            finally:
                self._starting = False
            if not ok:  # first come, first served: no later request's load starts before it
                blocked = True
                kept.append(req)
                continue
            req.num_computed = external
            step = self.step_index
            self.loading[req.index] = step + steps - 1
            for k in range(steps):
                self.connector.load_parts.setdefault(step + k, []).append((req.index, k, steps))
        self.waiting = kept

    def _try_allocate(self, req: Request, num_tokens: int) -> bool:
        """The parent's allocation, recording the blocks it newly gave ``req`` to be cleared before
        the step writes, unless an asynchronous load fills them."""
        before = [set(m.held(req.index)) for m in self.managers]
        if not super()._try_allocate(req, num_tokens):
            return False
        if not self._starting:
            zero = self.connector.to_zero.setdefault(self.step_index, {})
            for g, m in enumerate(self.managers):
                new = [b for b in m.held(req.index) if b > 0 and b not in before[g]]
                if new:
                    zero.setdefault(g, []).extend(new)
        return True


class AsyncLoadEngine(ReferenceEngine):
    """The reference engine whose decode-instance scheduler loads prompts asynchronously."""

    def make_scheduler(self, scenario, geometries, connector=None):
        if connector is not None and getattr(connector, "load_steps", 0):
            self.remember_prompts(scenario)
            return AsyncLoadScheduler(scenario, self, geometries, connector)
        return super().make_scheduler(scenario, geometries, connector=connector)


def async_loaded_scheduler(load_steps: int) -> type[Scheduler]:
    """A decode instance's scheduler class for a dry run (``harness.dry_run``): asynchronous loads
    of ``load_steps`` steps."""

    class DryRunAsyncLoads(AsyncLoadScheduler):
        def __init__(self, scenario, engine, geometries):
            super().__init__(scenario, engine, geometries, PromptLoads(load_steps=load_steps))

    return DryRunAsyncLoads


class LoadClear:
    """What a decode rank clears when a request's asynchronous load completes: every local index
    of the request's pages (``pages`` of ``page`` entries) the load did not write (``written``),
    the tail of a partly filled page and any page left empty alike (vLLM 0.34.0's receive
    post-process)."""

    def cleared(self, pages: int, page: int, written: np.ndarray) -> np.ndarray:
        every = np.arange(pages * page, dtype=np.int64)
        return every[~np.isin(every, written)]


def clear_slots(store, row: np.ndarray, local: np.ndarray) -> int:
    """Clear (write EMPTY at) the slots of local indices ``local`` through ``row`` (none at a block
    id below 1); the slots cleared."""
    page = store.states_per_page
    local = np.asarray(local, np.int64)
    block = local // page
    ok = block < len(row)
    ok[ok] = row[block[ok]] > 0
    slots = row[block[ok]] * page + local[ok] % page
    store.write(slots, np.full((len(slots), len(FIELDS)), EMPTY, np.int64))
    return len(slots)


def zero_new_blocks(runner: ModelRunner, blocks: dict[int, list[int]]) -> int:
    """Clear every slot of the newly allocated ``blocks`` (group -> block ids); the slots cleared."""
    count = 0
    for g, ids in blocks.items():
        store = runner.stores[g]
        page = store.states_per_page
        ids = np.asarray(sorted(set(ids)), np.int64)
        count += clear_slots(store, ids, np.arange(len(ids) * page, dtype=np.int64))
    return count


class AsyncLoads:
    """One decode rank's side of the asynchronous loads: before each step's write, clear the step's
    new blocks, then write the parts of the loads that arrive (``PromptLoads.load_parts``), and at a
    load's last part clear what it did not write (``clear``: ``LoadClear``, or a fault's)."""

    def __init__(self, loads: PromptLoads, received: dict, clear: LoadClear | None = None):
        self.loads, self.received, self.clear = loads, received, clear or LoadClear()
        self.written: dict[tuple[int, int], list[np.ndarray]] = {}
        """(request, group) -> the local indices its load has written so far."""

    def before_write(self, plan, runner: ModelRunner) -> int:
        """The step's clearing and load parts; the entries written."""
        zero_new_blocks(runner, self.loads.to_zero.pop(plan.step, {}))
        count = 0
        for req, part, parts in self.loads.load_parts.pop(plan.step, []):
            for g, (geometry, store) in enumerate(zip(runner.geometries, runner.stores)):
                row = np.asarray(plan.rows_before[g].get(req, ()), dtype=np.int64)
                local, entries = self.received.get(req, {}).get(g, (np.zeros(0, np.int64), np.zeros((0, len(FIELDS)), np.int64)))
                mine = (np.arange(len(local)) * parts) // max(len(local), 1) == part
                done = write_entries(geometry.group_id, store, row, local[mine], entries[mine])
                self.written.setdefault((req, g), []).append(done)
                count += len(done)
                if part == parts - 1:
                    written = np.concatenate(self.written.pop((req, g)))
                    clear_slots(store, row, self.clear.cleared(len(row), store.states_per_page, written))
        return count
