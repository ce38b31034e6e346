"""Known DCP bugs, each a small variant of the reference engine that changes one decision.

A fault subclasses ``Fault`` (itself the reference engine plus catalogue metadata) and
overrides one ``Engine`` method: grouping (``kv_cache_groups``), geometry
(``group_geometry``), a prefix key, a release, the slots of a write, a query bound or a
shard's LSE. It never touches the checker, which derives its expectation from the
scenario alone. ``--inject NAME`` runs one; the registry maps names to faults so a new
bug class is one new entry, and ``python -m dcpsim selftest`` runs every registered fault
where it applies (see ``needs``, ``configs`` and ``scenarios``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.errors import ConfigError
from dcpsim.model.grouping import KVCacheGroupSpec
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import PAD, local_seq_lens, owner_rank, ring_slot_mapping
from dcpsim.model.specs import FullAttentionSpec, cdiv


class Fault(ReferenceEngine):
    """The correct engine with catalogue metadata. A fault subclass overrides one
    ``Engine`` decision to reproduce one bug.

    Where ``selftest`` runs a fault (declarative): on every built-in scenario in
    ``scenarios`` (None: all of them), once per run config in ``configs`` with ``needs``
    merged in, wherever ``applies_to_scenario`` holds for the scenario so configured.
    Run options are ``Scenario.with_overrides`` arguments
    (``decode_context_parallel_size``, ``cp_kv_cache_interleave_size``, ``block_size``,
    ``kernel_block_size``, ...), ``SimConfig`` fields, or ``Job`` fields (e.g. ``attention``).
    """

    name = "none"
    bug_class = ""
    """The bug class of docs/dcp-semantics.md section 8 that the fault stands for."""
    description = "no fault: the correct engine"
    needs: dict = {}
    """Run options without which the bug cannot show at all, e.g.
    ``{"kernel_block_size": 16}`` or ``{"attention": True}``."""
    configs: tuple[dict, ...] = ({},)
    """Run configs (overrides of a scenario's own config) selftest runs the fault in."""
    scenarios: tuple[str, ...] | None = None
    """Built-in scenarios selftest runs the fault on; None: every one where it applies."""
    expects: str = "check"
    """How the fault shows: ``check`` (a failed check, exit 1) or ``hang`` (the ranks'
    collectives diverge and the harness reports a collective hang naming the rank, exit 3)."""

    def applies_to(self, geometries: list[GroupGeometry]) -> bool:
        """Whether the bug can show on a scenario with these (reference) group geometries."""
        return True

    def applies_to_scenario(self, scenario, geometries: list[GroupGeometry]) -> bool:
        """Whether the bug can show on this scenario (its config and workload too)."""
        return self.applies_to(geometries)


def _is_replicated_paged(g: GroupGeometry) -> bool:
    """A replicated group with more than one rank that is not a ring (width 1 anyway)."""
    return g.replicated and g.dcp_size > 1 and g.storage is not Storage.RING


def _has_sharded_attention(geometries) -> bool:
    return any(g.sharded and g.storage is not Storage.RING for g in geometries)


class PrefixHashUnitB(Fault):
    name = "prefix-hash-unit-B"
    bug_class = "1. prefix-cache hashes computed per B tokens while the manager looks them up per B*W"
    description = (
        "prefix-cache unit u (B*W tokens of a sharded group) is keyed by the prefix fingerprint at "
        "(u+1)*B-1 instead of (u+1)*B*W-1, so a hit runs past the true common prefix into another "
        "request's blocks"
    )
    configs = ({"block_size": 16},)
    """Small pages: the 520-token prefix of dsv3 then ends inside a unit that the bug still hits."""
    scenarios = ("dsv3", "dsv3-mtp", "prefix-eviction", "prefix-sharing")
    """Not prefix-preemption: its sharers look their prefix up before the first request has
    computed the unit the prefix ends in, so the early key is never there to be hit."""

    def applies_to(self, geometries) -> bool:
        """Where the hash block (the GCD of the block spans) is not ``B`` itself: beside a
        replicated group of the same ``B`` (llama-draft) hashing per ``B`` is right."""
        return all(g.prefix_cacheable for g in geometries) and (
            math.gcd(*(g.block_size for g in geometries)) != math.gcd(*(g.manager_block_size for g in geometries))
        )

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where two requests share a prefix that ends inside a hash unit: a prefix of whole
        units never lets the early key run past it."""
        unit = math.lcm(*(g.manager_block_size for g in geometries))
        prefixes = [r.prefix for r in scenario.requests if r.prefix and r.shared_prefix_len]
        shared = {p for p in prefixes if prefixes.count(p) > 1}  # two requests share it
        ragged = any(r.prefix in shared and r.shared_prefix_len % unit for r in scenario.requests)
        return scenario.config.enable_prefix_caching and ragged and self.applies_to(geometries)

    def prefix_key_position(self, geometries, block: int) -> int:
        return (block + 1) * math.gcd(*(g.block_size for g in geometries)) - 1


class KernelVirtualBlock(Fault):
    name = "kernel-virtual-block"
    bug_class = "2. virtual block formed from the kernel block size (Bk*W) instead of B*W when Bk < B"
    description = (
        "sharded groups compute owner and local offset inside virtual blocks of Bk*W states (kernel "
        "coordinates) instead of B*W; with I > Bk slots collide and some ranks store nothing"
    )
    needs = {"kernel_block_size": 16}
    configs = ({"block_size": 64, "cp_kv_cache_interleave_size": 64},)
    """With I dividing Bk both coordinate systems give the same slots, so I = B = 64 > Bk = 16."""

    @staticmethod
    def _hit(g: GroupGeometry) -> bool:
        kbs = g.kernel_block_size
        return g.sharded and g.storage is not Storage.RING and kbs is not None and kbs < g.states_per_page

    def applies_to(self, geometries) -> bool:
        return any(self._hit(g) for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if not self._hit(geometry):
            return slots, index
        # virtual blocks of Bk * W kernel-block states, owner and local offset inside them,
        # the kernel block table indexed by that virtual block
        kernel, W, I = geometry.kernel_block_size, geometry.dcp_size, geometry.interleave_size
        kernel_ids = self.kernel_block_table(geometry, block_row)
        vb, off = np.divmod(np.asarray(index, np.int64), kernel * W)
        owned = (off // I) % W == dcp_rank
        loc = (off // (W * I)) * I + off % I
        return np.where(owned, kernel_ids[vb] * kernel + loc, PAD), index


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
        return _has_sharded_attention(geometries)

    def query_local_bounds(self, geometry, start, stop, dcp_rank):
        q = stop - start
        if q == 0:
            return np.zeros(0, np.int64)
        last = stop if geometry.storage is not Storage.RECORDS else stop // geometry.tokens_per_state
        local_last = local_seq_lens(
            np.array([last], np.int64), dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size, dcp_rank=dcp_rank
        )[0]
        return np.maximum(0, local_last - (q - 1 - np.arange(q, dtype=np.int64)))


class EmptyShardLseZero(Fault):
    name = "empty-shard-lse-zero"
    bug_class = "4. empty shard reporting lse = 0 in the merge"
    description = (
        "a rank whose shard holds no key for a query token reports lse = 0 instead of -inf, so "
        "the merge gives it weight exp(0 - lse) and scales the other ranks' outputs down"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return _has_sharded_attention(geometries)

    def shard_lse(self, lse, empty):
        return lse.masked_fill(empty[:, None], 0.0)


class ReplicatedScaledByW(Fault):
    name = "replicated-scaled-by-w"
    bug_class = "5. a replicated state (Mamba, sliding window) scaled by W as if sharded"
    description = (
        "replicated groups get block tables of cdiv(max_model_len, B*W) entries, as if sharded: "
        "narrower than the attention-metadata builder expects, and a request longer than "
        "max_model_len / W overflows its row"
    )
    configs = ({"decode_context_parallel_size": 4},)

    def applies_to(self, geometries) -> bool:
        return any(_is_replicated_paged(g) for g in geometries)

    @staticmethod
    def _narrow_width(g: GroupGeometry, config) -> int:
        return cdiv(config.max_model_len, g.block_size * g.dcp_size)

    def group_geometry(self, group_id, group, config):
        geometry = super().group_geometry(group_id, group, config)
        if _is_replicated_paged(geometry):
            geometry = dataclasses.replace(geometry, block_table_width=self._narrow_width(geometry, config))
        return geometry


def _drops_flag(group: KVCacheGroupSpec) -> bool:
    """A merged (not uniform-type) replicated full-attention group: dropping
    ``dcp_replicated`` turns it into a valid sharded group, silently. (A sliding window
    that lost the flag is refused loudly by the DCP group check.)"""
    spec = group.kv_cache_spec
    return isinstance(spec, FullAttentionSpec) and spec.dcp_replicated


class MergeDropsDcpReplicated(Fault):
    name = "merge-drops-dcp-replicated"
    bug_class = "6. merge of specs dropping dcp_replicated (a replicated group silently becomes sharded)"
    description = (
        "the engine merges each group's layer specs without dcp_replicated, so a replicated "
        "full-attention group (a draft model's) is laid out, allocated and written as sharded"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.replicated and g.dcp_size > 1 and isinstance(g.group_spec, FullAttentionSpec) for g in geometries)

    def kv_cache_groups(self, layer_specs):
        groups = []
        for group in super().kv_cache_groups(layer_specs):
            if _drops_flag(group):
                merged = dataclasses.replace(group.kv_cache_spec, dcp_replicated=False)
                group = KVCacheGroupSpec(group.layer_names, merged)
            groups.append(group)
        return groups


class ReplicatedOwnerOnly(Fault):
    name = "replicated-owner-only"
    bug_class = "7. a replicated group masked like a sharded one (only the owner writes a position)"
    description = "in replicated groups only the position's owner rank writes it; the others keep holes"

    def applies_to(self, geometries) -> bool:
        return any(_is_replicated_paged(g) for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if _is_replicated_paged(geometry):
            owner = owner_rank(index, dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size)
            slots = np.where(owner == dcp_rank, slots, PAD)
        return slots, index


class SlidingWindowEarlyRelease(Fault):
    name = "sliding-window-early-release"
    bug_class = "8. sliding-window blocks released while still inside the window"
    description = (
        "a sliding-window manager releases one block too many: the block holding the first "
        "position still inside the window goes back to the pool and its entry becomes the null block"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.retention is Retention.WINDOW for g in geometries)

    def num_released_blocks(self, geometry, first_needed):
        n = super().num_released_blocks(geometry, first_needed)
        return n + 1 if geometry.retention is Retention.WINDOW and first_needed > 0 else n


class RingRejectedOverwrite(Fault):
    name = "ring-rejected-overwrite"
    bug_class = "9. ring rows of rejected drafts overwriting the accepted boundary"
    description = (
        "a compressor ring writes a speculative step's draft rows one row early, so the first "
        "draft lands on the row of the step's true token (the accepted boundary)"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.storage is Storage.RING and g.num_speculative_tokens > 0 for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if geometry.storage is Storage.RING and write.num_drafts:
            draft = index >= write.stop - write.num_drafts
            early = ring_slot_mapping(index - 1, int(block_row[0]), geometry.block_size)
            slots = np.where(draft, early, slots)
        return slots, index


class InterleaveOffByOne(Fault):
    name = "interleave-off-by-one"
    bug_class = (
        "10 (family). a writer whose rank ownership disagrees with the sharded cache's readers "
        "(the draft at W = 1 itself is draft-drops-dcp)"
    )
    description = (
        "sharded groups place each run of I positions on the next rank (owner ((p // I) + 1) % W "
        "instead of (p // I) % W): the symptom of a writer and readers disagreeing on ownership"
    )

    def applies_to(self, geometries) -> bool:
        return any(g.sharded for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        if geometry.sharded:
            dcp_rank = (dcp_rank - 1) % geometry.dcp_size
        return super().write_slots(geometry, write, block_row, dcp_rank)


class ForeignBlock(Fault):
    name = "foreign-block"
    bug_class = "not in section 8 (write-guard check): a write into a block the request does not hold (stale or off-by-one block index)"
    description = "positions that belong in the request's last block go to a block it does not hold"

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        page = geometry.states_per_page
        held = set(int(b) for b in block_row)
        stranger = next(b for b in range(1, len(held) + 2) if b not in held)
        last = int(block_row[-1])
        hit = (slots >= 0) & (slots // page == last)
        return np.where(hit, stranger * page + slots % page, slots), index


# --- attention metadata (checked every step against the scenario) ----------------------


def _plan_from_global_lens(engine, geometry, meta, block_rows):
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
        return _has_sharded_attention(geometries)

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
        return _plan_from_global_lens(self, geometry, meta, block_rows)


class GlobalSeqLensOverwritten(_ShardedMetadataFault):
    name = "global-seq-lens-overwritten"
    bug_class = "12. global sequence lengths read after being overwritten with local ones (vllm#28990)"
    description = (
        "a sharded group's builder overwrites seq_lens in place with the DCP-local lengths and a "
        "later consumer reads them as the global lengths"
    )

    def corrupt(self, geometry, meta, block_rows):
        return dataclasses.replace(meta, seq_lens=meta.dcp_local_seq_lens.copy())


class LocalLensPlusOne(Fault):
    name = "local-lens-plus-one"
    bug_class = "13. DCP local lengths one too long on every rank when L % W == 0 (vllm#27518)"
    description = (
        "the local sequence length of a sharded group is computed one too long on every rank "
        "when the global length is a multiple of W (an off-by-one in the ceiling), so every "
        "rank attends to one key it does not hold"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return _has_sharded_attention(geometries)

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

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        n = len(meta.padded_slot_mapping)
        if not n:
            return meta
        q = 1 + geometry.num_speculative_tokens
        return dataclasses.replace(meta, padded_slot_mapping=np.tile(np.arange(q, dtype=np.int64), n // q))


class KvEventsHashUnitB(Fault):
    name = "kv-events-hash-unit-b"
    bug_class = (
        "21. KV events hashed at another unit than the lookups (vllm#49971, sglang#35298, "
        "ai-dynamo/dynamo#12765: a router's hit rate silently exactly 0)"
    )
    description = (
        "the engine advertises its prefix-cache blocks (BlockStored events) per B tokens of the "
        "spec while its lookups, and a router's hashes, use the manager block of B*W tokens"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        """Where the two units differ (a replicated group of the same B keeps the GCD at B)."""
        return all(g.prefix_cacheable for g in geometries) and (
            math.gcd(*(g.block_size for g in geometries)) != math.gcd(*(g.manager_block_size for g in geometries))
        )

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return scenario.config.enable_prefix_caching and self.applies_to(geometries)

    def prefix_hash_block_size(self, geometries) -> int:
        return math.gcd(*(g.block_size for g in geometries))


def _compressed(g: GroupGeometry) -> bool:
    return g.storage is Storage.RECORDS and g.tokens_per_state > 1


class CompressedHitDropsR(Fault):
    name = "compressed-hit-drops-r"
    bug_class = "23. a compressed cache's prefix-hit length counted without its compression ratio (vllm-ascend#13330)"
    description = (
        "a compressed group's cached block is credited with B*W tokens, its records per page times W, "
        "instead of the B*R*W tokens it covers, and hits are aligned to that: a hit stops inside a "
        "compressed block, which the group drops (whole blocks only), so records below the hit are "
        "never computed"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return all(g.prefix_cacheable for g in geometries) and any(_compressed(g) for g in geometries)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return scenario.config.enable_prefix_caching and self.applies_to(geometries)

    def prefix_block_tokens(self, geometry) -> int:
        if _compressed(geometry):
            return geometry.states_per_page * (geometry.dcp_size if geometry.sharded else 1)
        return super().prefix_block_tokens(geometry)


# --- draft models (MTP / EAGLE) -------------------------------------------------------


def _sharded_draft(g: GroupGeometry) -> bool:
    return g.draft and g.sharded and g.storage in (Storage.PAGED, Storage.RECORDS)


class DraftDropsDcp(Fault):
    name = "draft-drops-dcp"
    bug_class = (
        "10. draft model running with W = 1 against a sharded cache (local-inference-lab/vllm#72: "
        "acceptance collapse, three of four ranks attend to nothing)"
    )
    description = (
        "the draft model's parallel config silently drops decode_context_parallel_size, so its "
        "drafter builds attention metadata for W = 1 (every key local, a plain block table) over "
        "a cache the target shards across W ranks"
    )
    configs = ({"decode_context_parallel_size": 4},)

    def applies_to(self, geometries) -> bool:
        return any(_sharded_draft(g) for g in geometries)

    def draft_geometry(self, geometry):
        draft = super().draft_geometry(geometry)
        if not _sharded_draft(geometry):
            return draft
        return dataclasses.replace(
            draft,
            dcp_size=1,
            sharded=False,
            manager_block_size=geometry.block_size,
            block_table_width=geometry.block_table_width * geometry.dcp_size,
        )


class DraftIndptrFromGlobalLens(Fault):
    name = "draft-indptr-global"
    bug_class = "22. a draft's kv_indptr built from the global lengths (ROCm/ATOM#1746)"
    description = (
        "the drafter of a sharded draft builds its paged plan (kv_indptr, kv_indices, "
        "kv_last_page_len) from the global sequence lengths while the target's uses the local ones"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return any(_sharded_draft(g) for g in geometries)

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        if geometry.model != "draft" or not _sharded_draft(geometry):
            return meta
        return _plan_from_global_lens(self, geometry, meta, block_rows)


# --- the attention merge and admission ------------------------------------------------


class LseBaseMismatch(Fault):
    name = "lse-base-mismatch"
    bug_class = "16. LSEs of one base merged as the other (vllm#28840, vllm#43919, sglang#33064)"
    description = (
        "the backend returns base-2 LSEs (flash kernels: exp2/log2) but the DCP merge treats them "
        "as natural logs (and the other way round), so every rank's weight is wrong"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "lse_base": "2"}, {"decode_context_parallel_size": 2, "lse_base": "e"})

    def applies_to(self, geometries) -> bool:
        return _has_sharded_attention(geometries)

    def merge_across_ranks(self, out, lse, group, *, variant, base):
        return super().merge_across_ranks(out, lse, group, variant=variant, base="e" if base == "2" else "2")


class EmptyShardNanUnguarded(Fault):
    name = "empty-shard-nan-unguarded"
    bug_class = "17. an empty shard's NaN output times its zero merge weight (ROCm/ATOM#1832)"
    description = (
        "a kernel leaves 0/0 = NaN in the output rows of query tokens whose shard holds no key, "
        "and the merge multiplies weight by output without the guard: 0 * NaN poisons the result"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2, "attention_merge": "alltoall"},)
    """The all-to-all merge goes through ``merge_attention_states``, the unguarded one here."""

    def applies_to(self, geometries) -> bool:
        return _has_sharded_attention(geometries)

    def shard_output(self, out, empty):
        return out.masked_fill(empty[:, None, None], float("nan"))

    def merge_attention_states(self, outputs, lses, base):
        lse, factors = self.merge_lse(lses, base)
        return (factors.unsqueeze(-1) * outputs).sum(dim=0), lse


class AdmissionCapacityUnscaled(Fault):
    name = "admission-capacity-unscaled"
    bug_class = "18. a sharded group's capacity not scaled by W at admission (sglang#33448)"
    description = (
        "the scheduler counts a sharded group's blocks per B tokens instead of per B*W, so each "
        "request takes W times the blocks it fills: the pool holds 1/W of its real context and "
        "requests are rejected or stall"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        return _has_sharded_attention(geometries)

    def blocks_needed(self, geometry, num_tokens):
        if geometry.sharded and geometry.storage is not Storage.RING:
            return cdiv(num_tokens, geometry.block_size)
        return super().blocks_needed(geometry, num_tokens)


# --- Mamba state ---------------------------------------------------------------------


def _is_align_state(g: GroupGeometry) -> bool:
    """A Mamba group in ``align`` mode under DCP: its block table is indexed by position."""
    return g.storage is Storage.STATE and g.dcp_size > 1 and g.spec.mamba_cache_mode == "align"


class MambaBlockSizeScaledByW(Fault):
    name = "mamba-block-size-scaled-by-w"
    bug_class = (
        "19. the DCP factor applied to every group's block span, Mamba states included (vllm#49962: KV offload stored 2 of 4 Mamba blocks)"
    )
    description = (
        "every group's manager block size is B*W, right for sharded attention but wrong for a replicated "
        "Mamba state: an align-mode state group believes one block-table entry spans B*W tokens, so it "
        "allocates and releases its state blocks at entries the kernel, which indexes the state by "
        "(seq_len - 1) // B, never uses"
    )
    configs = ({"mamba_cache_mode": "align", "block_size": 16},)
    """Position-indexed state blocks (align mode) of 16 tokens; in 'none' mode one block spans
    max_model_len tokens, so the bug cannot show there."""

    def applies_to(self, geometries) -> bool:
        return any(_is_align_state(g) for g in geometries)

    def group_geometry(self, group_id, group, config):
        geometry = super().group_geometry(group_id, group, config)
        if geometry.storage is Storage.STATE:
            geometry = dataclasses.replace(geometry, manager_block_size=geometry.block_size * geometry.dcp_size)
        return geometry


class DcpTransformOnReplicated(Fault):
    name = "dcp-transform-on-replicated"
    bug_class = (
        "20. the DCP slot transform (owner mask and local offset) applied to every group, replicated ones "
        "included (vllm#57260: silent corruption of Mamba state, sliding windows, chunked local)"
    )
    description = (
        "the write path maps every group through the sharded owner/local-offset transform: a replicated "
        "paged group keeps only the owner rank's writes, at local offsets inside virtual blocks of B*W "
        "positions; a Mamba state (one state per page, so the offset drops out) is written only by the "
        "rank owning its position, and the other replicas go stale"
    )

    @staticmethod
    def _hit(g: GroupGeometry) -> bool:
        return g.replicated and g.dcp_size > 1 and g.storage in (Storage.PAGED, Storage.STATE)

    def applies_to(self, geometries) -> bool:
        return any(self._hit(g) for g in geometries)

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        g = geometry
        if not self._hit(g):
            return slots, index
        W, I = g.dcp_size, g.interleave_size
        owned = owner_rank(index, dcp_size=W, interleave_size=I) == dcp_rank
        if g.storage is Storage.STATE:
            return np.where(owned, slots, PAD), index
        B = g.block_size
        vb, off = np.divmod(np.asarray(index, np.int64), B * W)
        loc = (off // (W * I)) * I + off % I
        row = np.asarray(block_row, np.int64)
        return np.where(owned, row[vb] * B + loc, PAD), index


# --- prefill context parallelism (PCP x TP x DCP, dcpsim.model.parallel) ----------------


def _pcp_dcp(scenario) -> tuple[int, int]:
    c = scenario.config
    return c.prefill_context_parallel_size, c.decode_context_parallel_size


class PcpGatherRankLocal(Fault):
    name = "pcp-gather-rank-local"
    bug_class = (
        "24. a PCP KV-gather plan built from rank-local metadata: one rank skips the collective "
        "on a 2-token prefill and the group hangs (vllm#53573)"
    )
    description = (
        "before vllm#56157: a prefill too short for 2 * pcp chunks is still split, and each PCP rank "
        "enters the KV all-gather only if one of its own chunks has earlier context; on a fresh 2-token "
        "prefill rank 0 holds token 0 alone, skips the gather, and the others wait for it until the "
        "process-group timeout (exit 3, naming rank 0)"
    )
    expects = "hang"
    scenarios = ("glm-pcp2-dcp2",)
    """Its own config (TP1 PCP2 DCP2, as vllm#53573): no other built-in has PCP."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """A fresh prompt so short that PCP rank 0's mirror chunk is empty."""
        pcp, _ = _pcp_dcp(scenario)
        size = lambda q: cdiv(q, 2 * pcp)  # noqa: E731
        return pcp > 1 and any(not r.shared_prefix_len and (2 * pcp - 1) * size(r.prompt_len) >= r.prompt_len for r in scenario.requests)

    def pcp_replicated(self, query_len, prefill, pcp, dcp):
        return pcp == 1 or not prefill

    def pcp_enters_gather(self, split_rows, pcp, pcp_rank):
        return any(start + offset > 0 for start, q in split_rows for offset, _ in self.pcp_chunks(q, pcp, pcp_rank))


class PcpChunksNotMirrored(Fault):
    name = "pcp-chunks-not-mirrored"
    bug_class = (
        "25. PCP chunk assignment not mirrored: rank r computes chunks r and r + pcp while the gather restores chunks r and 2 * pcp - 1 - r"
    )
    description = (
        "PCP rank r computes the KV of chunks r and r + pcp of a split prefill, but the all-gathered rows are "
        "put back where the mirrored plan (r, 2 * pcp - 1 - r) says: chunk 2's KV lands on chunk 3's positions"
    )
    scenarios = ("glm-pcp2-dcp2",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Where PCP is on (the scenario's own config: selftest adds no PCP config, whose
        baselines would rerun every built-in) and a prefill is long enough to split."""
        pcp, _ = _pcp_dcp(scenario)
        return pcp > 1 and any(r.prompt_len - r.shared_prefix_len > 4 * pcp for r in scenario.requests)

    def pcp_chunks(self, query_len, pcp, pcp_rank):
        size = cdiv(query_len, 2 * pcp)
        pieces = [(c * size, min(size, query_len - c * size)) for c in (pcp_rank, pcp_rank + pcp)]
        return [(o, n) for o, n in pieces if n > 0]


class DcpRankNotTransposed(Fault):
    name = "dcp-rank-not-transposed"
    bug_class = (
        "26. DCP ranks cut from the (PCP, TP) grid without the transpose: dcp_rank = rank % dcp "
        "instead of tp_rank * pcp + pcp_rank (vllm/distributed/parallel_state.py)"
    )
    description = (
        "each rank takes its DCP rank from the untransposed grid, rank % dcp: with TP > 1 two ranks of one "
        "DCP group write as the same DCP rank and the positions of another are stored by nobody"
    )
    scenarios = ("glm-pcp2-dcp2",)
    configs = ({"tensor_parallel_size": 2, "decode_context_parallel_size": 4},)
    """TP2 x PCP2 with DCP over the grid; an invalid size without PCP (tp % dcp), so only PCP
    scenarios run it and its baselines."""

    def applies_to_scenario(self, scenario, geometries) -> bool:
        c = scenario.config
        return (
            c.prefill_context_parallel_size > 1
            and c.tp_size > 1
            and c.decode_context_parallel_size > 1
            and _has_sharded_attention(geometries)
        )

    def dcp_rank_of(self, layout, rank):
        return rank % layout.dcp


class PcpSpecRegularMask(Fault):
    name = "pcp-spec-regular-mask"
    bug_class = (
        "27. PCP/DCP with speculative decoding: a speculative step's per-token bounds taken from one "
        "regular causal mask instead of the irregular one (vllm-ascend#6491)"
    )
    description = (
        "the PCP/DCP metadata gives the 1 + k query tokens of a speculative step the bounds of one regular "
        "(bottom-right) causal mask over the rank's shard, local(L) - (q - 1 - j), instead of each token's "
        "own local(H + j + 1) (the fix flattens the step into 1 + k single-token rows); sharded groups only"
    )
    configs = ({"tensor_parallel_size": 1, "num_speculative_tokens": 2},)
    """TP1 as the PCP built-in has it (invalid for a non-PCP scenario at W > 1), plus drafts."""
    scenarios = ("glm-pcp2-dcp2",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        c = scenario.config
        return (
            c.prefill_context_parallel_size > 1
            and c.num_speculative_tokens > 0
            and c.decode_context_parallel_size > 1
            and _has_sharded_attention(geometries)
        )

    def build_attention_metadata(self, geometry, writes, block_rows, dcp_rank):
        meta = super().build_attention_metadata(geometry, writes, block_rows, dcp_rank)
        if not geometry.sharded or geometry.storage is not Storage.PAGED:
            return meta
        bounds, starts = meta.query_local_bounds.copy(), meta.query_start_loc
        for i, w in enumerate(writes):
            if not w.num_drafts:
                continue
            q = w.stop - w.start
            last = local_seq_lens(
                np.array([w.stop], np.int64), dcp_size=geometry.dcp_size, interleave_size=geometry.interleave_size, dcp_rank=dcp_rank
            )[0]
            bounds[starts[i] : starts[i + 1]] = np.maximum(0, last - (q - 1 - np.arange(q, dtype=np.int64)))
        return dataclasses.replace(meta, query_local_bounds=bounds)


# The registry, in the order of the bug classes (semantics section 8, then the write guard).
FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(),
        PrefixHashUnitB(),
        KernelVirtualBlock(),
        MultiTokenLocalLens(),
        EmptyShardLseZero(),
        ReplicatedScaledByW(),
        MergeDropsDcpReplicated(),
        ReplicatedOwnerOnly(),
        SlidingWindowEarlyRelease(),
        RingRejectedOverwrite(),
        InterleaveOffByOne(),
        DraftDropsDcp(),
        PlanPagesFromGlobalLen(),
        GlobalSeqLensOverwritten(),
        LocalLensPlusOne(),
        BlockTableWidthUnsharded(),
        CudagraphPaddingWrites(),
        LseBaseMismatch(),
        EmptyShardNanUnguarded(),
        AdmissionCapacityUnscaled(),
        KvEventsHashUnitB(),
        DraftIndptrFromGlobalLens(),
        CompressedHitDropsR(),
        MambaBlockSizeScaledByW(),
        DcpTransformOnReplicated(),
        PcpGatherRankLocal(),
        PcpChunksNotMirrored(),
        DcpRankNotTransposed(),
        PcpSpecRegularMask(),
        ForeignBlock(),
    )
}


def get_fault(name: str | None) -> Fault:
    if name is None:
        return FAULTS["none"]
    try:
        return FAULTS[name]
    except KeyError:
        raise ConfigError(f"--inject: unknown fault {name!r}; known: {', '.join(n for n in FAULTS if n != 'none')}") from None
