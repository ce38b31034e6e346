"""An example plugin engine, written from the ``Engine`` docstrings alone.

``python -m dcpsim run dsv3 --engine dcpsim.engine.example_plugin:ExampleEngine`` runs it.
It implements every decision with plain loops (it subclasses ``Engine``, not
``ReferenceEngine``) and uses only the pure model (specs, grouping, kinds) and
``GroupGeometry``. ``OffByOneExampleEngine`` is the same engine with one classic bug (the
owner rank of a position counted from 1), which the checker must catch.

A plugin of your own: a module on ``sys.path`` with an ``Engine`` subclass (or instance);
``--engine MODULE:ATTR`` names it. The ranks import it too, so keep it importable there.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.interface import Engine
from dcpsim.errors import ConfigError
from dcpsim.model.grouping import check_groups_for_dcp, group_layer_specs
from dcpsim.model.kinds import Retention, Storage, records_per_state, retention_of, storage_of
from dcpsim.model.plan import AttentionMetadata

PAD = -1


class ExampleEngine(Engine):
    name = "example-plugin"
    description = "a plugin written from the Engine docstrings (plain loops)"

    def kv_cache_groups(self, layer_specs):
        return group_layer_specs(layer_specs)

    def group_geometry(self, group_id, group, config):
        check_groups_for_dcp([group], config)
        spec = group.representative
        W, I = config.decode_context_parallel_size, config.cp_kv_cache_interleave_size
        sharded = group.sharded and W > 1
        tps = records_per_state(spec)
        storage = storage_of(spec)
        if storage is Storage.STATE:  # a Mamba state: replicated, one state a page, never scaled by W
            return self._state_geometry(group_id, group, config)
        if sharded and (spec.block_size // tps) % I:
            raise ConfigError(f"group {group.name}: a page of {spec.block_size // tps} states is not a multiple of I={I}")
        per_entry = spec.block_size * (W if sharded else 1)
        width = 1 if storage is Storage.RING else -(-config.max_model_len // per_entry)
        if storage is not Storage.RING:  # rows span a multiple of 128 tokens
            unit = 128 // math.gcd(128, spec.block_size)
            width = -(-width // unit) * unit
        return GroupGeometry(
            group_id=group_id,
            name=group.name,
            layer_names=group.layer_names,
            spec=spec,
            group_spec=group.kv_cache_spec,
            storage=storage,
            retention=retention_of(spec),
            block_size=spec.block_size,
            tokens_per_state=tps,
            sharded=sharded,
            dcp_size=W,
            interleave_size=I,
            kernel_block_size=None if storage is Storage.RING else config.kernel_block_size,
            num_speculative_tokens=config.num_speculative_tokens,
            manager_block_size=per_entry,
            block_table_width=width,
            cudagraph_capture_sizes=config.cudagraph_capture_sizes,
            draft=any(n in config.draft_layers for n in group.layer_names),
        )

    # --- scheduler ------------------------------------------------------------------

    def blocks_needed(self, geometry, num_tokens):
        if geometry.storage is Storage.RING:
            return 1
        entries = -(-num_tokens // geometry.manager_block_size)
        if geometry.storage is Storage.STATE:  # plus one speculative state block per draft
            entries += geometry.spec.num_speculative_blocks
        return entries

    def first_needed_position(self, geometry, num_committed):
        spec, n = geometry.spec, num_committed
        if geometry.retention is Retention.WINDOW:
            return max(0, n - spec.sliding_window + 1 - spec.extra_retained_tokens)
        if geometry.retention is Retention.CHUNK:
            return n - n % spec.attention_chunk_size
        if geometry.retention is Retention.RING:
            return max(0, n - (geometry.block_size - geometry.num_speculative_tokens))
        if geometry.retention is Retention.STATE:  # only the state after the last committed token
            return max(0, n - 1)
        return 0

    def num_released_blocks(self, geometry, first_needed):
        return first_needed // geometry.manager_block_size

    def prefix_block_tokens(self, geometry):
        return geometry.manager_block_size

    def prefix_hash_unit(self, geometries):
        return math.lcm(*(g.manager_block_size for g in geometries))

    def prefix_hash_block_size(self, geometries):
        return math.gcd(*(g.manager_block_size for g in geometries))

    def prefix_key_position(self, geometries, block):
        return (block + 1) * self.prefix_hash_block_size(geometries) - 1

    # --- worker ---------------------------------------------------------------------

    def owner(self, geometry: GroupGeometry, index: int) -> int:
        return (index // geometry.interleave_size) % geometry.dcp_size

    def _state_geometry(self, group_id, group, config):
        """A Mamba group (MambaSpec): ``1 + k`` state blocks a request in ``none`` mode (a
        block covers ``max_model_len``), one entry per ``block_size`` tokens plus ``k`` in
        ``align`` mode; no 128-token widening; no kernel blocks, no interleave."""
        spec = group.representative
        k = spec.num_speculative_blocks
        return GroupGeometry(
            group_id=group_id,
            name=group.name,
            layer_names=group.layer_names,
            spec=spec,
            group_spec=group.kv_cache_spec,
            storage=Storage.STATE,
            retention=retention_of(spec),
            block_size=spec.block_size,
            tokens_per_state=1,
            sharded=False,
            dcp_size=config.decode_context_parallel_size,
            interleave_size=config.cp_kv_cache_interleave_size,
            kernel_block_size=None,
            num_speculative_tokens=config.num_speculative_tokens,
            manager_block_size=spec.block_size,
            block_table_width=-(-config.max_model_len // spec.block_size) + k,
            cudagraph_capture_sizes=config.cudagraph_capture_sizes,
            draft=any(n in config.draft_layers for n in group.layer_names),
        )

    def _slot(self, g: GroupGeometry, row, index: int, rank: int) -> int:
        page = g.states_per_page
        if not g.sharded:
            return int(row[index // page]) * page + index % page
        if self.owner(g, index) != rank:
            return PAD
        W, I = g.dcp_size, g.interleave_size
        entry, offset = divmod(index, page * W)
        local = (offset // (W * I)) * I + offset % I
        return int(row[entry]) * page + local

    def write_slots(self, geometry, write, block_row, dcp_rank):
        g = geometry
        if g.storage is Storage.STATE:
            # the state window starts at column 0 (none) or at the block of the step's last
            # token (align); a prefill chunk leaves one state (after its last token) there, a
            # decode step the state after each of its tokens, token j's in the window's block j
            base = (write.stop - 1) // g.block_size if g.spec.mamba_cache_mode == "align" else 0
            if write.stop - write.start - write.num_drafts > 1:
                positions, columns = [write.stop - 1], [base]
            else:
                positions = list(range(write.start, write.stop))
                columns = [base + j for j in range(len(positions))]
            slots = [int(block_row[c]) if c < len(block_row) else 0 for c in columns]  # one state a page
            return np.array(slots, np.int64), np.array(positions, np.int64)
        if g.storage is Storage.RING:
            states = list(range(max(write.start, write.stop - g.block_size), write.stop))
            return (np.array([int(block_row[0]) * g.block_size + s % g.block_size for s in states], np.int64), np.array(states, np.int64))
        R = g.tokens_per_state
        index = list(range(write.start // R, write.stop // R)) if R > 1 else list(range(write.start, write.stop))
        slots = [self._slot(g, block_row, i, dcp_rank) for i in index]
        return np.array(slots, np.int64), np.array(index, np.int64)

    def kernel_block_table(self, geometry, block_row):
        page = geometry.states_per_page
        k = page // (geometry.kernel_block_size or page)
        return np.array([b * k + j for b in block_row for j in range(k)], np.int64)

    def local_seq_lens(self, geometry, seq_lens, dcp_rank):
        if not geometry.sharded:
            return np.asarray(seq_lens, np.int64)
        return np.array([sum(1 for p in range(n) if self.owner(geometry, p) == dcp_rank) for n in seq_lens], np.int64)

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        R = geometry.tokens_per_state
        return self.local_seq_lens(geometry, [(p + 1) // R for p in range(start, stop)], dcp_rank)

    def attention_metadata(self, geometry, start, stop, block_row, dcp_rank, rows):
        g, rows = geometry, np.asarray(rows, np.int64)
        positions = start + rows
        if g.sharded:
            bounds = self.query_local_bounds(g, start, stop, dcp_rank)[rows]
            local = np.arange(int(bounds.max(initial=0)))
            mask = local[None, :] < bounds[:, None]
        elif g.storage is Storage.RECORDS:
            counts = (positions + 1) // g.tokens_per_state
            local = np.arange(int(counts.max(initial=0)))
            mask = local[None, :] < counts[:, None]
        else:
            lo = np.array(
                [
                    p - p % g.spec.attention_chunk_size
                    if g.retention is Retention.CHUNK
                    else max(0, p - g.spec.sliding_window + 1)
                    if g.retention is Retention.WINDOW
                    else 0
                    for p in positions
                ],
                np.int64,
            )
            local = np.arange(int(lo.min(initial=start)), int(positions.max(initial=start - 1)) + 1)
            mask = (local[None, :] <= positions[:, None]) & (local[None, :] >= lo[:, None])
        bk = g.kernel_block_size or g.states_per_page
        kernel = self.kernel_block_table(g, block_row)
        slots = np.array([kernel[i // bk] * bk + i % bk if i // bk < len(kernel) else PAD for i in local], np.int64)
        return slots, mask, g.sharded

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        g = geometry
        R = g.tokens_per_state if g.storage is Storage.RECORDS else 1
        q = 1 + g.num_speculative_tokens
        reqs = [
            (
                w.request_id,
                w.stop // R,
                w.stop - w.start,
                list(self.query_local_bounds(g, w.start, w.stop, dcp_rank)),
                np.asarray(row, np.int64),
            )
            for w, row in zip(writes, block_rows)
        ]
        dummies = 0
        if writes and g.cudagraph_capture_sizes and all(w.stop - w.start == q for w in writes):
            fits = [c for c in g.cudagraph_capture_sizes if c >= len(writes) * q and c % q == 0]
            dummies = (fits[0] - len(writes) * q) // q if fits else 0
        for _ in range(dummies):
            n = g.dcp_size * g.interleave_size
            reqs.append(("<cudagraph-pad>", n, q, [int(self.local_seq_lens(g, [n], dcp_rank)[0])] * q, np.zeros(0, np.int64)))
        bk = g.kernel_block_size or g.states_per_page
        local, indptr, indices, last = [], [0], [], []
        for _, n, _, _, row in reqs:
            keys = int(self.local_seq_lens(g, [n], dcp_rank)[0])
            pages = -(-keys // bk)
            kernel = self.kernel_block_table(g, row) if len(row) else np.zeros(pages, np.int64)
            local.append(keys)
            indptr.append(indptr[-1] + pages)
            indices.extend(int(k) for k in kernel[:pages])
            last.append(keys - (pages - 1) * bk if pages else 0)
        starts = [0]
        for r in reqs:
            starts.append(starts[-1] + r[2])
        return AttentionMetadata(
            group=g.group_id,
            request_ids=tuple(r[0] for r in reqs),
            seq_lens=np.array([r[1] for r in reqs], np.int64),
            query_start_loc=np.array(starts, np.int64),
            dcp_local_seq_lens=np.array(local, np.int64),
            query_local_bounds=np.array([b for r in reqs for b in r[3]], np.int64),
            kv_indptr=np.array(indptr, np.int64),
            kv_indices=np.array(indices, np.int64),
            kv_last_page_len=np.array(last, np.int64),
            block_table_width=g.block_table_width * (g.states_per_page // bk),
            num_dummy_requests=dummies,
            model=g.model,
            padded_slot_mapping=np.full(dummies * q, PAD, np.int64),
        )

    def draft_geometry(self, geometry):
        return dataclasses.replace(geometry, model="draft")

    # --- sparse attention -------------------------------------------------------------

    def indexer_local_rows(self, geometry, seq_len, dcp_rank):
        mine = [p for p in range(seq_len) if not geometry.sharded or self.owner(geometry, p) == dcp_rank]
        return np.array(mine, dtype=np.int64)

    def select_topk(self, scores, topk, local_counts, dcp_rank):
        scores = np.asarray(scores)
        k = min(topk, scores.shape[1])
        out = np.full((scores.shape[0], k), PAD, dtype=np.int64)
        for j, row in enumerate(scores):
            candidates = [p for p in range(len(row)) if np.isfinite(row[p])]
            best = sorted(sorted(candidates, key=lambda p: (-float(row[p]), p))[:k])
            out[j, : len(best)] = best
        return out

    def sparse_local_keys(self, geometry, selected, dcp_rank):
        selected = np.asarray(selected, dtype=np.int64)
        if not geometry.sharded:
            return selected.copy()
        W, I = geometry.dcp_size, geometry.interleave_size
        out = np.full(selected.shape, PAD, dtype=np.int64)
        for j, k in np.ndindex(*selected.shape):
            t = int(selected[j, k])
            if t >= 0 and self.owner(geometry, t) == dcp_rank:
                out[j, k] = (t // (W * I)) * I + t % I  # owned runs before t, then the offset in its run
        return out

    # --- attention math -------------------------------------------------------------

    def shard_output(self, out, empty):
        return out

    def shard_lse(self, lse, empty):
        return lse

    def merge_lse(self, lses, base):
        exp, log = (torch.exp, torch.log) if base == "e" else (torch.exp2, torch.log2)
        clean = torch.where(torch.isnan(lses) | (lses == float("inf")), torch.full_like(lses, -float("inf")), lses)
        top = clean.amax(dim=0)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        merged = top + log(exp(clean - top).sum(dim=0))
        factors = torch.where(clean == -float("inf"), torch.zeros_like(clean), exp(clean - merged))
        return merged, factors

    def merge_attention_states(self, outputs, lses, base):
        merged, factors = self.merge_lse(lses, base)
        f = factors.unsqueeze(-1)
        return torch.where(f == 0, torch.zeros_like(outputs), f * outputs).sum(dim=0), merged

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        # every rank gathers every partial state and merges its own slice of heads
        q, heads, d = out.shape
        hs = heads // group.world_size
        outs = torch.stack(group.all_gather_tensor(out))
        lses = torch.stack(group.all_gather_tensor(lse))
        mine = slice(group.rank * hs, (group.rank + 1) * hs)
        o, merged = self.merge_attention_states(outs[:, :, mine], lses[:, :, mine], base)
        return o, merged, group.rank


class OffByOneExampleEngine(ExampleEngine):
    """The example with a bug: position ``p`` of a sharded group owned by ``(p // I + 1) % W``."""

    def owner(self, geometry, index):
        return (index // geometry.interleave_size + 1) % geometry.dcp_size
