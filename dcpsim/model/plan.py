"""The records the two sides exchange: a step's plan (scheduler -> ranks -> checker) and
the write log a rank keeps of what it wrote (worker -> checker).

Plain data, identical on every rank for the plan; no behaviour.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from dcpsim.plural import plural


@dataclass(frozen=True)
class ReqWrite:
    """Positions ``[start, start + len(contents))`` of a request get KV this step."""

    req_index: int
    request_id: str
    start: int
    contents: np.ndarray  # int64 fingerprint per written position (drafts included)
    num_drafts: int = 0
    """The last ``num_drafts`` written positions are speculative drafts."""
    prefill: bool = False
    """A prefill row (the prompt, or a preempted request's recomputation), not a decode:
    prefill context parallelism splits only these."""

    @property
    def stop(self) -> int:
        return self.start + len(self.contents)


@dataclass(frozen=True)
class RequestView:
    """A live request after the step: what its KV must hold now."""

    req_index: int
    request_id: str
    num_committed: int
    fingerprints: np.ndarray  # true fingerprint of every position of the request
    finished: bool = False
    """The request finishes with this step (its last view): its blocks go at the next one."""


@dataclass(frozen=True)
class KVEvent:
    """A ``BlockStored`` event the engine advertises (vLLM's KV events): the hash block
    ``[start, stop)`` of a request became findable under ``key``, the fingerprint of the
    prefix ending at ``stop - 1``."""

    request_id: str
    start: int
    stop: int
    key: int
    group: int | None = None
    """The KV-cache group whose block this is (vLLM emits one event per group's block, of
    that group's manager block size); None: one hash block of every group (dcpsim's own)."""


class EventKind(enum.StrEnum):
    ADMITTED = "admitted"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    VERIFIED = "verified"
    """A speculative step's drafts were verified: ``accepted`` of ``drafts`` kept."""


class PreemptReason(enum.StrEnum):
    SCENARIO = "scenario"
    """The scenario's ``preempt_at_steps``."""
    OUT_OF_BLOCKS = "out of blocks"
    """The pool could not hold a running request's next tokens."""


@dataclass(frozen=True)
class ScheduleEvent:
    """What the scheduler did to one request in a step. ``str(event)`` is its line in a
    timeline: ``admitted b with a prefix-cache hit of 512 tokens``, ``preempted a (scenario)``."""

    kind: EventKind
    request_id: str
    reason: PreemptReason | None = None
    """Why a preemption happened."""
    prefix_hit: int = 0
    """Tokens an admission took from the prefix cache."""
    loaded: int = 0
    """Tokens an admission took from a KV connector (disaggregated decode)."""
    drafts: int = 0
    accepted: int = 0

    def __str__(self) -> str:
        if self.kind is EventKind.VERIFIED:
            return f"{self.request_id}: {self.accepted}/{self.drafts} drafts accepted"
        head = f"{self.kind} {self.request_id}"
        if self.kind is EventKind.PREEMPTED:
            return f"{head} ({self.reason})"
        if self.loaded:
            return f"{head} with {plural(self.loaded, 'token')} from the kv connector"
        if self.prefix_hit:
            return f"{head} with a prefix-cache hit of {plural(self.prefix_hit, 'token')}"
        return head


@dataclass(frozen=True)
class StepPlan:
    step: int
    writes: tuple[ReqWrite, ...]
    rows_before: tuple[dict[int, np.ndarray], ...]
    """Per group: block-table row of every request holding blocks during the step."""
    views: tuple[RequestView, ...]
    rows_after: tuple[dict[int, np.ndarray], ...]
    """Per group: rows after the step's releases (what attention reads next)."""
    events: tuple[ScheduleEvent, ...] = field(default_factory=tuple)
    kv_events: tuple[KVEvent, ...] = field(default_factory=tuple)
    """The prefix-cache blocks the step made findable, as the engine advertises them."""
    last: bool = False
    loaded: tuple[tuple[int, int], ...] = ()
    """(request index, tokens) of each request admitted this step with KV a connector
    loads (disaggregated decode): its first ``tokens`` positions are not written by the step."""
    copies: tuple[BlockCopy, ...] = ()
    """The copy-on-write block copies of the step's partial prefix-cache hits, which every
    rank runs on its shard before the step's writes (semantics section 5, partial hits)."""


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first ``tokens`` positions of a block (a block-table entry of ``group``: ``B*W``
    positions, ``B`` slots a rank when sharded) from block ``src`` to block ``dst``: each rank
    copies the states of those positions it holds."""

    group: int
    src: int
    dst: int
    tokens: int


@dataclass(frozen=True)
class WriteRecord:
    """One write the worker made into a KV store during a step (its change record).

    ``slots`` are every slot the write path produced for this rank (``PAD`` removed),
    including slots outside the store, which the store itself refuses to write;
    ``index[i]`` is the position, record or ring state the worker stored at ``slots[i]``.
    """

    group: int
    req_index: int
    request_id: str
    slots: np.ndarray
    index: np.ndarray


PAD_REQUEST = "<cudagraph-pad>"
"""The request id of a dummy request that pads a step to a captured CUDA-graph size."""


@dataclass(frozen=True)
class AttentionMetadata:
    """What one rank's attention-metadata builder hands the kernel for one KV-cache group
    in one step (vLLM's ``CommonAttentionMetadata`` plus a FlashInfer-style paged plan).

    Requests are in batch order; a step padded to a captured CUDA-graph size ends with
    ``num_dummy_requests`` dummy requests (id ``PAD_REQUEST``) that own no blocks.
    Lengths count the group's indices: positions, or records of a compressed cache.

    * ``seq_lens``: global length of each request after the step (all ranks together);
    * ``query_start_loc``: ``[num_reqs + 1]`` offsets of each request's query tokens;
    * ``dcp_local_seq_lens``: keys of each request this rank stores (= ``seq_lens`` for a
      replicated group);
    * ``query_local_bounds``: keys each query token sees in this rank's shard;
    * ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``: the rank's own kernel pages
      per request (CSR over ``kv_indices``) and the keys on each request's last page;
    * ``block_table_width``: entries per row the builder expects of the block table;
    * ``padded_slot_mapping``: the slots of the dummy tokens (every one must be ``PAD``).
    """

    group: int
    request_ids: tuple[str, ...]
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    dcp_local_seq_lens: np.ndarray
    query_local_bounds: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    block_table_width: int
    num_dummy_requests: int = 0
    model: str = "target"
    """``target``, or ``draft``: the drafter's own metadata of a group holding draft layers."""
    padded_slot_mapping: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    ARRAYS = (
        "seq_lens",
        "query_start_loc",
        "dcp_local_seq_lens",
        "query_local_bounds",
        "kv_indptr",
        "kv_indices",
        "kv_last_page_len",
        "padded_slot_mapping",
    )


@dataclass(frozen=True)
class SpecDecodeMask:
    """The speculative-decode (verify) attention mask one rank builds for one sharded group in
    one step: for each decode row (``1 <= q <= 1 + k`` query tokens at positions
    ``context + [0, q)``), which of the rank's local keys each query token may see.

    ``visible[i]`` is a bool ``[query_lens[i], n_i]`` array over the rank's local keys of the
    whole context after the step (``n_i`` of them, in local order: local index ``l`` is the
    rank's ``l``-th key by position), True where the token may attend the key. The checker
    judges it against causality over positions (failure ``attention-mask``).
    """

    group: int
    request_ids: tuple[str, ...]
    context_lens: np.ndarray
    query_lens: np.ndarray
    visible: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class PcpQueryKeys:
    """Which keys of a split prefill row each query token a PCP rank computes attends, as the
    rank's PCP attention metadata gives them (the row's own tokens, all-gathered over the PCP
    group; its cached context is read through the local lengths as any row's).

    ``queries [n]``: the row offsets of the tokens the rank computes; ``spans [n, 4]``: two key
    ranges of row offsets each attends, ``[spans[:, 0], spans[:, 1])`` and ``[spans[:, 2],
    spans[:, 3])`` (vLLM's and vllm-ascend's split: the keys before the token's chunk, unmasked,
    and its chunk's, masked causally). The checker judges them against causality (failure
    ``attention-mask``): offset ``o`` sees exactly ``[0, o]``, each key once.
    """

    request_id: str
    start: int
    """The row's first position."""
    query_len: int
    queries: np.ndarray
    spans: np.ndarray


@dataclass
class AttentionResult:
    """One (group, request) of a step's attention on one rank, as the engine reports it.

    ``out [len(rows), head1 - head0, dv]`` and ``lse [len(rows), head1 - head0]`` hold the
    heads ``[head0, head1)`` of query tokens ``write.start + rows``: after the merge across
    ranks for a sharded group (``merged``), or as this rank computed them (replicated).
    ``visible[j]`` counts the keys token ``rows[j]`` saw in this rank's shard, and
    ``shard_lse`` (heads ``[shard_head0, ...)``) is the LSE this rank reported to the merge:
    diagnostics for a failure report. A sparse-attention group (semantics section 14) also
    reports ``selection [len(rows), k]``: the global top-k positions this rank selected for
    each token (ascending, ``-1`` padding), which the checker compares across ranks.
    """

    group: int
    write: ReqWrite
    rows: np.ndarray
    merged: bool
    out: object
    lse: object
    head0: int
    head1: int
    visible: np.ndarray
    shard_lse: object
    shard_head0: int
    selection: np.ndarray | None = None


@dataclass(frozen=True)
class ContextGather:
    """The context gather of one KV-cache group in one step on one rank: how the rank
    gathers the cached context of the step's prefill rows in workspace-sized chunks (vLLM's
    chunked-context metadata of an MLA prefill; ``docs/dcp-semantics.md`` section 10).

    One entry per (chunk, request) in order, arrays aligned by entry:

    * ``chunks``: the chunk of each entry (0, 1, ...);
    * ``starts`` / ``seq_lens``: the entry's context tokens ``[start, start + len)``
      (global positions, all ranks together);
    * ``local_starts`` / ``local_seq_lens``: the rows of this rank's shard it gathers,
      ``[local_start, local_start + local_len)`` in the rank's local index;
    * ``slots``: the store slots of those rows, entry after entry (``sum(local_seq_lens)``;
      ``PAD`` past the block-table row): what the gather reads and attention then sees.
    """

    group: int
    workspace_size: int
    request_ids: tuple[str, ...]
    chunks: np.ndarray
    starts: np.ndarray
    seq_lens: np.ndarray
    local_starts: np.ndarray
    local_seq_lens: np.ndarray
    slots: np.ndarray

    ARRAYS = ("chunks", "starts", "seq_lens", "local_starts", "local_seq_lens", "slots")

    def entries_of(self, request_id: str) -> list[int]:
        """The entries of one request, in order."""
        return [k for k, rid in enumerate(self.request_ids) if rid == request_id]

    def slots_of(self, entry: int) -> np.ndarray:
        """The slots entry ``entry`` gathers."""
        ends = np.cumsum(self.local_seq_lens)
        return self.slots[ends[entry] - self.local_seq_lens[entry] : ends[entry]]
