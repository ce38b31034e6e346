"""The reference engine: vLLM's DCP semantics plus the seed's ``dcp_replicated``.

Every decision of ``Engine`` made the way ``docs/dcp-semantics.md`` says, with the fast,
vectorized layout math of ``dcpsim.model.layout``. Faults subclass it and change one
decision; the checker never calls it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading

import numpy as np
import torch

from dcpsim.engine.attention.merge import merge_attention_states, merge_lse, scale_output
from dcpsim.engine.geometry import GroupGeometry, derive_geometry
from dcpsim.engine.interface import Engine
from dcpsim.errors import ConfigError
from dcpsim.model.arith import cdiv
from dcpsim.model.config import SimConfig
from dcpsim.model.context_gather import ContextSlots, local_gather, local_gathers, plan_chunk_arrays
from dcpsim.model.grouping import KVCacheGroupSpec, check_groups_for_dcp, group_layer_specs
from dcpsim.model.helix import decode_block_of, helix_blocks_needed, helix_local_keys, helix_slot_mapping
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import (
    PAD,
    kernel_block_table,
    local_seq_lens,
    query_local_seq_lens,
    record_slot_mapping,
    records_emitted,
    ring_slot_mapping,
    ring_states_to_write,
    runs_slot_mapping,
    slot_mapping,
    state_slot_mapping,
    state_writes,
    validate_layout,
)
from dcpsim.model.plan import PAD_REQUEST, AttentionMetadata, ContextGather, ReqWrite
from dcpsim.model.sparse import vllm_topk_local_index


class ReferenceEngine(Engine):
    name = "reference"
    description = "the correct engine: vLLM DCP semantics plus the seed's dcp_replicated"

    # --- the model ------------------------------------------------------------------

    def kv_cache_groups(self, layer_specs):
        return group_layer_specs(layer_specs)

    def group_geometry(self, group_id: int, group: KVCacheGroupSpec, config: SimConfig) -> GroupGeometry:
        check_groups_for_dcp([group], config)
        geometry = derive_geometry(group_id, group, config)
        if config.kv_cache_layout == "helix":  # one spare entry a row: helix_blocks_needed
            # Helix lays a prompt out a block per rank, I = B: the workspace is aligned to it too
            # (lcm(B, W * B) rows), or a chunk could never hold one rank's block of a context
            helix = dataclasses.replace(config, cp_kv_cache_interleave_size=geometry.block_size)
            fields = {f.name: getattr(geometry, f.name) for f in dataclasses.fields(geometry)}
            fields["chunked_prefill_workspace_size"] = derive_geometry(group_id, group, helix).chunked_prefill_workspace_size
            return HelixGeometry(**{**fields, "interleave_size": geometry.block_size}).with_spare_entry()
        return geometry

    def make_scheduler(self, scenario, geometries, connector=None):
        self.remember_prompts(scenario)
        return super().make_scheduler(scenario, geometries, connector=connector)

    def remember_prompts(self, scenario) -> None:
        """Helix places a request's tokens by where its decoding starts: its prompt length
        (``helix_prompt_len``); every scheduler this engine makes records them."""
        self.__dict__["_helix_prompts"] = {r.request_id: r.prompt_len for r in scenario.requests}

    def helix_prompt_len(self, request_id: str) -> int:
        """Where request ``request_id``'s decoding starts (its prompt length, Helix's layout)."""
        return self.__dict__["_helix_prompts"][request_id]

    def helix_decode_blocks(self, decode_tokens: np.ndarray, block_size: int, dcp_size: int) -> np.ndarray:
        """The decode block of each decode token (0-based from the first decode step): TensorRT-LLM's
        ``(max(1, iteration) - 1) // tokens_per_block`` for the iteration ``t + 1``; it lies on rank
        ``block % W`` (``dcpsim.model.helix``)."""
        return decode_block_of(decode_tokens, block_size)

    # --- the scheduler --------------------------------------------------------------

    def blocks_needed(self, geometry: GroupGeometry, num_tokens: int) -> int:
        if isinstance(geometry, HelixGeometry):
            return helix_blocks_needed(num_tokens, geometry.block_size, geometry.dcp_size)
        if geometry.storage is Storage.RING:
            return 1
        if geometry.storage is Storage.STATE:
            # vLLM's MambaManager: one entry per block of tokens plus one per speculative
            # token (1 + k in 'none' mode, where a block covers max_model_len tokens)
            return cdiv(num_tokens, geometry.manager_block_size) + geometry.spec.num_speculative_blocks
        return cdiv(num_tokens, geometry.manager_block_size)

    def max_admissible_tokens(self, geometries, pool_sizes) -> int | None:
        # logical tokens once against the logical capacity: a block of a group that holds the
        # whole context is a manager block of tokens (B * W sharded, B replicated)
        limits = [
            self._admissible(g, n)
            for g, n in zip(geometries, pool_sizes)
            if g.retention is Retention.FULL and g.storage in (Storage.PAGED, Storage.RECORDS)
        ]
        return min(limits, default=None)

    def _admissible(self, g: GroupGeometry, blocks: int) -> int:
        """The longest request ``blocks`` blocks of group ``g`` hold."""
        if isinstance(g, HelixGeometry):  # helix_blocks_needed: one spare entry a row
            return max(0, blocks - 1) * g.block_size * g.dcp_size
        return blocks * g.manager_block_size

    def first_needed_position(self, geometry: GroupGeometry, num_committed: int) -> int:
        if geometry.retention in (Retention.WINDOW, Retention.CHUNK):
            return geometry.spec.first_needed_position(num_committed)
        if geometry.retention is Retention.RING:
            # A step writes k + 1 rows; with every draft rejected only C - k committed rows
            # survive, which must include the previous row.
            return max(0, num_committed - (geometry.block_size - geometry.num_speculative_tokens))
        if geometry.retention is Retention.STATE:
            return max(0, num_committed - 1)  # only the state after the last committed token
        return 0

    def num_released_blocks(self, geometry: GroupGeometry, first_needed: int) -> int:
        return first_needed // geometry.manager_block_size  # whole blocks only

    def prefix_block_tokens(self, geometry) -> int:
        return geometry.manager_block_size  # tokens, so a compressed cache's R is in it

    def prefix_hash_unit(self, geometries) -> int:
        # upstream 0.33.0: hash at the GCD of the groups' block spans, hit at their LCM
        return math.lcm(*(self.prefix_block_tokens(g) for g in geometries))

    def prefix_hash_block_size(self, geometries) -> int:
        return math.gcd(*(self.prefix_block_tokens(g) for g in geometries))

    def prefix_key_position(self, geometries, block: int) -> int:
        return (block + 1) * self.prefix_hash_block_size(geometries) - 1

    def partial_hit_to_copy(self, recorded, found):
        """The partial-block hit an admission copies into its private block (the reference's own
        decision, ``prefix_match_unit``): ``found``, the one this admission's lookup found (the
        hit's metadata refreshed, vLLM's record dropped with the request's blocks), never
        ``recorded``, one an earlier admission attempt of the request found (its source block
        may have been handed out and rewritten since; semantics section 5, bug class 54)."""
        return found

    # --- the worker: writes ---------------------------------------------------------

    def write_slots(self, geometry: GroupGeometry, write: ReqWrite, block_row: np.ndarray, dcp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        g, start, stop = geometry, write.start, write.stop
        if isinstance(g, HelixGeometry):
            return self._helix_write_slots(g, write, block_row, dcp_rank)
        if g.storage is Storage.STATE:
            positions, columns = state_writes(
                start, stop, write.num_drafts, block_size=g.block_size, align=g.spec.mamba_cache_mode == "align"
            )
            return state_slot_mapping(columns, block_row), positions
        if g.storage is Storage.RING:
            states = ring_states_to_write(start, stop, g.block_size)
            return ring_slot_mapping(states, int(block_row[0]), g.block_size), states
        kbs = g.kernel_block_size
        if g.storage is Storage.RECORDS:
            R = g.tokens_per_state
            records = records_emitted(start, stop, R)
            # a run of records as a range: the mapping's fast path (what it finds an array of
            # two or more consecutive ones to be), without the scan that finds it
            run = range(int(records[0]), int(records[-1]) + 1) if len(records) > 1 else records
            slots = record_slot_mapping(
                run,
                block_row,
                block_size=g.block_size,
                tokens_per_state=R,
                dcp_size=g.dcp_size,
                dcp_rank=dcp_rank,
                interleave_size=g.interleave_size,
                kernel_block_size=kbs * R if kbs else None,
                replicated=g.replicated,
            )
            return slots, records
        slots = slot_mapping(
            range(start, stop),
            block_row,
            block_size=g.block_size,
            dcp_size=g.dcp_size,
            dcp_rank=dcp_rank,
            interleave_size=g.interleave_size,
            kernel_block_size=kbs,
            replicated=g.replicated,
        )
        return slots, np.arange(start, stop, dtype=np.int64)

    def _helix_write_slots(self, g: GroupGeometry, write: ReqWrite, block_row: np.ndarray, dcp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """A write under Helix: each position on the rank its prompt block or decode block names;
        the other ranks write nothing (``PAD``)."""
        positions = np.arange(write.start, write.stop, dtype=np.int64)
        P = self.helix_prompt_len(write.request_id)
        decode = positions[positions >= P] - P
        blocks = self.helix_decode_blocks(decode, g.block_size, g.dcp_size) if len(decode) else None
        if len(block_row):
            self._helix_rows()[(g.group_id, int(block_row[0]))] = write.request_id
        slots = helix_slot_mapping(
            positions, block_row, prompt_len=P, block_size=g.block_size, dcp_size=g.dcp_size, dcp_rank=dcp_rank, decode_blocks=blocks
        )
        return slots, positions

    def _helix_step_rows(self) -> dict:
        """(thread, group, rank) -> (request id, start, tokens, prefill) of each write of the
        group's current step on that rank (Helix): a verify mask is asked by (context, tokens)
        alone, and Helix places a row's keys by its request's prompt length. By thread too: ranks
        run as threads of one process share the engine (``--in-process``)."""
        return self.__dict__.setdefault("_helix_step_row_list", {})

    def spec_decode_mask(self, geometry, context_lens, query_lens, dcp_rank):
        if not isinstance(geometry, HelixGeometry):
            return self._bounded_masks(geometry, context_lens, query_lens, dcp_rank)
        # the verify rows the worker asks about: the step's decode rows of 1 <= q <= 1 + k tokens past a context
        q_max = 1 + geometry.num_speculative_tokens
        step = self._helix_step_rows().get((threading.get_ident(), geometry.group_id, dcp_rank), ())
        rows = [(r, s, n) for r, s, n, prefill in step if not prefill and s > 0 and 1 <= n <= q_max]
        asked = list(zip(np.asarray(context_lens, np.int64).tolist(), np.asarray(query_lens, np.int64).tolist()))
        if [(s, n) for _, s, n in rows] != asked:
            raise ValueError(f"Helix verify mask asked for rows {asked}, the step's verify rows are {[(s, n) for _, s, n in rows]}")
        out = []
        for request_id, c, q in rows:  # a verify row of 1 + d tokens: d its request's own drafts
            P, B, W = self.helix_prompt_len(request_id), geometry.block_size, geometry.dcp_size
            positions, _ = helix_local_keys(c + q, prompt_len=P, block_size=B, dcp_size=W, dcp_rank=dcp_rank)
            out.append(positions[None, :] <= c + np.arange(q, dtype=np.int64)[:, None])
        return out

    def _bounded_masks(self, g: GroupGeometry, context_lens, query_lens, dcp_rank: int) -> list[np.ndarray]:
        """``Engine.spec_decode_mask``'s masks (key ``l`` visible below token ``j``'s local
        bound), every row's bounds in one vectorized pass when this engine keeps the reference's
        ``query_local_bounds`` and ``local_seq_lens`` (``_step_query_bounds``); a row's local
        keys are its last token's bound (that token sees the row's whole length)."""
        if _overridden(self, "query_local_bounds") or _overridden(self, "local_seq_lens") or g.storage is not Storage.PAGED:
            return super().spec_decode_mask(g, context_lens, query_lens, dcp_rank)
        starts, q_lens = np.asarray(context_lens, np.int64), np.asarray(query_lens, np.int64)
        if not len(q_lens) or starts.min() < 0 or q_lens.min() < 1:
            return super().spec_decode_mask(g, context_lens, query_lens, dcp_rank)
        bounds = self._step_query_bounds(g, None, starts, q_lens, dcp_rank)
        ends = q_lens.cumsum()
        keys = np.arange(int(bounds[ends - 1].max()), dtype=np.int64)
        return [keys[None, : bounds[b - 1]] < bounds[b - q : b, None] for q, b in zip(q_lens.tolist(), ends.tolist())]

    def _helix_rows(self) -> dict:
        """(group, first block id of a row) -> the request writing through it (Helix): with
        prefix caching off a live request's blocks are its own, so attention, which is handed a
        row, finds whose prompt length places its keys."""
        return self.__dict__.setdefault("_helix_row_requests", {})

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        if isinstance(geometry, HelixGeometry):  # the step's rows, for its verify mask (spec_decode_mask)
            step = [(w.request_id, w.start, len(w.contents), w.prefill) for w in writes]
            self._helix_step_rows()[(threading.get_ident(), geometry.group_id, dcp_rank)] = step
        # a paged or compressed group's runs mapped in one vectorized pass (the reference's
        # write_slots, so only when this engine keeps it); anything the per-write mapping
        # would reject goes through it, which raises as it does
        # (from three writes on: for two, the joined pass costs what two calls of write_slots do)
        batch = len(writes) > 2 and geometry.storage in (Storage.PAGED, Storage.RECORDS) and not isinstance(geometry, HelixGeometry)
        runs = self._step_runs(geometry, writes, block_rows, dcp_rank) if batch else None
        if runs is None:
            return super().step_write_slots(geometry, writes, block_rows, dcp_rank)
        g, (starts, stops, rows, B) = geometry, runs
        W, I = g.dcp_size, g.interleave_size
        slots, index, ends = runs_slot_mapping(
            starts, stops, rows, block_size=B, dcp_size=W, dcp_rank=dcp_rank, interleave_size=I, replicated=g.replicated
        )
        bounds = [0, *ends.tolist()]
        return [(slots[a:b], index[a:b]) for a, b in zip(bounds, bounds[1:])]

    def _step_runs(self, g: GroupGeometry, writes, block_rows, dcp_rank: int):
        """``(starts, stops, rows, B)``: each write's run of indices (positions, or records
        of ``R`` tokens in pages of ``B = block_size // R``), or None when the per-write
        path must map them (another ``write_slots``, a layout or a row the mapping rejects).
        ``g``: a paged or compressed group."""
        if _overridden(self, "write_slots"):
            return None
        R = g.tokens_per_state if g.storage is Storage.RECORDS else 1
        if not isinstance(R, int) or R < 1 or g.block_size % R or not 0 <= dcp_rank < g.dcp_size:
            return None
        B = g.block_size // R
        # validated as slot_mapping validates it (cached); a rejection raises in the per-write path
        kbs = (g.kernel_block_size or None) if R > 1 else g.kernel_block_size  # as write_slots hands it on
        try:
            validate_layout(
                block_size=B, dcp_size=g.dcp_size, interleave_size=g.interleave_size, kernel_block_size=kbs, replicated=g.replicated
            )
        except ConfigError:
            return None
        span = B * (g.dcp_size if g.dcp_size > 1 and not g.replicated else 1)
        starts, stops, rows = [], [], []
        for w, row in zip(writes, block_rows):
            lo, hi = w.start // R, w.stop // R
            row = np.asarray(row, dtype=np.int64)
            if lo < 0 or row.ndim != 1 or (hi > lo and (hi - 1) // span >= len(row)):
                return None
            starts.append(lo)
            stops.append(max(lo, hi))
            rows.append(row)
        return starts, stops, rows, B

    # --- the worker: attention metadata ---------------------------------------------

    def kernel_block_table(self, geometry: GroupGeometry, block_row: np.ndarray) -> np.ndarray:
        page = geometry.states_per_page
        return kernel_block_table(block_row, block_size=page, kernel_block_size=geometry.kernel_block_size or page)

    def local_seq_lens(self, geometry: GroupGeometry, seq_lens: np.ndarray, dcp_rank: int) -> np.ndarray:
        if not geometry.sharded:
            return np.asarray(seq_lens, dtype=np.int64)
        return local_seq_lens(seq_lens, dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size, dcp_rank=dcp_rank)

    def query_local_bounds(self, geometry: GroupGeometry, start: int, stop: int, dcp_rank: int) -> np.ndarray:
        if geometry.storage is Storage.RECORDS or not geometry.sharded:  # records emitted at positions <= p
            tps = geometry.tokens_per_state if geometry.storage is Storage.RECORDS else 1
            lens = (np.arange(start, stop, dtype=np.int64) + 1) // tps
            return self.local_seq_lens(geometry, lens, dcp_rank)
        return query_local_seq_lens(
            start, stop - start, dcp_size=geometry.dcp_size, dcp_rank=dcp_rank, interleave_size=geometry.interleave_size
        )

    def attention_metadata(self, geometry, start, stop, block_row, dcp_rank, rows):
        if isinstance(geometry, HelixGeometry):
            request_id = self._helix_rows().get((geometry.group_id, int(block_row[0]) if len(block_row) else -1))
            local, mask = self._helix_keys(geometry, self.helix_prompt_len(request_id), start, stop, dcp_rank, rows)
            return self._read_slots(geometry, block_row, local), mask, True
        local, mask, merged = self._attention_keys(geometry, start, stop, dcp_rank, rows)
        return self._read_slots(geometry, block_row, local), mask, merged

    def _helix_keys(self, g: GroupGeometry, prompt_len: int, start: int, stop: int, dcp_rank: int, rows: np.ndarray):
        """(local slot indices read, visibility mask) of query tokens ``start + rows`` under Helix:
        the rank's keys below the step's end, in local order, each visible to the queries at or
        after its position (the gaps of Helix's blocks are never read)."""
        rows = np.asarray(rows, dtype=np.int64)
        positions, local = helix_local_keys(stop, prompt_len=prompt_len, block_size=g.block_size, dcp_size=g.dcp_size, dcp_rank=dcp_rank)
        return local, positions[None, :] <= (start + rows)[:, None]

    def _attention_keys(self, g: GroupGeometry, start: int, stop: int, dcp_rank: int, rows: np.ndarray):
        """(local indices read, visibility mask, merged) of query tokens ``start + rows``."""
        if g.storage in (Storage.RING, Storage.STATE):
            raise ValueError(f"a {g.storage} group holds recurrent state, not attention KV")
        rows = np.asarray(rows, dtype=np.int64)
        if g.sharded:
            bounds = np.asarray(self.query_local_bounds(g, start, stop, dcp_rank), dtype=np.int64)[rows]
            local = np.arange(int(bounds.max(initial=0)), dtype=np.int64)
            return local, local[None, :] < bounds[:, None], True
        # replicated (or W == 1): the local index is the global one, attention as with W == 1
        positions = start + rows
        if g.storage is Storage.RECORDS:
            counts = (positions + 1) // g.tokens_per_state
            local = np.arange(int(counts.max(initial=0)), dtype=np.int64)
            return local, local[None, :] < counts[:, None], False
        if g.retention is Retention.WINDOW:
            lo = np.maximum(0, positions - g.spec.sliding_window + 1)
        elif g.retention is Retention.CHUNK:
            lo = positions - positions % g.spec.attention_chunk_size
        else:
            lo = np.zeros_like(positions)
        local = np.arange(int(lo.min(initial=start)), int(positions.max(initial=start - 1)) + 1, dtype=np.int64)
        mask = (local[None, :] <= positions[:, None]) & (local[None, :] >= lo[:, None])
        return local, mask, False

    def _read_slots(self, g: GroupGeometry, block_row: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Slots of local indices through the kernel block table (PAD past the row)."""
        bk = g.kernel_block_size or g.states_per_page
        kernel_ids = self.kernel_block_table(g, np.asarray(block_row, dtype=np.int64))
        kblock, offset = np.divmod(local, bk)
        inside = kblock < len(kernel_ids)
        slots = np.full(len(local), PAD, dtype=np.int64)
        slots[inside] = kernel_ids[kblock[inside]] * bk + offset[inside]
        return slots

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        if isinstance(geometry, HelixGeometry):
            return self._helix_metadata(geometry, writes, block_rows, dcp_rank)
        g = geometry
        R = g.tokens_per_state if g.storage is Storage.RECORDS else 1
        starts = np.array([w.start for w in writes], dtype=np.int64)
        q_lens = np.array([len(w.contents) for w in writes], dtype=np.int64)
        seq_lens = (starts + q_lens) // R
        rows = [np.asarray(r, dtype=np.int64) for r in block_rows]
        bounds = [self._step_query_bounds(g, writes, starts, q_lens, dcp_rank)]
        dummies, q = self.cudagraph_dummies(g, q_lens)
        if dummies:  # dummy requests: no blocks, a context of W * I so no shard is empty
            dummy_len = g.dcp_size * g.interleave_size
            q_lens = np.concatenate([q_lens, np.full(dummies, q, np.int64)])
            seq_lens = np.concatenate([seq_lens, np.full(dummies, dummy_len, np.int64)])
            dummy_local = int(self.local_seq_lens(g, np.array([dummy_len]), dcp_rank)[0])
            rows += [np.zeros(0, np.int64)] * dummies
            bounds.append(np.full(dummies * q, dummy_local, np.int64))
        local = np.asarray(self.local_seq_lens(g, seq_lens, dcp_rank), dtype=np.int64)
        kernel = g.kernel_block_size or g.states_per_page
        pages = -(-local // kernel)
        indices = self._kv_indices(g, rows, pages.tolist())
        zero = np.zeros(1, np.int64)
        return AttentionMetadata(
            group=g.group_id,
            request_ids=tuple(w.request_id for w in writes) + (PAD_REQUEST,) * dummies,
            seq_lens=seq_lens,
            query_start_loc=np.concatenate([zero, q_lens.cumsum()]),
            dcp_local_seq_lens=local,
            query_local_bounds=np.concatenate(bounds),
            kv_indptr=np.concatenate([zero, pages.cumsum()]),
            kv_indices=indices,
            kv_last_page_len=np.where(pages > 0, local - (pages - 1) * kernel, 0),
            block_table_width=g.block_table_width * (g.states_per_page // kernel),
            num_dummy_requests=dummies,
            model=g.model,
            padded_slot_mapping=np.full(dummies * q, PAD, dtype=np.int64),
        )

    def _helix_metadata(self, g: GroupGeometry, writes, block_rows, dcp_rank: int) -> AttentionMetadata:
        """The step's metadata under Helix: per request the keys the rank holds below its length,
        each query token's below its position, and the local blocks those keys span (the row's
        first entries; the last one filled up to the rank's newest key)."""
        B = g.block_size
        kernel = g.kernel_block_size or B
        local, bounds, pages, last, indices = [], [], [], [], []
        for w, row in zip(writes, block_rows):
            P = self.helix_prompt_len(w.request_id)
            positions, keys = helix_local_keys(w.stop, prompt_len=P, block_size=B, dcp_size=g.dcp_size, dcp_rank=dcp_rank)
            n = int(keys[-1]) // kernel + 1 if len(keys) else 0
            local.append(len(keys))
            bounds.append(np.searchsorted(positions, np.arange(w.start, w.stop, dtype=np.int64), side="right"))
            pages.append(n)
            last.append(int(keys[-1]) + 1 - (n - 1) * kernel if n else 0)
            kernel_row = self.kernel_block_table(g, np.asarray(row, dtype=np.int64))[:n]
            indices.append(np.concatenate([kernel_row, np.full(n - len(kernel_row), -1, np.int64)]))
        zero = np.zeros(1, np.int64)
        q_lens = np.array([len(w.contents) for w in writes], dtype=np.int64)
        return AttentionMetadata(
            group=g.group_id,
            request_ids=tuple(w.request_id for w in writes),
            seq_lens=np.array([w.stop for w in writes], dtype=np.int64),
            query_start_loc=np.concatenate([zero, q_lens.cumsum()]),
            dcp_local_seq_lens=np.array(local, dtype=np.int64),
            query_local_bounds=np.concatenate(bounds).astype(np.int64) if bounds else np.zeros(0, np.int64),
            kv_indptr=np.concatenate([zero, np.cumsum(pages, dtype=np.int64)]),
            kv_indices=np.concatenate(indices).astype(np.int64) if indices else np.zeros(0, np.int64),
            kv_last_page_len=np.array(last, dtype=np.int64),
            block_table_width=g.block_table_width * (B // kernel),
            num_dummy_requests=0,
            model=g.model,
            padded_slot_mapping=np.zeros(0, dtype=np.int64),
        )

    def _step_query_bounds(self, g: GroupGeometry, writes, starts: np.ndarray, q_lens: np.ndarray, dcp_rank: int) -> np.ndarray:
        """``query_local_bounds`` of every write of a step, concatenated: one vectorized
        pass over the step's query tokens when this engine keeps the reference's
        ``query_local_bounds`` and ``local_seq_lens`` (elementwise in the global length),
        else a call of the (overridden) method per write."""
        if _overridden(self, "query_local_bounds") or _overridden(self, "local_seq_lens"):
            bounds = [np.asarray(self.query_local_bounds(g, w.start, w.stop, dcp_rank), dtype=np.int64) for w in writes]
            return np.concatenate(bounds) if bounds else np.zeros(0, np.int64)
        # token j of a write starting at s sees global length s + j + 1: (s + j + 1) // R entries
        ends = q_lens.cumsum()
        lens = (starts - ends + q_lens + 1).repeat(q_lens) + np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
        if g.storage is Storage.RECORDS:
            lens //= g.tokens_per_state
        if not g.sharded:
            return lens
        return local_seq_lens(lens, dcp_size=g.dcp_size, interleave_size=g.interleave_size, dcp_rank=dcp_rank)

    def _kv_indices(self, g: GroupGeometry, rows: list[np.ndarray], pages: list[int]) -> np.ndarray:
        """The paged plan's kernel block ids: each row's first ``pages[i]`` kernel blocks
        (zeros for a row without blocks), concatenated. With the reference's
        ``kernel_block_table`` and ``Bk = B`` a kernel row is the row itself: sliced, not expanded."""
        plain = not _overridden(self, "kernel_block_table") and (g.kernel_block_size or g.states_per_page) == g.states_per_page
        parts = [
            np.zeros(n, np.int64) if not len(row) else row[:n] if plain else self.kernel_block_table(g, row)[:n]
            for row, n in zip(rows, pages)
        ]
        return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)

    def context_gather(self, geometry, writes, block_rows, dcp_rank):
        g = geometry
        if g.storage is not Storage.PAGED or g.retention is not Retention.FULL or not g.chunked_prefill_workspace_size:
            return None
        prefills = [i for i, w in enumerate(writes) if w.stop - w.start > 1 + g.num_speculative_tokens]
        contexts = [writes[i].start for i in prefills]
        W = g.dcp_size if g.sharded else 1
        chunks, reqs, starts, lengths = plan_chunk_arrays(
            contexts, workspace=g.chunked_prefill_workspace_size, block_size=g.block_size, dcp_size=W, interleave_size=g.interleave_size
        )
        if any(_overridden(self, name) for name in ("gather_local", "_read_slots", "kernel_block_table")):
            return self._context_gather_each(g, writes, block_rows, dcp_rank, prefills, contexts, (chunks, reqs, starts, lengths))
        kept = self._context_slots().step(g.group_id, dcp_rank)
        try:
            if not len(chunks):
                return None
            ctx = np.asarray(contexts, dtype=np.int64)[reqs]
            local_starts, local_lens = local_gathers(ctx, starts, lengths, dcp_size=W, interleave_size=g.interleave_size, dcp_rank=dcp_rank)
            slots = self._gathered_slots(g, writes, block_rows, prefills, reqs, local_starts, local_lens, kept)
        finally:
            kept.close()
        return _gather_record(g, writes, prefills, (chunks, reqs, starts, lengths), local_starts, local_lens, slots)

    def _context_slots(self) -> ContextSlots:
        """This engine's kept gather slots (``model.context_gather.ContextSlots``), made on first use."""
        kept = self.__dict__.get("_kept_context_slots")
        return kept if kept is not None else self.__dict__.setdefault("_kept_context_slots", ContextSlots())

    def _gathered_slots(self, g, writes, block_rows, prefills, reqs, local_starts, local_lens, kept) -> np.ndarray:
        """The slots of every entry's local rows, entry after entry: each request's from its
        kept slots (only the keys its context added are mapped), a view when they are one run."""
        page, bk = g.states_per_page, g.kernel_block_size or g.states_per_page
        ends = local_starts + local_lens
        bounds = np.flatnonzero(np.diff(reqs)) + 1
        read = functools.partial(self._read_slots, g)
        pieces = []
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(reqs)]):
            i = prefills[int(reqs[lo])]
            row = np.asarray(block_rows[i], dtype=np.int64)
            s, e = local_starts[lo:hi].tolist(), ends[lo:hi].tolist()
            buffer = kept.slots(writes[i].request_id, row, max(e), page, (page, bk), read)
            if buffer is None:  # keys past the row (PAD): mapped as they are, not kept
                pieces.extend(self._read_slots(g, row, np.arange(a, b, dtype=np.int64)) for a, b in zip(s, e))
            elif s[1:] == e[:-1]:  # the request's entries are one run of its local keys
                pieces.append(buffer[s[0] : e[-1]])
            else:
                pieces.extend(buffer[a:b] for a, b in zip(s, e))
        slots = pieces[0] if len(pieces) == 1 else np.concatenate(pieces).astype(np.int64, copy=False)
        slots.flags.writeable = False  # a view of the kept slots: nobody writes through it
        return slots

    def _context_gather_each(self, g, writes, block_rows, dcp_rank, prefills, contexts, plan) -> ContextGather | None:
        """``context_gather`` entry by entry, through this engine's ``gather_local`` and slot
        reads (a fault's, an adapter's)."""
        chunks, reqs, starts, lengths = plan
        if not len(chunks):
            return None
        fields: dict[str, list] = {k: [] for k in ("local_starts", "local_seq_lens", "slots")}
        for k, start, length in zip(reqs.tolist(), starts.tolist(), lengths.tolist()):
            local_start, local_len = self.gather_local(g, contexts[k], start, length, dcp_rank)
            row = np.asarray(block_rows[prefills[k]], dtype=np.int64)
            fields["local_starts"].append(local_start)
            fields["local_seq_lens"].append(local_len)
            fields["slots"].append(self._read_slots(g, row, np.arange(local_start, local_start + local_len, dtype=np.int64)))
        local = (np.asarray(fields[k], dtype=np.int64) for k in ("local_starts", "local_seq_lens"))
        return _gather_record(g, writes, prefills, plan, *local, np.concatenate(fields["slots"]).astype(np.int64))

    def gather_local(self, g: GroupGeometry, context: int, start: int, length: int, dcp_rank: int) -> tuple[int, int]:
        """``(local start, local length)`` this rank gathers of context tokens ``[start,
        start + length)`` of a request with ``context`` cached tokens."""
        W = g.dcp_size if g.sharded else 1
        return local_gather(context, start, length, dcp_size=W, interleave_size=g.interleave_size, dcp_rank=dcp_rank)

    def draft_geometry(self, geometry):
        # a draft shares the target's layout (sharded, at the target's W) or reads a replicated
        # cache, which any W reads whole: either way the group's own geometry
        # made once per geometry (the worker asks twice a step per group of draft layers)
        made = self.__dict__.setdefault("_draft_geometries", {})
        pair = made.get(id(geometry))
        if pair is None or pair[0] is not geometry:
            pair = made[id(geometry)] = (geometry, dataclasses.replace(geometry, model="draft"))
        return pair[1]

    @staticmethod
    def cudagraph_dummies(g: GroupGeometry, q_lens: np.ndarray) -> tuple[int, int]:
        """(dummy requests, tokens each) padding a uniform decode step (every request runs
        the same ``q = 1 + k`` tokens) up to the smallest captured size that is a multiple
        of ``q``; none for a mixed step or one above every captured size (runs eagerly)."""
        q = 1 + g.num_speculative_tokens
        if not g.cudagraph_capture_sizes or len(q_lens) == 0 or (q_lens != q).any():
            return 0, q
        tokens = len(q_lens) * q
        size = next((c for c in g.cudagraph_capture_sizes if c >= tokens and c % q == 0), None)
        return (0 if size is None else (size - tokens) // q), q

    # --- sparse attention -----------------------------------------------------------

    def indexer_local_rows(self, geometry: GroupGeometry, seq_len: int, dcp_rank: int) -> np.ndarray:
        positions = np.arange(seq_len, dtype=np.int64)
        if not geometry.sharded:
            return positions
        W, I = geometry.dcp_size, geometry.interleave_size
        return positions[(positions // I) % W == dcp_rank]  # ascending: local order

    def select_topk(self, scores: np.ndarray, topk: int, local_counts: np.ndarray, dcp_rank: int) -> np.ndarray:
        return topk_by_score_then_position(scores, topk)

    def sparse_local_keys(self, geometry: GroupGeometry, selected: np.ndarray, dcp_rank: int) -> np.ndarray:
        selected = np.asarray(selected, dtype=np.int64)
        if not geometry.sharded:
            return selected
        return vllm_topk_local_index(selected, geometry.dcp_size, geometry.interleave_size, dcp_rank)

    # --- the attention math ---------------------------------------------------------

    def shard_lse(self, lse: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        return lse

    def shard_output(self, out: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        return out

    def merge_lse(self, lses, base):
        return merge_lse(lses, base)

    def merge_attention_states(self, outputs, lses, base):
        return merge_attention_states(outputs, lses, base)

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        q, heads, d = out.shape
        world, rank = group.world_size, group.rank
        hs = heads // world
        if variant == "alltoall":
            # all-to-all over heads, then merge this rank's slice of every rank's partials
            packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [q, H, D + 1]
            send = packed.reshape(q, world, hs, d + 1).transpose(0, 1).contiguous()
            recv = group.all_to_all_tensor(send)  # [W, q, hs, D + 1]; recv[s] came from rank s
            o, merged = self.merge_attention_states(recv[..., :d], recv[..., d], base)
            return o, merged, rank
        # all-gather the LSEs, rescale this rank's output, reduce-scatter over heads, then
        # all-gather the merged slices
        lses = torch.stack(group.all_gather_tensor(lse))  # [W, q, H]
        merged, factors = self.merge_lse(lses, base)
        mine = scale_output(out, factors[rank])
        send = mine.reshape(q, world, hs, d).transpose(0, 1).contiguous()
        part = group.reduce_scatter_tensor(send)  # [q, hs, D]: this rank's heads, merged
        slices = torch.stack(group.all_gather_tensor(part))  # [W, q, hs, D]
        # return a slice this rank did not merge itself, so that the final gather is judged too
        c = (rank + 1) % world
        return slices[c], merged[:, c * hs : (c + 1) * hs], c


@dataclasses.dataclass(frozen=True)
class HelixGeometry(GroupGeometry):
    """A group under Helix's layout (``kv_cache_layout = "helix"``, ``dcpsim.model.helix``):
    a position's rank and local slot follow its request's prompt length."""

    def with_spare_entry(self) -> HelixGeometry:
        """Rows one entry wider: the busiest rank may hold one block more than an even share."""
        return dataclasses.replace(self, block_table_width=self.block_table_width + 1)


def check_kv_cache_layout(engine, scenario) -> None:
    """Helix's layout is the reference engine's (and its faults') only: another engine (vLLM's,
    SGLang's, a plugin) lays its caches out as it does, so a Helix scenario is refused (exit 2)."""
    ours = type(engine) is ReferenceEngine or type(engine).__module__.startswith("dcpsim.engine.faults.")
    if scenario.config.kv_cache_layout == "helix" and not ours:  # adapters subclass the reference too
        raise ConfigError(
            f'kv_cache_layout = "helix": engine {getattr(engine, "name", type(engine).__name__)} lays out vLLM\'s layout only; '
            "Helix's (TensorRT-LLM's) runs under the reference engine and its faults"
        )


def _overridden(engine: ReferenceEngine, name: str) -> bool:
    """Whether ``engine``'s class (a fault, an adapter) overrides the reference's ``name``:
    a vectorized path of the reference stands for that method only when it does not."""
    return getattr(type(engine), name) is not getattr(ReferenceEngine, name)


def topk_by_score_then_position(scores: np.ndarray, topk: int, *, tie_key: np.ndarray | None = None) -> np.ndarray:
    """``[nq, min(topk, n)]`` positions of the ``topk`` best finite scores of each row, by
    score descending, then ``tie_key`` ascending (default: the position; a total order),
    sorted ascending, ``-1`` padding."""
    scores = np.asarray(scores, dtype=np.float32)
    nq, n = scores.shape
    k = min(topk, n)
    finite = np.isfinite(scores)
    primary = np.where(finite, -scores, np.inf)  # best first; the rest last
    if tie_key is None:  # a stable sort keeps equal scores in position order
        order = np.argsort(primary, axis=-1, kind="stable")[:, :k]
    else:
        order = np.lexsort((np.broadcast_to(tie_key, scores.shape), primary), axis=-1)[:, :k]
    big = np.iinfo(np.int64).max
    chosen = np.where(np.take_along_axis(finite, order, axis=1), order, big)
    chosen.sort(axis=1)  # ascending positions, the padding last
    return np.where(chosen == big, -1, chosen)


def _gather_record(g, writes, prefills, plan, local_starts, local_lens, slots) -> ContextGather:
    """The ``ContextGather`` of a step's plan ``(chunks, reqs, starts, lengths)`` in group ``g``."""
    chunks, reqs, starts, lengths = plan
    return ContextGather(
        group=g.group_id,
        workspace_size=g.chunked_prefill_workspace_size,
        request_ids=tuple(writes[prefills[k]].request_id for k in reqs.tolist()),
        chunks=chunks,
        starts=starts,
        seq_lens=lengths,
        local_starts=local_starts,
        local_seq_lens=local_lens,
        slots=slots,
    )
