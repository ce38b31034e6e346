"""``VllmFullScheduler``: vLLM's v1 ``Scheduler`` drives every step (``--vllm-scheduler full``).

vLLM 0.33.0's ``vllm/v1/core/sched/scheduler.py`` decides which requests run and how many
tokens each (chunked prefill, the token budget, ``long_prefill_token_threshold``,
``max_num_seqs``, the watermark, preemption under pressure and its victim), on its own
``KVCacheManager`` (the manager mode's machinery: ``VllmScheduler`` builds the KV cache
config, the block sizes, the hasher and the requests; here vLLM's scheduler owns the
manager). dcpsim plays the rest of vLLM's engine around it, once a step:

* arrivals: ``Scheduler.add_request`` of each request whose ``arrival_step`` has come;
* ``preempt_at_steps``: the request leaves ``Scheduler.running`` and goes through vLLM's
  own ``Scheduler._preempt_request`` (blocks freed, back at the head of the waiting queue);
* ``Scheduler.schedule()``; its ``SchedulerOutput`` becomes the step's plan
  (``runner_output``: each scheduled request is written from vLLM's ``num_computed_tokens``,
  for its ``num_scheduled_tokens``, the last ``len(scheduled_spec_decode_tokens)`` of them
  drafts), its rows read from vLLM's manager (``get_block_ids``) before anything is freed;
* ``Scheduler.update_from_output`` with a ``ModelRunnerOutput(req_ids, req_id_to_index,
  sampled_token_ids)`` made from the scenario's acceptance pattern (a request that reached
  its last token samples the accepted drafts and one more, true tokens of the scenario);
  vLLM rolls back rejected drafts, appends the tokens and finishes a request at its
  ``max_tokens`` (``check_stop``), freeing its blocks;
* drafts for the next step: ``Scheduler.update_draft_token_ids`` with
  ``min(num_speculative_tokens, tokens left - 1)`` tokens per decoding request, as vLLM's
  engine core hands its drafter's proposals over.

KV events are what vLLM's scheduler publishes (its publisher is the loader's recorder).
A P/D decode instance's connector is handed to vLLM's scheduler as its KV connector
(``dcpsim.engine.vllm.connector``): vLLM's ``schedule()`` asks it how many prompt tokens it
loads, and the plan lists them (``StepPlan.loaded``).
"""

from __future__ import annotations

import dataclasses
import time

from dcpsim.engine.scheduler.request import Request, Status
from dcpsim.engine.vllm import parallel_rules, runner_output
from dcpsim.engine.vllm.connector import scheduler_connector
from dcpsim.engine.vllm.sched_config import NoGrammar, scheduler_vllm_config
from dcpsim.engine.vllm.scheduler import VllmScheduler
from dcpsim.errors import ConfigError
from dcpsim.model.plan import EventKind, KVEvent, PreemptReason, RequestView, ScheduleEvent, StepPlan

SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
FULL_SCHEDULER_DECISIONS = {
    "which requests run, how many tokens each (chunks, token budget, long_prefill_token_threshold)": f"{SCHEDULER}.schedule",
    "admission (waiting order, max_num_seqs, prefix-cache hits, watermark)": f"{SCHEDULER}.schedule",
    "preemption under pressure and its victim": f"{SCHEDULER}.schedule (_preempt_request)",
    "scenario-forced preemption (preempt_at_steps)": f"{SCHEDULER}._preempt_request",
    "speculative tokens scheduled": f"{SCHEDULER}.schedule (scheduled_spec_decode_tokens, from update_draft_token_ids)",
    "rejected-draft rollback, appended tokens, finishing at max_tokens": f"{SCHEDULER}.update_from_output (check_stop)",
    "blocks: allocation, hits, releases, frees": "vllm.v1.core.kv_cache_manager.KVCacheManager, called by the Scheduler",
    "block sizes (scheduler, hash)": "vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes",
    "kv events": f"{SCHEDULER}.update_from_output (KVCacheManager.take_events, published)",
    "contents, acceptance, sampled tokens": "dcpsim (the scenario's tokens and acceptance pattern)",
}
"""Who makes each scheduler-side decision under ``--vllm-scheduler full``."""


class VllmFullScheduler(VllmScheduler):
    def _make_kv_manager(self, kv_cache_config):
        """vLLM's ``Scheduler``, which builds its own ``KVCacheManager`` (returned)."""
        core, config = self.core, self.config
        if config.async_scheduling:
            raise ConfigError(
                "--vllm-scheduler full runs vLLM's synchronous Scheduler; async_scheduling (vLLM's AsyncScheduler) "
                "is not supported (use --vllm-scheduler manager)"
            )
        self._by_id: dict[str, Request] = {r.request_id: r for r in self.requests}
        self._rows_seen: dict[tuple[int, int], set[int]] = {}
        attention_block = self._vllm_config(()).cache_config.block_size
        vllm_config = scheduler_vllm_config(
            config, attention_block, kv_cache_config.num_blocks, parallel_rules.release_sizes(self.vllm_engine.tree, config)
        )
        self.vllm = core.call(
            SCHEDULER,
            core.scheduler_module.Scheduler,
            vllm_config,
            kv_cache_config,
            NoGrammar(),
            block_size=self.block_size,
            hash_block_size=self.hash_block_size,
        )
        self.vllm_connector = None
        if self.connector is not None:  # a P/D decode instance: its connector, where vLLM's factory would put NIXL's
            self.vllm_connector = scheduler_connector(self, self.connector, kv_cache_config, vllm_config)
            self.vllm.connector = self.vllm_connector
            self.vllm_connector.bind_kv_cache_manager(self.vllm.kv_cache_manager)
        return self.vllm.kv_cache_manager

    # --- one step, driven by vLLM's scheduler ---------------------------------------

    def step(self) -> StepPlan:
        """One step as vLLM's engine core runs it: arrivals and forced preemptions, then
        ``schedule()``; the plan's rows are read at once, each scheduled request runs in
        dcpsim's model runner, ``update_from_output()`` takes what it sampled (and frees
        the requests it finishes), then the drafts for the next step are proposed."""
        s = self.step_index
        events: list[ScheduleEvent] = []
        self._arrive(s)
        forced = self._preempt_forced(s, events)
        out = self._vcall("schedule", self.vllm.schedule)
        for rid in sorted(out.preempted_req_ids or ()):
            if rid not in forced:
                self._note_preempted(self._by_id[rid], events, PreemptReason.OUT_OF_BLOCKS)
        self._holding = {self._by_id[v.request_id].index: None for v in self.vllm.running}
        rows = self._rows()
        writes, sampled = [], []
        loaded = self.vllm_connector.take_loaded() if self.vllm_connector is not None else ()
        for rid, n, start in self._scheduled(out):
            req = self._by_id[rid]
            if req.status is not Status.RUNNING:
                self._note_admitted(req, start, events, dict(loaded).get(req.index, 0))
            self._count_reused_in(rows, req, start)
            drafts = list(out.scheduled_spec_decode_tokens.get(rid, ()))
            write, tokens = runner_output.run(req, start, n, drafts, s, events)
            writes.append(write)
            sampled.append(tokens)
        ids = list(out.num_scheduled_tokens)
        output = self._runner_output(ids, sampled)
        if self.vllm_connector is not None:  # the pulls the step's connector metadata started have finished
            output.kv_connector_output = self.vllm_connector.connector_output()
        self._vcall("update_from_output", self.vllm.update_from_output, out, output)
        for rid in ids:  # the hash blocks vLLM's hasher added for the appended tokens
            req = self._by_id[rid]
            self._index_hashes(req, self._vreq(req))
        views = tuple(
            RequestView(r.index, r.request_id, r.num_computed, r.fingerprints, finished=self._vreq(r).is_finished())
            for r in self.running
            if r.num_computed > 0
        )
        self._finish(events)
        self._propose_drafts()
        self.step_index += 1
        self.stats["steps"] = self.step_index
        loading = self.vllm_connector is not None and self.vllm_connector.loading()
        if not out.total_num_scheduled_tokens and not self.running and self.vllm.waiting and not forced and not loading:
            stuck = self._by_id[next(iter(self.vllm.waiting)).request_id]
            raise ConfigError(
                f"request {stuck.request_id!r} can never be admitted by vLLM's scheduler: not enough free blocks "
                "or token budget (raise num_gpu_blocks or max_num_batched_tokens)"
            )
        return StepPlan(
            step=s,
            writes=tuple(writes),
            rows_before=rows,
            views=views,
            rows_after=rows,
            events=tuple(events),
            kv_events=self._published_events(),
            last=self.done,
            loaded=loaded,
        )

    def _scheduled(self, out):
        """(request id, tokens, vLLM's num_computed_tokens before the step) of every
        scheduled request, in the order of ``num_scheduled_tokens``."""
        start = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        return [(rid, n, start[rid]) for rid, n in out.num_scheduled_tokens.items()]

    # --- dcpsim's side of vLLM's decisions ------------------------------------------

    def _arrive(self, step: int) -> None:
        for req in self.requests:
            if req.status is Status.PENDING and req.spec.arrival_step <= step:
                req.status = Status.WAITING
                self._vcall("add_request", self.vllm.add_request, self._vreq(req))

    def _preempt_forced(self, step: int, events: list[ScheduleEvent]) -> set[str]:
        """The scenario's ``preempt_at_steps``, through vLLM's own preemption path."""
        fired = set()
        for req in list(self.running):
            if step in req.spec.preempt_at_steps:
                vreq = self._vreq(req)
                self.vllm.running.remove(vreq)
                self._vcall("_preempt_request", self.vllm._preempt_request, vreq, time.monotonic())
                self._note_preempted(req, events, PreemptReason.SCENARIO)
                fired.add(req.request_id)
        return fired

    def _note_preempted(self, req: Request, events: list[ScheduleEvent], why: PreemptReason) -> None:
        self.running.remove(req)
        for g in range(len(self.geometries)):  # its blocks went back to vLLM's pool
            self._rows_seen.pop((g, req.index), None)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.stats["preemptions"] += 1
        events.append(ScheduleEvent(EventKind.PREEMPTED, req.request_id, reason=why))

    def _note_admitted(self, req: Request, start: int, events: list[ScheduleEvent], loaded: int = 0) -> None:
        """A request vLLM scheduled from the waiting queue: what it starts from is vLLM's
        prefix-cache hit (its blocks already hold those positions) plus what the connector
        loaded (``loaded``, a P/D decode instance: written before the step runs)."""
        req.status = Status.RUNNING
        self.running.append(req)
        req.num_computed = start
        self.stats["prefix_hit_tokens"] += start - loaded
        events.append(ScheduleEvent(EventKind.ADMITTED, req.request_id, prefix_hit=start - loaded, loaded=loaded))

    def _count_reused_in(self, rows, req: Request, start: int) -> None:
        """dcpsim's ``reused_blocks``: blocks new in ``req``'s rows this step that an earlier
        request had held (not the null block, not those holding positions before ``start``:
        a prefix hit's adopted blocks are not allocations)."""
        for g, group_rows in enumerate(rows):
            row = group_rows.get(req.index)
            if row is None:
                continue
            held = self._rows_seen.setdefault((g, req.index), set())
            adopted = start // self.geometries[g].manager_block_size
            for j, b in enumerate(row.tolist()):
                if b and b not in held and j >= adopted:
                    self._reused += b in self._ever_used
                    self._ever_used.add(b)
                held.add(b)

    def _finish(self, events: list[ScheduleEvent]) -> None:
        """Requests vLLM finished (its blocks are already freed)."""
        for req in list(self.running):
            if self._vreq(req).is_finished():
                self.running.remove(req)
                req.status = Status.FINISHED
                self.stats["finished"] += 1
                events.append(ScheduleEvent(EventKind.FINISHED, req.request_id))

    def _propose_drafts(self) -> None:
        """The drafter's proposals for the next step: the request's next true tokens (vLLM's
        scheduler only counts them; which are accepted is the scenario's pattern)."""
        k = self.config.num_speculative_tokens
        if not k:
            return
        ids, drafts = [], []
        for req in self.running:
            d = min(k, req.remaining_output - 1)
            if d > 0 and req.num_computed == req.num_known - 1:
                ids.append(req.request_id)
                drafts.append([int(t) for t in req.tokens[req.num_known : req.num_known + d]])
        if ids:
            proposals = self.core.outputs.DraftTokenIds(req_ids=ids, draft_token_ids=drafts)
            self._vcall("update_draft_token_ids", self.vllm.update_draft_token_ids, proposals)

    def _published_events(self) -> tuple[KVEvent, ...]:
        """vLLM's published ``BlockStored`` events, each told as the blocks of a request
        that holds its hashes (one running now, if any)."""
        out: list[KVEvent] = []
        for event in self.vllm.kv_event_publisher.take():
            if isinstance(event, self.core.BlockStored):
                out += self._kv_events(self._holder(event), event)
        return tuple(out)

    def _holder(self, event) -> Request:
        """A request whose chain holds the event's last (deepest) hash: its earlier blocks
        may be a prefix other requests share."""
        last = bytes(event.block_hashes[-1]) if event.block_hashes else b""
        candidates = [*self.running, *self.requests]
        return next((r for r in candidates if last in self._hash_ends.get(r.index, {})), candidates[0])

    def _runner_output(self, ids: list[str], sampled: list[list[int]]):
        """vLLM's ``ModelRunnerOutput`` of the step, with the fields the tree's class has: up to
        vLLM 0.33.0 it also carries ``req_id_to_index``, which 0.34.0 dropped (its scheduler
        indexes by ``req_ids``)."""
        cls = self.core.outputs.ModelRunnerOutput
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        extra = {"req_id_to_index": {r: k for k, r in enumerate(ids)}} if "req_id_to_index" in fields else {}
        return cls(req_ids=ids, sampled_token_ids=sampled, **extra)

    def _vcall(self, name: str, fn, *args):
        return self.core.call(f"{SCHEDULER}.{name}", fn, *args)
