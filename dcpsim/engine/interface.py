"""``Engine``: every decision an engine under test makes about the DCP KV cache.

dcpsim judges an engine. The harness drives it (schedule, write, attend) and an
independent checker judges what it wrote; the engine is whatever implements this
interface: the reference engine (``dcpsim.engine.reference``), a fault variant of it
(``dcpsim.engine.faults``), real engine code loaded from a source tree, or a plugin.

Contract for implementers
-------------------------
* Every method takes and returns values: ints, numpy int64 arrays, torch tensors, spec
  dataclasses (``dcpsim.model.specs``), groups (``dcpsim.model.grouping``), plan records
  (``dcpsim.model.plan``) and ``GroupGeometry`` values. None receives an internal object
  of the harness, except ``merge_across_ranks``, which gets the rank's process group.
* Methods must be deterministic: every rank calls them with the same arguments (plus its
  own ``dcp_rank``) and the ranks must stay in lockstep.
* ``PAD`` (-1) is the slot of a position this rank does not store.
* Notation (``docs/dcp-semantics.md``): ``W`` decode_context_parallel_size, ``r`` the DCP
  rank, ``I`` cp_kv_cache_interleave_size, ``B`` a group's block size, ``Bk`` the kernel
  block size, ``R`` tokens per compressed record, ``C`` a ring's capacity.
* Subclass ``Engine`` and override what you implement; the base class's methods raise
  ``NotImplementedError``. Subclass ``ReferenceEngine`` to change one decision only (that
  is what a fault is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.model import heads, parallel
from dcpsim.model.config import SimConfig
from dcpsim.model.grouping import KVCacheGroupSpec
from dcpsim.model.plan import AttentionMetadata, ContextGather, ReqWrite
from dcpsim.model.prefix_hit import longest_prefix_hit, per_group
from dcpsim.model.specs import KVCacheSpec


class EngineError(Exception):
    """The engine under test raised on a valid input: its code refused or crashed. Every rank
    runs the same scheduler, so a scheduler's error is every rank's, at the same step, and
    the run ends in a failure naming where (``function``, ``file``, ``line``) and why."""

    def __init__(self, *, what: str, function: str, file: str, line: int, message: str, frames: tuple[str, ...] = ()):
        super().__init__(f"{function} ({file}:{line}) raised {message}")
        self.what, self.function, self.file, self.line, self.message = what, function, file, line, message
        self.frames = frames
        """The engine's own frames, outermost first (``file:line function``)."""


@dataclass(frozen=True)
class MergedBy:
    """What an engine may return as a fourth element of ``merge_across_ranks``: the code
    that merged the batch (``code``) and how many of its ``of`` rows it merged (the rest
    merged otherwise, say by the reference), so a report can count them."""

    code: str
    rows: int
    of: int


class Engine:
    """The interface. See the module docstring for the contract."""

    name = "engine"
    description = ""
    lse_base: str | None = None
    """The base (``"e"`` or ``"2"``) the engine's attention returns its LSEs in, when the
    engine fixes one (vLLM: its attention backend's ``lse_base_on_e``); ``None``: whichever
    the run configures (``--lse-base``, default e)."""

    # --- the model: groups and their geometry ---------------------------------------

    def kv_cache_groups(self, layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
        """Group the model's named layer specs into KV-cache groups (one block table each)
        and merge each group's layer specs into its group spec. Layers of one group share
        a block table and a slot mapping; a group never mixes replicated and sharded
        layers. Raise ``ConfigError`` for specs that cannot be grouped."""
        raise NotImplementedError

    def group_geometry(self, group_id: int, group: KVCacheGroupSpec, config: SimConfig) -> GroupGeometry:
        """How group ``group_id`` is stored and sharded under ``config``: storage kind,
        sharded or replicated, page size in states, manager block size (tokens per
        block-table entry), block-table width, kernel block size. Raise ``ConfigError``
        (naming the group and field) for a config the engine refuses."""
        raise NotImplementedError

    def geometries(self, layer_specs: dict[str, KVCacheSpec], config: SimConfig) -> list[GroupGeometry]:
        """The geometry of every group, in group order (not meant to be overridden)."""
        return [self.group_geometry(g, group, config) for g, group in enumerate(self.kv_cache_groups(layer_specs))]

    # --- the scheduler: block managers and the prefix cache ---------------------------

    def make_scheduler(self, scenario, geometries: list[GroupGeometry], connector=None):
        """The scheduler of a run (``dcpsim.engine.scheduler.scheduler.Scheduler``): by
        default dcpsim's, which asks this engine for each decision below (block counts,
        releases, prefix keys). An engine that brings its own block manager returns a
        subclass whose allocation seams (``_try_allocate``, ``_free``, ``_rows``, ...) call
        it (``dcpsim.engine.vllm.scheduler``). ``connector``: a P/D decode instance's KV
        connector (``dcpsim.engine.connector.PromptLoads``; its ``external_tokens(req)``
        are loaded on admission, not computed), None otherwise. Every rank builds its own,
        from the same arguments: it must be deterministic."""
        from dcpsim.engine.scheduler.scheduler import Scheduler  # the scheduler asks the engine: a cycle

        return Scheduler(scenario, self, geometries, connector=connector)

    def check_scenario(self, scenario) -> None:
        """Refuse a scenario this engine cannot run (``ConfigError``, naming the engine's own
        rule), in the parent before any rank starts; the default accepts every scenario the
        reference validates."""

    def blocks_needed(self, geometry: GroupGeometry, num_tokens: int) -> int:
        """Block-table entries a request of ``num_tokens`` tokens holds in the group."""
        raise NotImplementedError

    def max_admissible_tokens(self, geometries: list[GroupGeometry], pool_sizes: Sequence[int]) -> int | None:
        """The longest request, in logical tokens (``prompt_len + output_len + k``: every slot
        its furthest step may take, as the pool-fit check counts it), the engine admits given the
        pools it holds: ``pool_sizes[g]`` blocks per rank in group ``g`` (besides the null block).
        None: no length is refused (no group holds a request's whole context). The rule
        (semantics section 8, class 53): a request's logical tokens count once against the
        logical capacity, each block a manager block of tokens (``B * W`` for a DCP-sharded
        group, ``B`` for a replicated one; a rank's rows times ``W`` or 1), over the groups that
        hold a request's whole context (full attention, MLA, compressed records; a window, a
        chunk, a ring or a Mamba state holds a bounded share of any request), the tightest
        group deciding. dcpsim's scheduler never admits a longer request; the checker judges
        the number before the first step (``verify.admission``). Optional: an engine without it
        (its scheduler admits by its own rules) is not judged."""
        raise NotImplementedError

    def first_needed_position(self, geometry: GroupGeometry, num_committed: int) -> int:
        """After ``num_committed`` committed tokens, positions below this one are no longer
        needed by attention (sliding window, chunk, ring); 0 for full attention."""
        raise NotImplementedError

    def num_released_blocks(self, geometry: GroupGeometry, first_needed: int) -> int:
        """Leading block-table entries the manager returns to the pool (their entries
        become the null block) when positions below ``first_needed`` are not needed."""
        raise NotImplementedError

    def prefix_block_tokens(self, geometry: GroupGeometry) -> int:
        """Tokens of prefix one cached block of the group stands for when a hit's length
        is counted: the tokens its block-table entry covers (``B * W`` sharded, ``B``
        replicated; a compressed cache's ``B`` is ``R`` tokens per record)."""
        raise NotImplementedError

    def prefix_hash_unit(self, geometries: list[GroupGeometry]) -> int:
        """Tokens per prefix-cache hit unit: a hit is a whole number of units (upstream:
        the LCM of the groups' block spans, so it ends on a block boundary of every group)."""
        raise NotImplementedError

    def prefix_hash_block_size(self, geometries: list[GroupGeometry]) -> int:
        """Tokens per hash block (upstream: the GCD of the groups' block spans): lookups
        find a group's block by the hash of its last hash block, and the engine advertises
        one KV event per hash block (a router hashes prompts at that unit)."""
        raise NotImplementedError

    def prefix_key_position(self, geometries: list[GroupGeometry], block: int) -> int:
        """The position whose prefix fingerprint keys hash block ``block`` (0-based). A key
        must cover the whole block: a hit then never runs past the true common prefix."""
        raise NotImplementedError

    def prefix_hit_tokens(self, geometries: list[GroupGeometry], cached_blocks: list[int], limit: int, eagle: bool | Sequence[bool]) -> int:
        """Tokens of a request's prefix-cache hit, given each group's leading run of cached
        blocks (``cached_blocks[g]``, already within ``limit`` tokens, the request's known
        tokens less one). ``eagle[g]``: group ``g`` is an EAGLE group (an EAGLE / MTP
        drafter's layers live in it, vLLM's ``is_eagle_group``; every group when none holds
        a draft layer, ``dcpsim.model.prefix_hit.eagle_groups``) and gives up the last block
        of its run (the drafter recomputes it for its hidden states); the other groups keep
        theirs. A single bool stands for every group. The default is the semantics: the
        longest multiple of ``prefix_hash_unit`` that every group's run covers, each cached
        block credited with ``prefix_block_tokens``; an engine whose lookup has another shape
        (vLLM's hybrid coordinator, one group after another with a margin) overrides it."""
        drops = per_group(eagle, len(cached_blocks))
        runs = [max(0, n - 1) if drop else n for n, drop in zip(cached_blocks, drops)]
        return longest_prefix_hit(runs, [self.prefix_block_tokens(g) for g in geometries], self.prefix_hash_unit(geometries), limit)

    # --- the worker: the write path -------------------------------------------------

    def write_slots(self, geometry: GroupGeometry, write: ReqWrite, block_row: np.ndarray, dcp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, index)`` of one request's write ``[write.start, write.stop)`` on rank
        ``dcp_rank``, given its block-table row in the group. ``index[i]`` is what
        ``slots[i]`` stores: a position (paged), a record index (records, emitted at
        position ``(c + 1) * R - 1``) or a ring state. ``slots[i]`` is ``PAD`` where this
        rank does not store ``index[i]``. The last ``write.num_drafts`` positions are
        speculative drafts."""
        raise NotImplementedError

    def step_write_slots(
        self, geometry: GroupGeometry, writes: list[ReqWrite], block_rows: list[np.ndarray], dcp_rank: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``write_slots`` of every write of a step in one group, in order (``block_rows[i]``
        is the row of ``writes[i]``'s request). The default calls ``write_slots`` per write;
        an engine whose kernel maps a whole batch at once overrides this one."""
        return [self.write_slots(geometry, w, row, dcp_rank) for w, row in zip(writes, block_rows)]

    # --- the worker: attention metadata ---------------------------------------------

    def kernel_block_table(self, geometry: GroupGeometry, block_row: np.ndarray) -> np.ndarray:
        """The attention kernel's block ids for a KV-manager row (``Bk < B`` splits each
        block ``b`` into kernel blocks ``b * B/Bk + [0, B/Bk)``)."""
        raise NotImplementedError

    def local_seq_lens(self, geometry: GroupGeometry, seq_lens: np.ndarray, dcp_rank: int) -> np.ndarray:
        """Entries (positions or records) ``< L`` rank ``dcp_rank`` stores, per length ``L``."""
        raise NotImplementedError

    def query_local_bounds(self, geometry: GroupGeometry, start: int, stop: int, dcp_rank: int) -> np.ndarray:
        """Keys each query token at positions ``[start, stop)`` sees in this rank's shard
        (token ``j`` sees global length ``start + j + 1``; a replicated group's shard is
        the whole context)."""
        raise NotImplementedError

    def attention_metadata(
        self, geometry: GroupGeometry, start: int, stop: int, block_row: np.ndarray, dcp_rank: int, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """What rank ``dcp_rank``'s attention reads for query tokens ``start + rows``:
        ``(slots, mask, merged)``: the store slots of the keys it reads, the
        ``[len(rows), len(slots)]`` visibility mask, and whether its result is merged
        across ranks (sharded) or stands alone (replicated: attention as with ``W = 1``)."""
        raise NotImplementedError

    def build_attention_metadata(
        self, geometry: GroupGeometry, writes: list[ReqWrite], block_rows: list[np.ndarray], dcp_rank: int
    ) -> AttentionMetadata:
        """The step's attention metadata for a paged or compressed (attention) group on rank ``dcp_rank``
        (``dcpsim.model.plan.AttentionMetadata``): global and local lengths, query offsets
        and per-token bounds, the paged plan over the rank's own kernel pages, the block
        table width the builder expects, and, for a uniform decode step padded to a
        captured CUDA-graph size (``geometry.cudagraph_capture_sizes``), the dummy
        requests and the slots of their tokens (which the worker writes unless ``PAD``)."""
        raise NotImplementedError

    def context_gather(
        self, geometry: GroupGeometry, writes: list[ReqWrite], block_rows: list[np.ndarray], dcp_rank: int
    ) -> ContextGather | None:
        """How rank ``dcp_rank`` gathers the cached context of the step's prefill rows in a
        paged full-attention group (``dcpsim.model.plan.ContextGather``), or None when no
        row has one: the rows of more than ``1 + k`` query tokens (shorter ones run as
        decodes) whose write starts past 0, cut into chunks of at most
        ``geometry.chunked_prefill_workspace_size`` workspace rows (any valid chunking: the
        reference packs them in batch order as vLLM 0.33.0 does; each request's pieces
        cover its context once, in chunk order); for each (chunk, request) the context
        tokens it covers, the rank's local rows of them (its shard only: at most its local
        context past the entry's local start) and their slots.
        ``block_rows[i]`` is ``writes[i]``'s row. Optional: an engine without it is not
        checked for the gather, and its attention reads the context directly."""
        raise NotImplementedError

    def spec_decode_mask(
        self, geometry: GroupGeometry, context_lens: np.ndarray, query_lens: np.ndarray, dcp_rank: int
    ) -> list[np.ndarray]:
        """The verify attention mask of a speculative step's decode rows in a sharded group
        (``dcpsim.model.plan.SpecDecodeMask``): for row ``i`` (``query_lens[i]`` tokens at
        positions ``context_lens[i] + [0, q)``), a bool ``[q, n]`` array over this rank's
        ``n = local_seq_lens(context + q)`` local keys, True where query token ``j`` may attend
        local key ``l``. The default derives it from ``query_local_bounds`` (key ``l`` is
        visible while ``l`` is below token ``j``'s bound): an engine whose kernel bounds each
        token by its local length (vLLM, SGLang) sees exactly those keys; an engine that builds
        an explicit mask (vllm-ascend) overrides this."""
        out = []
        for c, q in zip(np.asarray(context_lens, np.int64).tolist(), np.asarray(query_lens, np.int64).tolist()):
            bounds = np.asarray(self.query_local_bounds(geometry, c, c + q, dcp_rank), dtype=np.int64)
            n = int(np.asarray(self.local_seq_lens(geometry, np.array([c + q], np.int64), dcp_rank))[0])
            out.append(np.arange(n, dtype=np.int64)[None, :] < bounds[:, None])
        return out

    def draft_geometry(self, geometry: GroupGeometry) -> GroupGeometry:
        """The geometry the drafter's attention (MTP / EAGLE) runs with over a group that
        holds draft layers (``geometry.draft``): the draft model's own parallel config
        applied to the group's cache, with ``model = "draft"``. The worker builds the
        drafter's metadata with it (``build_attention_metadata``) beside the target's."""
        raise NotImplementedError

    # --- sparse attention (DSA: an indexer picks each token's top-k keys) --------------

    def indexer_local_rows(self, geometry: GroupGeometry, seq_len: int, dcp_rank: int) -> np.ndarray:
        """The rows of the indexer cache (group ``geometry``, an ``IndexerSpec`` group) that
        rank ``dcp_rank`` holds for a context of ``seq_len`` positions: the global position of
        each, in local order (local row ``l`` is local index ``l`` of the group's block
        table). The rank reads these rows and gives them to the gather that assembles every
        rank's indexer keys in global order (vLLM's deinterleave index); each rank calls it
        for every rank. A replicated indexer (SGLang's, in the global slot space): every
        position, read locally, no gather."""
        raise NotImplementedError

    def select_topk(self, scores: np.ndarray, topk: int, local_counts: np.ndarray, dcp_rank: int) -> np.ndarray:
        """The global top-k of each query token: ``scores [nq, n]`` (float32) of positions
        ``0..n-1``, ``-inf`` (or NaN) outside the token's causal context. Returns
        ``[nq, min(topk, n)]`` positions, ascending, ``-1`` padding a row with fewer
        candidates. The rule must be a total order every rank applies alike (semantics
        section 14: score descending, then position ascending). ``local_counts[j]``: the
        indexer rows of this rank that token ``j`` sees (vLLM's ``row_has_no_kv`` is
        ``local_counts == 0``); the selection must not depend on it."""
        raise NotImplementedError

    def sparse_local_keys(self, geometry: GroupGeometry, selected: np.ndarray, dcp_rank: int) -> np.ndarray:
        """This rank's local indices (in the sparse group ``geometry``'s shard, read through
        its kernel block table) of the selected positions ``selected [nq, k]`` (``-1``
        padding); ``-1`` where another rank holds the position. A replicated group: the
        positions themselves. vLLM: ``round_down(t // W, I) + t % I`` on rank
        ``(t // I) % W``; SGLang: ``loc // W`` where ``loc % W == r``, packed to the front."""
        raise NotImplementedError

    def attention_query_rows(self, geometry: GroupGeometry, slots: np.ndarray, dcp_rank: int) -> np.ndarray:
        """Which query tokens rank ``dcp_rank`` computes the attention of, given the slot each
        has in the rank's slot mapping (``slots[j]``: where the rank stores the KV the token
        writes in the group, ``PAD`` where another rank stores it; a compressed group's token
        that emits no record here is ``PAD`` too). A bool per token. The rule (semantics
        section 6): every one. A negative slot means another rank owns the cache row, not that
        the token is padding: only the cache write is owner-only, and a rank's partial state of
        every query token, over the keys it holds, goes to the merge. A token the rank does not
        compute is reported to the merge as an empty shard (no key: output 0, ``lse = -inf``)."""
        return np.ones(len(slots), dtype=bool)

    # --- the attention math ---------------------------------------------------------

    def shard_lse(self, lse: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        """The ``[q, heads]`` LSE a rank reports to the merge; ``empty[j]``: its shard holds
        no key for query token ``j``."""
        raise NotImplementedError

    def shard_output(self, out: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        """The ``[q, heads, D]`` output a rank reports to the merge; ``empty[j]``: its shard
        holds no key for query token ``j`` (a kernel may leave ``0/0 = NaN`` in such a row;
        its merge weight is exactly 0, and the merge must not let ``0 * NaN`` through)."""
        raise NotImplementedError

    def merge_lse(self, lses: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged LSE ``[...]`` and each shard's weight ``[W, ...]`` from ``lses [W, ...]``."""
        raise NotImplementedError

    def merge_attention_states(self, outputs: torch.Tensor, lses: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge ``W`` partial states ``outputs [W, ..., D]``, ``lses [W, ...]``."""
        raise NotImplementedError

    def merge_variant(self, variant: str, dcp_rank: int) -> str:
        """The merge pattern (``allgather`` or ``alltoall``) rank ``dcp_rank`` runs when the run
        asks for ``variant``; by default ``variant``. An engine that falls back per rank (vLLM's
        all-to-all when its communicator initialised, else the all-gather) must agree across
        the group: the harness gathers every rank's choice before the merge of an engine that
        overrides this and reports ranks that differ instead of entering collectives of
        different shapes (vllm#48248)."""
        return variant

    def merge_across_ranks(
        self, out: torch.Tensor, lse: torch.Tensor, group, *, variant: str, base: str
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Merge this rank's partial attention ``out [q, H, D]``, ``lse [q, H]`` with the
        other ranks' over ``group`` (``rank``, ``world_size``, ``all_gather_tensor``,
        ``reduce_scatter_tensor``, ``all_to_all_tensor``; ``H`` is a multiple of
        ``world_size``). ``variant`` is ``allgather`` or ``alltoall``. Returns one slice of
        ``H / world_size`` merged heads ``(out, lse, slice_index)``, optionally with a
        ``MergedBy`` as a fourth element."""
        raise NotImplementedError

    def attention_heads(self, layout: parallel.ParallelLayout, rank: int, num_heads: int, num_kv_heads: int) -> heads.RankHeads:
        """World rank ``rank``'s heads in a GQA/MHA attention layer of a model with
        ``num_heads`` query and ``num_kv_heads`` KV heads (a scenario that states them):
        the query heads it attends after the DCP all-gather of queries (in gather order), the
        KV heads its cache holds, and the KV head each gathered query head reads. By default
        TP's split and GQA's ``h // (H / kv)`` (``dcpsim.model.heads.rank_heads``, semantics
        section 12 "Heads"); used by the write path (which KV heads a slot holds) and the
        attention check."""
        return heads.rank_heads(layout, rank, num_heads, num_kv_heads)

    def merge_path(self, geometry):
        """The ``merge_across_ranks`` that merges the rows of this sharded group: by default
        this engine's. An engine whose own merge serves only some attention backends returns
        another for the rest (vllm-ascend merges its MLA and GQA decode, not compressed
        records or sparse attention). The harness merges each path's rows in one call per
        step, the paths in the order their groups first appear, the same on every rank."""
        return self.merge_across_ranks

    # --- prefill context parallelism (PCP x TP x DCP) ------------------------------------
    # Defaults: vLLM 0.33.0's rules (dcpsim.model.parallel), so an engine that knows
    # nothing of PCP runs it the vLLM way.

    def dcp_rank_of(self, layout: parallel.ParallelLayout, rank: int) -> int:
        """This world rank's DCP rank, which its writes use: its place in its DCP group
        (the (PCP, TP) grid transposed, cut into rows of ``dcp``)."""
        return layout.coords(rank).dcp_rank

    def pcp_replicated(self, query_len: int, prefill: bool, pcp: int, dcp: int) -> bool:
        """Whether every PCP rank computes the whole row (a decode; with ``dcp > 1`` a
        prefill too short to fill ``2 * pcp`` chunks) instead of its two chunks."""
        return parallel.pcp_replicated(query_len, prefill, pcp, dcp)

    def pcp_chunks(self, query_len: int, pcp: int, pcp_rank: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of the query tokens of a split row that PCP rank
        ``pcp_rank`` computes: chunks ``pcp_rank`` and ``2 * pcp - 1 - pcp_rank``."""
        return parallel.pcp_chunks(query_len, pcp, pcp_rank)

    def pcp_query_keys(self, query_len: int, pcp: int, pcp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """The PCP attention metadata of a split row on PCP rank ``pcp_rank``: the row offsets
        of the query tokens it computes ``[n]``, and for each the two key ranges of the row it
        attends ``[n, 4]`` (``lo0, hi0, lo1, hi1``): the keys before its chunk, unmasked, and
        its chunk's up to itself, masked (``model.plan.PcpQueryKeys``)."""
        queries, spans = [], []
        for offset, length in self.pcp_chunks(query_len, pcp, pcp_rank):
            q = np.arange(offset, offset + length, dtype=np.int64)
            chunk = np.full(length, offset, dtype=np.int64)
            queries.append(q)
            spans.append(np.stack([np.zeros(length, np.int64), chunk, chunk, q + 1], axis=1))
        if not queries:
            return np.zeros(0, np.int64), np.zeros((0, 4), np.int64)
        return np.concatenate(queries), np.concatenate(spans)

    def pcp_restore_offsets(self, query_len: int, pcp: int) -> np.ndarray:
        """For the all-gathered rows of a split row (rank-major: rank 0's pieces, then rank
        1's, ...), the query offset each row belongs at (vLLM's restore index)."""
        return np.concatenate([np.arange(o, o + n) for r in range(pcp) for o, n in parallel.pcp_chunks(query_len, pcp, r)]).astype(np.int64)

    def pcp_enters_gather(self, split_rows: list[tuple[int, int]], pcp: int, pcp_rank: int) -> bool:
        """Whether this PCP rank enters the step's KV all-gather; ``split_rows`` are the
        ``(start, query_len)`` of the step's split rows. Every rank of the group must
        decide the same, from metadata they share: here, whether any row is split."""
        return bool(split_rows)


PCP_DECISIONS = ("dcp_rank_of", "pcp_replicated", "pcp_chunks", "pcp_query_keys", "pcp_restore_offsets", "pcp_enters_gather")
"""The PCP decisions: the interface implements them (vLLM 0.33.0's rules), so an engine
need not."""

ENGINE_DECISIONS = (
    "kv_cache_groups",
    "group_geometry",
    "make_scheduler",
    "blocks_needed",
    "max_admissible_tokens",
    "first_needed_position",
    "num_released_blocks",
    "prefix_block_tokens",
    "prefix_hash_unit",
    "prefix_hash_block_size",
    "prefix_key_position",
    "prefix_hit_tokens",
    "write_slots",
    "kernel_block_table",
    "local_seq_lens",
    "query_local_bounds",
    "attention_metadata",
    "build_attention_metadata",
    "context_gather",
    "spec_decode_mask",
    "draft_geometry",
    "indexer_local_rows",
    "select_topk",
    "sparse_local_keys",
    "attention_query_rows",
    "shard_lse",
    "shard_output",
    "merge_lse",
    "merge_attention_states",
    "merge_variant",
    "merge_across_ranks",
    "attention_heads",
    *PCP_DECISIONS,
)
"""Every decision of the interface, in the order above (reports list who makes each)."""
