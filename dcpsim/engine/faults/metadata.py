"""Attention-metadata faults: local lengths, query bounds, the paged plan, block-table widths and
CUDA-graph padding, as the metadata builder hands them to the kernel (bug classes 3, 11-15, 28, 29,
42, 45 and 46).

Three of them keep state across steps, as a CUDA graph's persistent inputs or a running count do:
the engine is a fresh instance on every rank's run (``Job.build_engine``), and the state is kept
per (DCP rank, group, model)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dcpsim.engine.faults.base import Fault, has_sharded_attention
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import Scheduler
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import PAD, local_seq_lens


def captured_size(geometry, q_lens: np.ndarray) -> int | None:
    """The captured CUDA-graph size a step of these query lengths replays (a uniform decode
    step up to the largest size), or None: it runs eagerly (section 10)."""
    q = 1 + geometry.num_speculative_tokens
    if not geometry.cudagraph_capture_sizes or len(q_lens) == 0 or (q_lens != q).any():
        return None
    return next((c for c in geometry.cudagraph_capture_sizes if c >= len(q_lens) * q and c % q == 0), None)


def graph_steps(scenario, geometries) -> list[tuple[int, int]]:
    """``(captured size, dummy requests)`` of every step of the (reference) schedule that
    replays a CUDA graph in some attention group (the sizes are the config's, the same in
    every group)."""
    engine, out = ReferenceEngine(), []
    for plan in Scheduler(scenario, engine, geometries).plans():
        q_lens = np.array([w.stop - w.start for w in plan.writes], np.int64)
        for g in geometries:
            if g.storage in (Storage.PAGED, Storage.RECORDS) and captured_size(g, q_lens) is not None:
                out.append((captured_size(g, q_lens), engine.cudagraph_dummies(g, q_lens)[0]))
                break
    return out


class MultiTokenLocalLens(Fault):
    name = "multi-token-local-lens"
    bug_class = "3. local lengths of multi-token queries derived as local(L) - k instead of per token"
    description = (
        "the attention of a multi-token step (chunked prefill, draft verification) bounds query "
        "token j on rank r by local(H+q, r) - (q-1-j) instead of local(H+j+1, r): ranks that own "
        "none of the step's last positions hide keys the token must see (sharded groups only)"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 16},)

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        q = stop - start
        if q == 0:
            return np.zeros(0, np.int64)
        last = stop if geometry.storage is not Storage.RECORDS else stop // geometry.tokens_per_state
        local_last = local_seq_lens(
            np.array([last], np.int64), dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size, dcp_rank=dcp_rank
        )[0]
        return np.maximum(0, local_last - (q - 1 - np.arange(q, dtype=np.int64)))


def plan_from_global_lens(engine, geometry, meta, block_rows):
    """``meta`` with its paged plan counted from the global lengths instead of the local ones."""
    kernel = geometry.kernel_block_size or geometry.states_per_page
    pages = -(-meta.seq_lens // kernel)
    table = [engine.kernel_block_table(geometry, np.asarray(r, np.int64)) for r in block_rows]
    table += [np.zeros(0, np.int64)] * meta.num_dummy_requests
    indices = [np.resize(t, n) if len(t) else np.zeros(n, np.int64) for t, n in zip(table, pages)]
    return dataclasses.replace(
        meta,
        kv_indptr=np.concatenate([[0], np.cumsum(pages)]),
        kv_indices=np.concatenate(indices) if indices else np.zeros(0, np.int64),
        kv_last_page_len=np.where(pages > 0, meta.seq_lens - (pages - 1) * kernel, 0),
    )


class _ShardedMetadataFault(Fault):
    """A bug in the metadata builder of sharded groups: ``corrupt`` changes what the
    reference builds for a sharded group (replicated groups keep theirs)."""

    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        return self.corrupt(geometry, meta, block_rows) if geometry.sharded else meta

    def corrupt(self, geometry, meta, block_rows):
        raise NotImplementedError


class PlanPagesFromGlobalLen(_ShardedMetadataFault):
    name = "plan-pages-from-global-len"
    bug_class = "11. paged-attention plan counting pages from the global length (vllm#48003)"
    description = (
        "the FlashInfer-style plan (kv_indptr, kv_indices, kv_last_page_len) of a sharded group "
        "counts cdiv(L, Bk) pages of the global length L instead of the rank's local length, so "
        "the kernel reads pages the rank never filled (gibberish from the first token)"
    )

    def corrupt(self, geometry, meta, block_rows):
        return plan_from_global_lens(self, geometry, meta, block_rows)


class GlobalSeqLensOverwritten(_ShardedMetadataFault):
    name = "global-seq-lens-overwritten"
    bug_class = "12. global sequence lengths read after being overwritten with local ones (vllm#28990)"
    description = (
        "a sharded group's builder overwrites seq_lens in place with the DCP-local lengths and a "
        "later consumer reads them as the global lengths"
    )

    def corrupt(self, geometry, meta, block_rows):
        return dataclasses.replace(meta, seq_lens=meta.dcp_local_seq_lens.copy())


class PageTableTranslatedTwice(_ShardedMetadataFault):
    name = "page-table-translated-twice"
    bug_class = "45. a DCP page table translated from virtual to physical twice (sglang#33325)"
    description = (
        "the paged plan of a sharded group looks each of the rank's pages up in the block table and then looks "
        "the physical block id up again as if it were a virtual page index (entries past the row read the null "
        "block), so the kernel reads pages of other positions or of other requests"
    )

    def corrupt(self, geometry, meta, block_rows):
        if not len(meta.kv_indices):
            return meta
        rows = [np.asarray(r, np.int64) for r in block_rows] + [np.zeros(0, np.int64)] * meta.num_dummy_requests
        indices = meta.kv_indices.copy()
        for i, row in enumerate(rows):
            table = self.kernel_block_table(geometry, row) if len(row) else np.zeros(0, np.int64)
            piece = indices[meta.kv_indptr[i] : meta.kv_indptr[i + 1]]
            inside = piece < len(table)
            piece[:] = np.where(inside, table[np.where(inside, piece, 0)] if len(table) else 0, 0)
        return dataclasses.replace(meta, kv_indices=indices)


def empty_row_before_another(scenario, geometries) -> bool:
    """Whether some step of the (reference) schedule has, on some DCP rank of a sharded
    group, a request with no local keys followed in batch order by one with some: the
    rows a builder that drops empty rows would shift."""
    engine = ReferenceEngine()
    sharded = [g for g in geometries if g.sharded and g.storage in (Storage.PAGED, Storage.RECORDS)]
    if not sharded:
        return False
    for plan in Scheduler(scenario, engine, geometries).plans():
        for g in sharded:
            R = g.tokens_per_state if g.storage is Storage.RECORDS else 1
            seq = np.array([w.stop // R for w in plan.writes], np.int64)
            for r in range(g.dcp_size):
                local = engine.local_seq_lens(g, seq, r)
                empty = np.flatnonzero(local == 0)
                if len(empty) and (local[empty[0] :] > 0).any():
                    return True
    return False


class ZeroLocalRowsCompacted(_ShardedMetadataFault):
    name = "zero-local-rows-compacted"
    bug_class = (
        "46. rows with no local keys dropped from a rank's per-row metadata, shifting the later rows (ROCm/ATOM#2057, vllm-ascend#11807)"
    )
    description = (
        "a sharded group's builder compacts its per-row arrays (dcp_local_seq_lens, kv_indptr, kv_last_page_len) "
        "over the requests that hold keys on the rank, while request_ids, seq_lens and query_start_loc keep every "
        "row: the request after an empty one gets the next request's local length and pages, the last rows zeros"
    )
    # a request owns no keys on rank r while L <= r * I: W = 4, I = 16 on many-short (prompts of 40 tokens
    # beside longer ones); with --attention, the config whose baselines selftest already runs
    configs = ({"decode_context_parallel_size": 4, "cp_kv_cache_interleave_size": 16, "attention": True},)
    scenarios = ("many-short",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return empty_row_before_another(scenario, geometries)

    def corrupt(self, geometry, meta, block_rows):
        keep = meta.dcp_local_seq_lens > 0
        if keep.all() or not keep.any():
            return meta

        def compacted(values):
            out = np.zeros_like(values)
            out[: int(keep.sum())] = values[keep]
            return out

        pages = compacted(np.diff(meta.kv_indptr))
        return dataclasses.replace(
            meta,
            dcp_local_seq_lens=compacted(meta.dcp_local_seq_lens),
            kv_indptr=np.concatenate([np.zeros(1, np.int64), pages.cumsum()]),
            kv_last_page_len=compacted(meta.kv_last_page_len),
        )


class LocalLensPlusOne(Fault):
    name = "local-lens-plus-one"
    bug_class = "13. DCP local lengths one too long on every rank when L % W == 0 (vllm#27518)"
    description = (
        "the local sequence length of a sharded group is computed one too long on every rank "
        "when the global length is a multiple of W (an off-by-one in the ceiling), so every "
        "rank attends to one key it does not hold"
    )
    layouts = ("vllm",)
    """Helix's local lengths are counted from its own placement (``model.helix``), not from
    the ``local_seq_lens`` formula this bug is in."""
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return has_sharded_attention(geometries)

    def local_seq_lens(self, geometry, seq_lens, dcp_rank):
        lens = super().local_seq_lens(geometry, seq_lens, dcp_rank)
        if not geometry.sharded:
            return lens
        seq = np.asarray(seq_lens, np.int64)
        return np.where((seq > 0) & (seq % geometry.dcp_size == 0), lens + 1, lens)


class BlockTableWidthUnsharded(_ShardedMetadataFault):
    name = "block-table-width-unsharded"
    bug_class = "14. two consumers of one block table sized differently (vllm#50302, '16384 vs 8192')"
    description = (
        "the attention-metadata builder of a sharded group sizes the block table from the full "
        "context (cdiv(max_model_len, B)) while the worker's table holds cdiv(max_model_len, B*W) "
        "entries: W times too wide"
    )

    def corrupt(self, geometry, meta, block_rows):
        return dataclasses.replace(meta, block_table_width=meta.block_table_width * geometry.dcp_size)


class CudagraphPaddingWrites(Fault):
    name = "cudagraph-padding-writes"
    bug_class = "15. CUDA-graph padding tokens writing KV (dummy requests must map to PAD)"
    description = (
        "the dummy tokens that pad a uniform decode step to a captured CUDA-graph size get slots "
        "from the dummy requests' all-null block-table rows (slots 0.. in the null block) instead "
        "of PAD, so padding writes KV"
    )
    needs = {"max_cudagraph_capture_size": 64}

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where some step of the (reference) schedule is padded: a uniform decode step
        whose token count is not itself a captured size. Two requests decoding one token
        each (kv-events-full) fill a captured size exactly, and no dummy ever runs."""
        return any(dummies for _, dummies in graph_steps(scenario, geometries))

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        n = len(meta.padded_slot_mapping)
        if not n:
            return meta
        q = 1 + geometry.num_speculative_tokens
        return dataclasses.replace(meta, padded_slot_mapping=np.tile(np.arange(q, dtype=np.int64), n // q))


class PaddedSlotsNotReset(Fault):
    name = "padded-slots-not-reset"
    bug_class = "28. a reused slot-mapping buffer's padding not reset to PAD (vllm-ascend#5647)"
    description = (
        "the slot mapping of a step lives in one persistent buffer of every token the batch can hold; "
        "a step padded to a captured CUDA-graph size hands the kernel the buffer up to the padded size "
        "without resetting the padding to PAD, so the dummy tokens write KV at the slots the tokens of an "
        "earlier, longer step left there"
    )
    needs = {"max_cudagraph_capture_size": 64}

    def __init__(self) -> None:
        self._slot_buffers: dict[tuple, np.ndarray] = {}
        """(DCP rank, group, model) -> the persistent slot-mapping buffer."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where a padded step follows a step of more tokens (its slots are still in the
        buffer where the padding is): a prefill of more than the padded size does."""
        return CudagraphPaddingWrites().applies_to_scenario(scenario, geometries)

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        buffers, key = self._slot_buffers, (dcp_rank, geometry.group_id, geometry.model)
        mapped = [self.write_slots(geometry, w, row, dcp_rank)[0] for w, row in zip(writes, block_rows)]
        real = np.concatenate(mapped).astype(np.int64) if mapped else np.zeros(0, np.int64)
        old = buffers.get(key, np.zeros(0, np.int64))
        buffer = np.concatenate([real, old[len(real) :]])
        buffers[key] = buffer
        n = len(meta.padded_slot_mapping)
        if not n:
            return meta
        stale = np.full(n, PAD, np.int64)
        left = buffer[len(real) : len(real) + n]
        stale[: len(left)] = left
        return dataclasses.replace(meta, padded_slot_mapping=stale)


class CudagraphStaleLocalLens(Fault):
    name = "cudagraph-stale-local-lens"
    bug_class = "29. DCP local lengths rebuilt in a fresh buffer each step, so a CUDA graph replays the captured address (vllm#36070)"
    description = (
        "a sharded group's builder writes dcp_local_seq_lens into a new tensor every step instead of the "
        "persistent buffer the CUDA graph was captured with: a replayed graph reads the buffer of the step "
        "that captured it, so every later step of that size attends with the capture step's local lengths"
    )
    needs = {"max_cudagraph_capture_size": 64}
    configs = ({"decode_context_parallel_size": 2},)

    def __init__(self) -> None:
        self._captured: dict[tuple, np.ndarray] = {}
        """(DCP rank, group, model, captured size) -> the local lengths its graph reads."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where a captured size is replayed (two graph steps of one size) and DCP shards a group."""
        sizes = [size for size, _ in graph_steps(scenario, geometries)]
        return has_sharded_attention(geometries) and len(set(sizes)) < len(sizes)

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        size = captured_size(geometry, np.array([w.stop - w.start for w in writes], np.int64))
        if not geometry.sharded or size is None:
            return meta
        captured, key = self._captured, (dcp_rank, geometry.group_id, geometry.model, size)
        if key not in captured:  # the step that captures the graph reads its own buffer
            captured[key] = meta.dcp_local_seq_lens.copy()
            return meta
        return dataclasses.replace(meta, dcp_local_seq_lens=captured[key].copy())


class SpecMaskInterleaveOne(Fault):
    name = "spec-mask-interleave-one"
    bug_class = (
        "39. The spec-decode verify mask under DCP built as if position p lived on rank p % W "
        "(interleave 1) (vllm-ascend 0.23.0.post1 generate_mtp_attention_mask_for_decode; fixed by vllm-ascend#11492, #11849)"
    )
    description = (
        "a sharded group's verify mask lets query token j see local key l while l <= (c + j - r) // W, which counts "
        "the rank's keys as if position p lived on rank p % W: with I > 1 a verify query sees later draft tokens "
        "held on its rank and loses keys it must see"
    )
    scenarios = ("mtp-mask-interleave",)

    def applies_to(self, geometries) -> bool:
        return any(g.sharded and g.storage is Storage.PAGED and g.num_speculative_tokens for g in geometries)

    def spec_decode_mask(self, geometry, context_lens, query_lens, dcp_rank):
        W = geometry.dcp_size
        out = []
        for c, q in zip(np.asarray(context_lens).tolist(), np.asarray(query_lens).tolist()):
            n = int(self.local_seq_lens(geometry, np.array([c + q], np.int64), dcp_rank)[0])
            upper = (c + np.arange(q, dtype=np.int64) - dcp_rank) // W
            out.append(np.arange(n, dtype=np.int64)[None, :] <= upper[:, None])
        return out


class VerifyLocalLensMinusRejected(Fault):
    name = "verify-local-lens-minus-rejected"
    bug_class = (
        "42. after a verify, each rank's local lengths corrected by subtracting the rejected drafts instead of being "
        "re-derived from the corrected global length (vllm#50391, vllm#54278, vllm#24322)"
    )
    description = (
        "a sharded group's builder keeps each request's DCP local length as a running count: after a speculative "
        "step it subtracts the number of rejected drafts from every rank's local length, although each rank held "
        "only its share of them, instead of taking local(H, r) of the corrected global length H; the next step's "
        "local lengths and per-token bounds, local(H + j + 1, r), come out short on the ranks that held fewer"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def __init__(self) -> None:
        self._running: dict[tuple, tuple[int, int, int]] = {}
        """(DCP rank, group, model, request) -> (global length after its last step, its drafts, the
        local length the builder kept)."""

    def applies_to(self, geometries) -> bool:
        return any(g.sharded and g.storage is Storage.PAGED and g.num_speculative_tokens for g in geometries)

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        if not geometry.sharded or geometry.storage is not Storage.PAGED:
            return meta
        local, bounds = meta.dcp_local_seq_lens.copy(), meta.query_local_bounds.copy()
        for i, w in enumerate(writes):
            key = (dcp_rank, geometry.group_id, geometry.model, w.request_id)
            kept = self._running.get(key)
            if kept is not None and 0 <= kept[0] - w.start <= kept[1]:  # the drafts of its last step, less the accepted
                right = int(self.local_seq_lens(geometry, np.array([w.start], np.int64), dcp_rank)[0])
                shift = max(0, kept[2] - (kept[0] - w.start)) - right
                local[i] += shift
                bounds[meta.query_start_loc[i] : meta.query_start_loc[i + 1]] += shift
            self._running[key] = (w.stop, w.num_drafts, int(local[i]))
        return dataclasses.replace(meta, dcp_local_seq_lens=local, query_local_bounds=bounds)
