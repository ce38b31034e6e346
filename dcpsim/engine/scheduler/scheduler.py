"""The scheduler: admission, chunked prefill, (speculative) decode, finish, preemption.

Deterministic from the scenario and its seed, so every rank can run its own
copy and obtain the same plans (the checker proves it by comparing block-table
digests across ranks). Simplified from vLLM v1's scheduler:

* running requests first, in order; each gets ``num_known - num_computed``
  tokens (plus ``k`` drafts when decoding), capped by the step's token budget and by
  ``long_prefill_token_threshold`` (if set); its blocks cover the step's tokens plus the
  drafter's lookahead (``SimConfig.num_lookahead_tokens``: ``k`` slots past them for an
  EAGLE / MTP drafter, none for ngram; ``lookahead_slots``), as vLLM's ``allocate_slots``;
* if a running request cannot get its blocks, the last running request is
  preempted (all blocks freed, recomputed later) until it fits;
* waiting requests are admitted in order while budget, blocks and
  ``max_num_seqs`` allow (not in a step that preempted), with a prefix-cache
  lookup first;
* after the step: drafts are verified (a deterministic acceptance pattern),
  out-of-window blocks released, full units registered in the prefix cache,
  finished requests freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.interface import Engine
from dcpsim.engine.scheduler.block_pool import BlockPool
from dcpsim.engine.scheduler.managers import StateManager, make_manager, state_blocks_per_request
from dcpsim.engine.scheduler.prefix_cache import PartialHit, PrefixCache
from dcpsim.engine.scheduler.request import Request, Status
from dcpsim.errors import ConfigError
from dcpsim.model.arith import cdiv
from dcpsim.model.config import SimConfig
from dcpsim.model.content import random_tokens, stable_seed
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import BlockCopy, EventKind, KVEvent, PreemptReason, RequestView, ReqWrite, ScheduleEvent, StepPlan
from dcpsim.model.prefix_hit import eagle_groups
from dcpsim.model.scenario import Scenario
from dcpsim.plural import plural


def windowed_live_blocks(geometry: GroupGeometry, config: SimConfig) -> int | None:
    """The most blocks a request of a sliding-window or chunked-local group holds at once
    (None for other groups, which hold their whole row).

    Such a group releases the blocks below ``first_needed_position`` after every step, so
    while a step with ``c`` committed tokens allocates up to ``c + n + L`` (``n`` at most
    ``max_in_flight_tokens``, drafts included; ``L`` the drafter's lookahead, at most ``k``),
    its live entries run from the block of ``c - reach`` to that of ``c + n + L - 1``,
    ``reach`` being the positions kept behind the last committed one
    (``sliding_window - 1 + extra_retained_tokens``, or ``attention_chunk_size - 1``): at
    most ``cdiv(reach + n + k, span) + 1`` blocks, ``span`` the manager's block size. This
    is vLLM's per-request bound (``max_memory_usage_bytes`` of the two specs) with ``k``
    slots added for the lookahead (vLLM's bound leaves it out)."""
    spec = geometry.spec
    if geometry.retention is Retention.WINDOW:
        reach = spec.sliding_window - 1 + spec.extra_retained_tokens
    elif geometry.retention is Retention.CHUNK:
        reach = spec.attention_chunk_size - 1
    else:
        return None
    tokens = reach + config.max_in_flight_tokens + config.num_speculative_tokens
    return cdiv(tokens, geometry.manager_block_size) + 1


def lookahead_slots(geometry: GroupGeometry, config: SimConfig, num_tokens: int) -> int:
    """Token slots a group allocates for a step that reaches ``num_tokens`` (vLLM's
    ``allocate_slots``: ``min(num_tokens + num_lookahead_tokens, max_model_len)``): the
    drafter's lookahead past the scheduled tokens (``SimConfig.num_lookahead_tokens``), never
    past ``max_model_len``. A Mamba state group in ``align`` mode takes none (vLLM's
    ``MambaManager`` counts only the target's tokens there); in ``none`` mode it takes it as
    vLLM's does, which changes nothing: its one block spans ``max_model_len``."""
    lookahead = config.num_lookahead_tokens
    if not lookahead or (geometry.storage is Storage.STATE and geometry.spec.mamba_cache_mode == "align"):
        return num_tokens
    return max(num_tokens, min(num_tokens + lookahead, config.max_model_len))


def check_match_unit(config: SimConfig, geometries: list[GroupGeometry]) -> int:
    """``prefix_match_unit`` if the groups allow partial-block hits at it (it divides every
    group's manager block size, and every group keeps its whole context in pages; no EAGLE /
    MTP drafter, no PCP); 0 when unset. Else a ``ConfigError`` naming the field."""
    unit = config.prefix_match_unit
    if not unit:
        return 0
    for g in geometries:
        if g.storage is not Storage.PAGED or g.retention is not Retention.FULL:
            raise ConfigError(f"prefix_match_unit {unit}: partial-block hits need full-attention paged groups, group {g.name} is not")
        if g.manager_block_size % unit:
            raise ConfigError(
                f"prefix_match_unit {unit} must divide every group's block span (group {g.name}: {g.manager_block_size} tokens)"
            )
    if config.eagle_drop:
        raise ConfigError(f"prefix_match_unit {unit}: partial-block hits are not modelled with an EAGLE / MTP drafter")
    if config.prefill_context_parallel_size > 1:
        raise ConfigError(f"prefix_match_unit {unit}: partial-block hits are not modelled with prefill_context_parallel_size > 1")
    return unit


def blocks_per_request(engine: Engine, geometry: GroupGeometry, config: SimConfig, num_tokens: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once in a group: its
    whole row, or for a windowed group no more than ``windowed_live_blocks``."""
    need = engine.blocks_needed(geometry, num_tokens)
    live = windowed_live_blocks(geometry, config)
    return need if live is None else min(need, live)


def pool_sizes(scenario: Scenario, engine: Engine, geometries: list[GroupGeometry]) -> list[int]:
    """Blocks in each group's pool (besides the null block): without ``num_gpu_blocks`` or
    ``kv_cache_tokens``, enough for every request at once, a windowed group's request
    counted at the blocks it holds at once (``blocks_per_request``), not its whole row, so
    a 10M-token context does not size a sliding-window pool for 10M tokens."""
    if scenario.num_gpu_blocks is not None:
        return [scenario.num_gpu_blocks] * len(geometries)
    k = scenario.config.num_speculative_tokens
    out = []
    for geometry in geometries:
        needs = [blocks_per_request(engine, geometry, scenario.config, r.prompt_len + r.output_len + k) for r in scenario.requests]
        if geometry.storage is Storage.RING:
            out.append(len(needs))
        elif geometry.storage is Storage.STATE:  # a few state blocks per request, however long
            out.append(len(needs) * state_blocks_per_request(geometry))
        elif scenario.kv_cache_tokens is not None:
            out.append(max(max(needs), engine.blocks_needed(geometry, scenario.kv_cache_tokens)))
        else:  # every request fits at once
            out.append(sum(needs))
    return out


class Scheduler:
    admission_decided = False
    """Whether the engine made ``Engine.max_admissible_tokens`` (then ``admission_limit`` is
    its answer, which this scheduler applies and the checker judges before the first step); a
    scheduler that admits by its own rules (vLLM's) leaves both unset."""
    admission_limit: int | None = None
    """The longest request (logical tokens, ``request_tokens``) this scheduler admits; None: any."""
    block_pool_class = BlockPool
    prefix_cache_class = PrefixCache
    """The parts the scheduler builds. Their prefix-cache decisions are methods
    (``PrefixCache.computed_units``: when a unit becomes findable; ``BlockPool.evict``: when
    a reallocated block's old key stops being found), so that a test can swap in a part
    with one of them changed (``tests/support/scheduler_mutations.py``)."""

    def __init__(self, scenario: Scenario, engine: Engine, geometries: list[GroupGeometry], connector=None):
        """The engine's scheduler: its managers and prefix cache ask ``engine`` for every
        decision (block counts, releases, prefix keys). ``connector``: a P/D decode
        instance's (``engine.connector.PromptLoads``: the tokens it loads on admission)."""
        self.scenario = scenario
        self.connector = connector
        self.config = scenario.config
        self.engine = engine
        self.geometries = geometries
        self.requests = self._make_requests()
        self._partial_hits: dict[int, PartialHit] = {}
        """Request -> the partial-block hit an admission attempt of it found and took (vLLM's
        partial-hit record), until it is admitted (``partial_hit_to_copy``)."""
        self._copies: list[BlockCopy] = []
        """The step's copy-on-write copies (``StepPlan.copies``)."""
        self._retained: list[tuple[int, int]] = []
        """(group, block): the copies' sources, held until the step's copies have run."""
        self._init_blocks()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_index = 0
        self.stats = {"preemptions": 0, "prefix_hit_tokens": 0, "finished": 0, "steps": 0}

    def _make_requests(self) -> list[Request]:
        """The scenario's requests, requests of one prefix name sharing its tokens."""
        prefixes: dict[str, np.ndarray] = {}
        for r in self.scenario.requests:
            if r.prefix:
                n = max(len(prefixes.get(r.prefix, ())), r.shared_prefix_len)
                prefixes[r.prefix] = random_tokens(stable_seed(self.scenario.seed, "prefix", r.prefix), n)
        return [Request(i, spec, self.scenario.seed, prefixes.get(spec.prefix)) for i, spec in enumerate(self.scenario.requests)]

    def _init_blocks(self) -> None:
        """dcpsim's block managers (one pool per group) and prefix cache."""
        self.pool_sizes = pool_sizes(self.scenario, self.engine, self.geometries)
        """Blocks in each group's pool besides the null block: what each group's KV store holds."""
        self.managers = [make_manager(g, self.block_pool_class(n), self.engine) for g, n in zip(self.geometries, self.pool_sizes)]
        self._check_fits()
        try:
            self.admission_limit = self.engine.max_admissible_tokens(self.geometries, self.pool_sizes)
            self.admission_decided = True
        except NotImplementedError:  # an engine without the decision: admitted by the pools alone
            pass
        use_prefix = self.config.enable_prefix_caching and all(g.prefix_cacheable for g in self.geometries)
        eagle = eagle_groups([g.draft for g in self.geometries], self.config.eagle_drop)
        match_unit = check_match_unit(self.config, self.geometries) if use_prefix else 0
        self.prefix_cache = self.prefix_cache_class(self.managers, self.engine, eagle=eagle, match_unit=match_unit) if use_prefix else None

    def _check_fits(self) -> None:
        """Every request fits its group's pool alone. Its furthest slot is
        ``min(stop + L, max_model_len)``, ``stop`` at most ``prompt_len + output_len - 1`` and
        the lookahead ``L`` at most ``k``: ``prompt_len + output_len + k`` tokens cover it (as in
        ``pool_sizes``); vLLM's own admission gate (``full_sequence_must_fit``) counts the
        request's tokens without the lookahead."""
        for req in self.requests:
            total = self.request_tokens(req)
            for m in self.managers:
                need = blocks_per_request(self.engine, m.geometry, self.config, total)
                if isinstance(m, StateManager):
                    need = m.blocks_per_request()
                if need > m.pool.num_blocks:
                    raise ConfigError(
                        f"request {req.request_id!r} needs {plural(need, 'block')} in group "
                        f"{m.geometry.name} but its pool has {m.pool.num_blocks} "
                        "(raise num_gpu_blocks)"
                    )

    def request_tokens(self, req: Request) -> int:
        """A request's logical tokens as admission counts them: ``prompt_len + output_len + k``
        (every slot its furthest step may take, as ``_check_fits`` counts them)."""
        return req.spec.prompt_len + req.spec.output_len + self.config.num_speculative_tokens

    def refused(self, req: Request) -> bool:
        """Whether the engine's admission limit (``Engine.max_admissible_tokens``) refuses ``req``."""
        return self.admission_limit is not None and self.request_tokens(req) > self.admission_limit

    def external_tokens(self, req: Request) -> int:
        """Tokens of ``req`` whose KV a connector loads on admission (vLLM's
        ``get_num_new_matched_tokens``): 0 without a connector (a disaggregated decode
        instance has one)."""
        return 0 if self.connector is None else self.connector.external_tokens(req)

    # --- allocation helpers -------------------------------------------------------

    def _try_allocate(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` the blocks of its first ``num_tokens`` tokens and the drafter's
        lookahead past them (``lookahead_slots``) in every group if the pools hold them all;
        whether it did (False: the caller preempts, or waits)."""
        index, managers = req.index, self.managers
        slots = [lookahead_slots(m.geometry, self.config, num_tokens) for m in managers]
        for m, n in zip(managers, slots):
            if m.num_new_blocks(index, n) > m.pool.num_free:
                return False
        for m, n in zip(managers, slots):
            m.allocate(index, n)
        return True

    def _free(self, req: Request) -> None:
        for m in self.managers:
            m.free(req.index)
        if self.prefix_cache:
            self.prefix_cache.forget(req)

    def _preempt(self, req: Request, events: list[ScheduleEvent], why: PreemptReason) -> None:
        self.running.remove(req)
        self._free(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1
        events.append(ScheduleEvent(EventKind.PREEMPTED, req.request_id, reason=why))

    def _rows(self) -> tuple[dict[int, np.ndarray], ...]:
        return tuple(m.row_arrays() for m in self.managers)

    # --- one step -----------------------------------------------------------------

    def _tokens_for(self, req: Request, budget: int) -> tuple[int, int]:
        """(tokens to schedule, of which drafts) for a running or admitted request."""
        cap = budget
        if self.config.long_prefill_token_threshold:
            cap = min(cap, self.config.long_prefill_token_threshold)
        todo = req.num_known - req.num_computed
        drafts = 0
        if todo == 1 and self.config.num_speculative_tokens:
            drafts = min(self.config.num_speculative_tokens, req.remaining_output - 1)
            drafts = max(0, min(drafts, cap - 1))
        return min(todo + drafts, cap), drafts

    def step(self) -> StepPlan:
        """One step: arrivals, forced preemptions, the running requests (preempting under
        pressure), admissions (not in a step that preempted), the writes, then releases,
        prefix registration and finishes."""
        s = self.step_index
        events: list[ScheduleEvent] = []
        self._arrive(s)
        forced = self._preempt_forced(s, events)
        scheduled: list[tuple[Request, int, int]] = []
        budget, pressed = self._schedule_running(self.config.max_num_batched_tokens, scheduled, events)
        preempted = forced or pressed
        loaded: list[tuple[int, int]] = []
        if not preempted:
            self._admit_waiting(budget, scheduled, loaded, events)
        rows_before = self._rows()
        copies = self._take_copies()
        self._release_retained()  # the copies run first in the step: nothing writes a source before
        writes = [self._execute(req, n, drafts, s, events) for req, n, drafts in scheduled]
        self._settle(scheduled)
        views = tuple(
            RequestView(r.index, r.request_id, r.num_computed, r.fingerprints, finished=r.remaining_output <= 0)
            for r in self.running
            if r.num_computed > 0
        )
        rows_after = self._rows()
        self._finish(events)
        self.step_index += 1
        self.stats["steps"] = self.step_index
        if not scheduled and not self.running and self.waiting and not preempted:
            stuck = self.waiting[0]
            why = "not enough free blocks or token budget (raise num_gpu_blocks or max_num_batched_tokens)"
            if self.refused(stuck):
                why = f"its {self.request_tokens(stuck)} tokens exceed the {self.admission_limit} the engine admits (max_admissible_tokens)"
            raise ConfigError(f"request {stuck.request_id!r} can never be admitted: {why}")
        return StepPlan(
            step=s,
            writes=tuple(writes),
            rows_before=rows_before,
            views=views,
            rows_after=rows_after,
            events=tuple(events),
            kv_events=self._take_kv_events(),
            last=self.done,
            loaded=tuple(loaded),
            copies=copies,
        )

    def _arrive(self, step: int) -> None:
        """Requests whose arrival step has come start waiting."""
        for req in self.requests:
            if req.status is Status.PENDING and req.spec.arrival_step <= step:
                req.status = Status.WAITING
                self.waiting.append(req)

    def _preempt_forced(self, step: int, events: list[ScheduleEvent]) -> bool:
        """The scenario's ``preempt_at_steps`` of this step; whether any fired."""
        fired = False
        for req in list(self.running):
            if step in req.spec.preempt_at_steps:
                self._preempt(req, events, PreemptReason.SCENARIO)
                fired = True
        return fired

    def _schedule_running(self, budget: int, scheduled: list[tuple[Request, int, int]], events: list[ScheduleEvent]) -> tuple[int, bool]:
        """The running requests in order, each with its tokens of the step, preempting the
        last running request while one cannot get its blocks. Returns the budget left and
        whether a preemption happened."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n, drafts = self._tokens_for(req, budget)
            while not self._try_allocate(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim, events, PreemptReason.OUT_OF_BLOCKS)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n, drafts))
                budget -= n
                i += 1
                continue
            # req itself was preempted: the list shifted, do not advance i
        return budget, preempted

    def _admit_waiting(
        self, budget: int, scheduled: list[tuple[Request, int, int]], loaded: list[tuple[int, int]], events: list[ScheduleEvent]
    ) -> None:
        """Waiting requests in order while the budget, the blocks and ``max_num_seqs``
        allow, each with what the connector loads or the prefix cache hits first."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.refused(req):  # never admitted: it waits, and so does every request behind it
                break
            hit, external = self._start_from_cache(req)
            n, drafts = self._tokens_for(req, budget)
            if not self._try_allocate(req, req.num_computed + n):
                if hit:
                    self._drop_copies(req)
                    self._free(req)
                req.num_computed = 0
                break
            self._partial_hits.pop(req.index, None)  # admitted: its partial-hit record is consumed
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append((req, n, drafts))
            budget -= n
            if external:
                loaded.append((req.index, external))
            self.stats["prefix_hit_tokens"] += hit
            events.append(ScheduleEvent(EventKind.ADMITTED, req.request_id, prefix_hit=hit, loaded=external))

    def _start_from_cache(self, req: Request) -> tuple[int, int]:
        """A fresh request's computed start: the tokens a connector loads, else a
        prefix-cache hit (whose blocks it adopts). Returns (hit tokens, loaded tokens)."""
        if req.num_computed:
            return 0, 0
        external = self.external_tokens(req)
        if external:
            req.num_computed = external
            return 0, external
        if not self.prefix_cache:
            return 0, 0
        hit, hit_blocks = self.prefix_cache.lookup(req)
        partial = self._partial_hit(req, hit, hit_blocks)
        if hit or partial:
            for m, blocks in zip(self.managers, hit_blocks):
                m.pool.touch(blocks)
                m.adopt(req.index, blocks)
            if partial:
                self._copy_on_write(req, partial)
                hit += partial.tokens
            req.num_computed = hit
            self.prefix_cache.hit(req, hit, report_full=self.config.kv_cache_report_mode == "full")
        return hit, 0

    def _partial_hit(self, req: Request, hit: int, hit_blocks: list[list[int]]) -> PartialHit | None:
        """The partial-block hit past the whole hit that the admission copies: the engine
        chooses between this lookup's and the one an earlier attempt recorded
        (``partial_hit_to_copy``); one whose block does not follow the whole hit, or with no
        free block for the private copy (besides the hit's and the source), is not taken."""
        found = self.prefix_cache.partial(req, hit)
        recorded = self._partial_hits.get(req.index)
        choose = getattr(self.engine, "partial_hit_to_copy", None)
        partial = found if choose is None else choose(recorded, found)
        if partial is None or partial.start != hit:
            return None
        for g, m in enumerate(self.managers):
            pool = m.pool
            taken = sum(pool.ref_count(b) == 0 for b in [*hit_blocks[g], partial.sources[g]])
            if pool.num_free < 1 + taken:
                return None
        return partial

    def _copy_on_write(self, req: Request, partial: PartialHit) -> None:
        """The partial block's private copy: the source held until the step's copies ran, a
        fresh block appended to each group's row, and the copy of the hit tokens; the hit is
        recorded for the request (vLLM's partial-hit record) until it is admitted."""
        self._partial_hits[req.index] = partial
        for g, m in enumerate(self.managers):
            src = partial.sources[g]
            m.pool.touch([src])
            self._retained.append((g, src))
            dst = m.pool.allocate(1)[0]
            m.adopt(req.index, m.held(req.index) + [dst])
            self._copies.append(BlockCopy(g, src, dst, partial.tokens))

    def _drop_copies(self, req: Request) -> None:
        """A failed admission: its copies are not made (their sources stay held to the step's end)."""
        dsts = {b for m in self.managers for b in m.held(req.index)}
        self._copies = [c for c in self._copies if c.dst not in dsts]

    def _release_retained(self) -> None:
        for g, block in self._retained:
            self.managers[g].pool.free([block])
        self._retained = []

    def _take_copies(self) -> tuple[BlockCopy, ...]:
        copies, self._copies = tuple(self._copies), []
        return copies

    def _settle(self, scheduled: list[tuple[Request, int, int]]) -> None:
        """After the writes: each scheduled request's out-of-window blocks released and its
        full units registered in the prefix cache."""
        for req, _, _ in scheduled:
            for m in self.managers:
                m.release_skipped(req.index, req.num_computed)
            if self.prefix_cache:
                self.prefix_cache.register(req)

    def _take_kv_events(self) -> tuple[KVEvent, ...]:
        """The KV events the step's prefix-cache registrations advertised."""
        return self.prefix_cache.take_events() if self.prefix_cache else ()

    def _finish(self, events: list[ScheduleEvent]) -> None:
        """Requests with every output token leave the running list and free their blocks."""
        for req in list(self.running):
            if req.remaining_output <= 0:
                self.running.remove(req)
                self._free(req)
                req.status = Status.FINISHED
                self.stats["finished"] += 1
                events.append(ScheduleEvent(EventKind.FINISHED, req.request_id))

    def _execute(self, req: Request, n: int, drafts: int, step: int, events: list[ScheduleEvent]) -> ReqWrite:
        """The step's outcome for one request: contents written, then commit."""
        start = req.num_computed
        known = req.num_known
        if start + n < known:  # a prefill chunk that does not reach the end
            contents = req.fingerprints[start : start + n].copy()
            req.num_computed = start + n
            return ReqWrite(req.index, req.request_id, start, contents, prefill=True)
        num_true = known - start
        d = n - num_true
        accepted = req.next_acceptance(d) if d else 0
        contents = np.concatenate([req.fingerprints[start:known], req.draft_contents(known, d, accepted, step)])
        req.num_computed = known + accepted
        req.num_output += accepted + 1
        if d:
            events.append(ScheduleEvent(EventKind.VERIFIED, req.request_id, drafts=d, accepted=accepted))
        prefill = num_true > 1 or start < req.spec.prompt_len
        return ReqWrite(req.index, req.request_id, start, contents, num_drafts=d, prefill=prefill)

    @property
    def summary(self) -> dict:
        """Counters of what the run exercised."""
        return {
            **self.stats,
            "reused_blocks": sum(m.pool.num_reused for m in self.managers),
            "requests": len(self.requests),
        }

    @property
    def done(self) -> bool:
        return all(r.status is Status.FINISHED for r in self.requests)

    def plans(self) -> Iterator[StepPlan]:
        """Every step's plan until all requests finish (or ``max_steps``)."""
        while not self.done:
            if self.step_index >= self.scenario.max_steps:
                raise ConfigError(f"scenario did not finish within max_steps={self.scenario.max_steps}")
            yield self.step()
