"""The checker's judgement of a rank's attention metadata, every step.

What the metadata of a (group, step) must be is derived from the step's plan (which
requests run which positions, and the block-table rows the step ran with) and the
checker's own geometry: global lengths are where the writes end; a sharded group's local
length counts the rank's runs of ``I`` indices below the length (run ``k`` is rank
``k % W``'s), one query token at a time for the bounds; the paged plan lists the kernel
pages those local keys fill, read off the block-table row; the worker's block-table rows
hold at least the longest context in the group's shard count, and the builder expects
exactly the worker's width. Nothing here calls the engine's layout math.

CUDA-graph padding: a uniform decode step (every request runs ``1 + k`` tokens) of at most
``max_cudagraph_capture_size`` tokens is padded to the smallest captured size that is a
multiple of ``1 + k``, with dummy requests of context ``W * I`` that own no blocks and
whose tokens map to no slot (a dummy token that writes is caught by the write guard too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcpsim.model.kinds import Storage
from dcpsim.model.plan import PAD_REQUEST, AttentionMetadata, StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.helix import helix_metadata
from dcpsim.verify.oracle import owned_below

MAX_KEPT = 20
_NONE = np.zeros(0, np.int64)


def expected_width(group: ExpectedGroup, max_model_len: int) -> int:
    """The fewest kernel-block entries a row can have: the longest context in the group's
    shard count (``cdiv(max_model_len, B * W)`` pages sharded, ``cdiv(max_model_len, B)``
    replicated), in kernel blocks; a ring's one. Wider is allowed (vLLM 0.33.0 rounds rows up
    to 128 tokens, vllm-ascend does not); the builder must expect exactly the worker's width."""
    if group.storage is Storage.RING:
        return 1
    shards = group.dcp_size if group.sharded else 1
    entries = -(-max_model_len // (group.block_size * shards))
    if group.helix:  # the busiest rank's blocks, whatever the prompt length (verify.helix)
        entries = -(-max_model_len // (group.block_size * group.dcp_size)) + 1
    return entries * (group.page_states // kernel_states(group))


def kernel_states(group: ExpectedGroup) -> int:
    return group.kernel_block_size or group.page_states


def uniform_decode_padding(group: ExpectedGroup, q_lens: list[int], capture_sizes: tuple[int, ...]) -> int:
    """Dummy requests a step gets (see the module docstring)."""
    q = 1 + group.num_speculative_tokens
    if not capture_sizes or not q_lens or any(n != q for n in q_lens):
        return 0
    tokens = len(q_lens) * q
    size = next((c for c in capture_sizes if c >= tokens and c % q == 0), None)
    return 0 if size is None else (size - tokens) // q


def _runs(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For runs of ``lengths``, each element's run and its place in the run (flat)."""
    run = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    return run, np.arange(len(run), dtype=np.int64) - starts[run]


def _kv_pages(held: list[np.ndarray], pages: list[int], per_block: int) -> np.ndarray:
    """The kernel pages of each request's plan, concatenated: page ``t`` of a row is part
    ``t % per_block`` of KV block ``row[t // per_block]``; -1 past the row; a request with
    no row (a dummy) reads the null block's pages (0). Request by request, by slices of
    its row: a plan lists the whole context's pages (164K at 10M tokens), so this costs a
    copy of them, not a gather per page."""
    parts = []
    for row, n in zip(held, pages):
        if not len(row):
            parts.append(np.zeros(n, np.int64))
            continue
        used = row[: -(-n // per_block)]
        if per_block > 1:
            used = (used[:, None] * per_block + np.arange(per_block, dtype=np.int64)).reshape(-1)[:n]
        parts.append(used if len(used) == n else np.concatenate([used, np.full(n - len(used), -1, np.int64)]))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass(frozen=True)
class StepSpans:
    """What every group's expectation reads of a step's writes, built once a step."""

    starts: np.ndarray
    stops: np.ndarray
    q_lens: list[int]
    token_run: np.ndarray
    """Each written token's write (``_runs``), and its place in the write:"""
    token_at: np.ndarray
    token_ends: np.ndarray
    """Each written token's position + 1 (the keys up to it)."""
    query_start_loc: np.ndarray
    """Where each write's query tokens start, and their total (no dummy request)."""

    @staticmethod
    def of(plan: StepPlan) -> StepSpans:
        starts = np.array([w.start for w in plan.writes], dtype=np.int64)
        stops = starts + np.array([len(w.contents) for w in plan.writes], dtype=np.int64)  # ReqWrite.stop
        run, j = _runs(stops - starts)
        q_lens = stops - starts
        query_start_loc = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        return StepSpans(starts, stops, q_lens.tolist(), run, j, starts[run] + j + 1, query_start_loc)


def expected_metadata(
    group: ExpectedGroup,
    plan: StepPlan,
    rows: dict[int, np.ndarray],
    rank: int,
    max_model_len: int,
    capture_sizes: tuple[int, ...],
    spans: StepSpans | None = None,
) -> dict:
    """Every field of the metadata the rank must build for the group in this step (all the
    requests at once: one pass per field, not one per request). ``spans``: the step's
    ``StepSpans`` when the caller has them (every group reads the same)."""
    if group.helix:
        return helix_metadata(group, plan, rows, rank, group.prompt_len, expected_width(group, max_model_len))
    R = group.tokens_per_state if group.storage is Storage.RECORDS else 1
    writes = plan.writes
    spans = spans if spans is not None else StepSpans.of(plan)
    stops = spans.stops
    dummies = uniform_decode_padding(group, spans.q_lens, capture_sizes)
    q = 1 + group.num_speculative_tokens
    dummy_len = group.dcp_size * group.interleave_size
    query_start_loc = spans.query_start_loc
    if dummies:
        query_start_loc = np.concatenate([query_start_loc, query_start_loc[-1] + q * np.arange(1, dummies + 1, dtype=np.int64)])
    seq = np.concatenate([stops // R, np.full(dummies, dummy_len, np.int64)]) if dummies else stops // R
    # the keys query token j of a request sees: positions <= start + j, in records of R (both in one call)
    owned = owned_below(np.concatenate([seq, spans.token_ends // R if R > 1 else spans.token_ends]), rank, group)
    local, bounds = owned[: len(seq)], owned[len(seq) :]
    if dummies:
        bounds = np.concatenate([bounds, np.full(dummies * q, local[-1], np.int64)])
    held = [np.asarray(rows.get(w.req_index, _NONE), dtype=np.int64) for w in writes] + [_NONE] * dummies
    kernel = kernel_states(group)
    per_block = group.page_states // kernel
    pages = -(-local // kernel)
    # kernel page t of a row lies in KV block row[t // per_block], part t % per_block; -1
    # past the row (the request holds too few blocks, which _blocks_held reports); a dummy
    # request (no row) reads the null block's pages
    indices = _kv_pages(held, pages.tolist(), per_block)
    return dict(
        request_ids=tuple(w.request_id for w in writes) + (PAD_REQUEST,) * dummies,
        seq_lens=seq,
        query_start_loc=query_start_loc,
        dcp_local_seq_lens=local,
        query_local_bounds=bounds,
        kv_indptr=np.concatenate([[0], np.cumsum(pages)]).astype(np.int64),
        kv_indices=indices,
        kv_last_page_len=np.where(pages > 0, local - (pages - 1) * kernel, 0),
        block_table_width=expected_width(group, max_model_len),
        num_dummy_requests=dummies,
        padded_slot_mapping=np.full(dummies * q, -1, dtype=np.int64),
    )


@dataclass(frozen=True)
class MetadataMismatch:
    rank: int
    step: int
    group: str
    field: str
    request_id: str | None
    expected: str
    actual: str

    def __str__(self) -> str:
        who = f" request {self.request_id}" if self.request_id else ""
        return (
            f"rank {self.rank} step {self.step} group {self.group}{who}: attention metadata "
            f"{self.field} is {self.actual}, expected {self.expected}"
        )


def show(value) -> str:
    if isinstance(value, np.ndarray):
        text = np.array2string(value, threshold=12, separator=", ")
        return text.replace("\n", "")
    return repr(value)


def _same(have, expect: np.ndarray) -> bool:
    """``np.array_equal`` of a field and its expectation (same shape): by their bytes when
    both are int64 arrays (every field the view hands over), which costs a tenth of it."""
    if isinstance(have, np.ndarray) and have.dtype == expect.dtype == np.int64 and have.shape == expect.shape:
        return have.tobytes() == expect.tobytes()
    have = np.asarray(have)
    return have.shape == expect.shape and np.array_equal(have, expect)


class MetadataJudge:
    """Judges each step's metadata of every attention group; keeps the first mismatches."""

    def __init__(
        self,
        rank: int,
        groups: list[ExpectedGroup],
        store_of: list[int],
        max_model_len: int,
        capture_sizes: tuple[int, ...],
        table_width=None,
        config=None,
    ):
        self.rank = rank
        self.config = config
        """The scenario's ``SimConfig``: the context gather's workspace (None: not judged)."""
        self.groups = groups
        self.store_of = store_of
        self.max_model_len = max_model_len
        self.capture_sizes = capture_sizes
        self.table_width = table_width
        """``group id -> entries`` of the worker's block table (the other consumer)."""
        self.count = 0
        self.checks = 0
        self.gather_checks = 0
        """(group, step) context gathers judged (``verify.context_gather``), apart from ``checks``."""
        self.gather_slots: dict[int, dict] = {}
        """Store -> the context gather's expected slots of each request, kept across steps
        (``verify.context_gather``: a step derives only the keys its context adds)."""
        self.kept: list[MetadataMismatch] = []

    def judge(self, plan: StepPlan, metas: list[AttentionMetadata] | None) -> None:
        if metas is None or not plan.writes:
            return
        by_group = {(m.group, m.model): m for m in metas}
        spans = StepSpans.of(plan)
        for g, group in enumerate(self.groups):
            if group.storage not in (Storage.PAGED, Storage.RECORDS):  # rings and Mamba state: no attention
                continue
            store = self.store_of[g]
            self._blocks_held(plan, group, plan.rows_before[store], spans.stops.tolist())
            want = expected_metadata(group, plan, plan.rows_before[store], self.rank, self.max_model_len, self.capture_sizes, spans)
            least = want["block_table_width"]
            worker = None if self.table_width is None else self.table_width(store) * (group.page_states // kernel_states(group))
            if worker is not None and worker < least:
                self.add(plan, group, "block table width (worker)", None, f">= {least}", show(worker))
            # the drafter reads the same cache: the same lengths, plan and width as the target
            for model in ("target", "draft") if group.draft else ("target",):
                meta = by_group.get((store, model))
                self.checks += 1
                if meta is None:
                    self.add(plan, group, f"{model} metadata", None, "built", "missing")
                    continue
                self._compare(plan, group, meta, want, model)
                self._width(plan, group, meta.block_table_width, least, worker, model)

    def _width(self, plan, group: ExpectedGroup, have: int, least: int, worker: int | None, model: str) -> None:
        """The builder's width: exactly the worker's (two consumers of one table, vllm#50302),
        or at least the longest context where the worker's is not known."""
        name = "block_table_width" if model == "target" else f"{model} block_table_width"
        if worker is not None and have != worker:
            self.add(plan, group, name, None, f"{worker} (the worker's)", show(have))
        elif worker is None and have < least:
            self.add(plan, group, name, None, f">= {least}", show(have))

    def _blocks_held(self, plan, group: ExpectedGroup, rows: dict, stops: list[int]) -> None:
        """A running request holds exactly the block-table entries its tokens fill: one per
        ``B * W`` tokens of a sharded group, one per ``B`` of a replicated one (a released
        window block stays as a null entry), counted up to the step's end plus the drafter's
        lookahead (``L``: ``num_speculative_tokens`` for an EAGLE / MTP drafter, 0 for ngram),
        never past ``max_model_len``. More is capacity the pool never gets back."""
        unit = group.manager_block_size
        lookahead = self.config.num_lookahead_tokens if self.config is not None else 0
        for w, stop in zip(plan.writes, stops):
            held = len(rows.get(w.req_index, ()))
            slots = max(stop, min(stop + lookahead, self.max_model_len)) if lookahead else stop
            need = -(-slots // unit)
            if group.helix:  # one spare entry: the busiest rank's blocks whatever the prompt (verify.helix)
                need = -(-slots // (group.block_size * group.dcp_size)) + (1 if slots else 0)
            if held != need:
                ask = f"cdiv({stop}, {unit})" if slots == stop else f"cdiv({stop} + {slots - stop} lookahead, {unit})"
                self.add(plan, group, "blocks held", w.request_id, f"{need} ({ask})", str(held))

    def _compare(self, plan, group, meta: AttentionMetadata, want: dict, model: str = "target") -> None:
        who = "" if model == "target" else f"{model} "
        if tuple(meta.request_ids) != want["request_ids"]:
            self.add(plan, group, f"{who}request_ids", None, show(want["request_ids"]), show(tuple(meta.request_ids)))
            return
        if meta.num_dummy_requests != want["num_dummy_requests"]:
            self.add(plan, group, f"{who}num_dummy_requests", None, show(want["num_dummy_requests"]), show(meta.num_dummy_requests))
        per_request = ("seq_lens", "dcp_local_seq_lens", "kv_last_page_len")
        for name in (*per_request, "query_start_loc", "query_local_bounds", "kv_indptr", "kv_indices", "padded_slot_mapping"):
            have, expect = getattr(meta, name), want[name]
            if _same(have, expect):
                continue
            have = np.asarray(have)
            rid = None
            if name in per_request and have.shape == expect.shape:
                i = int(np.nonzero(have != expect)[0][0])
                rid, have, expect = want["request_ids"][i], have[i], expect[i]
            self.add(plan, group, f"{who}{name}", rid, show(expect), show(have))

    def add(self, plan, group, field, request_id, expected, actual) -> None:
        self.count += 1
        if len(self.kept) < MAX_KEPT:
            self.kept.append(MetadataMismatch(self.rank, plan.step, group.name, field, request_id, expected, actual))
