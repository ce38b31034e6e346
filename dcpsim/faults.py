"""Known DCP bugs that can be switched on inside the simulated engine (never in the checker).

Each fault overrides one engine hook of ``Fault`` (whose defaults are the
correct engine): the engine's group layouts, prefix-cache keys, which blocks a
manager releases, block-table widths, or the write path's slots. ``--inject
NAME`` turns one on; the checker, which always works from the true layouts,
must then fail the run. The registry maps names to faults so a new bug class
is one new entry, and ``python -m dcpsim selftest`` runs every registered fault
where it applies (see ``needs``, ``configs`` and ``scenarios``).
"""

from __future__ import annotations

import math

import numpy as np

from dcpsim.errors import ConfigError
from dcpsim.group_layout import RING, WINDOW
from dcpsim.layout import PAD, owner_rank, ring_slot_mapping
from dcpsim.specs import FullAttentionSpec, cdiv


class Fault:
    """The correct engine. A fault subclass overrides one hook to reproduce one bug.

    Hooks are called by the simulated engine only (scheduler, managers, prefix
    cache, block tables, write path); the checker always works from the true,
    unfaulted layouts.

    Where ``selftest`` runs a fault (declarative): on every built-in scenario
    in ``scenarios`` (None: all of them), once per run config in ``configs``
    with ``needs`` merged in, wherever ``applies_to_scenario`` holds for the
    scenario so configured. Run options are ``Scenario.with_overrides``
    arguments (``decode_context_parallel_size``, ``cp_kv_cache_interleave_size``,
    ``block_size``, ``kernel_block_size``, ...), ``SimConfig`` fields, or
    ``simulation.Job`` fields (e.g. ``attention``).
    """

    name = "none"
    bug_class = ""
    """The bug class of dcp-semantics.md section 8 that the fault stands for."""
    description = "no fault: the correct engine"
    needs: dict = {}
    """Run options without which the bug cannot show at all, e.g.
    ``{"kernel_block_size": 16}`` or ``{"attention": True}``."""
    configs: tuple[dict, ...] = ({},)
    """Run configs (overrides of a scenario's own config) selftest runs the fault in."""
    scenarios: tuple[str, ...] | None = None
    """Built-in scenarios selftest runs the fault on; None: every one where it applies."""

    def applies_to(self, layouts) -> bool:
        """Whether the bug can show on a scenario with these (true) group layouts."""
        return True

    def applies_to_scenario(self, scenario, layouts) -> bool:
        """Whether the bug can show on this scenario (its config and workload too)."""
        return self.applies_to(layouts)

    # --- engine hooks (the defaults are the correct engine) ------------------------

    def engine_layouts(self, scenario, layouts):
        """The group layouts the engine works with (a fault may derive wrong ones)."""
        return layouts

    def prefix_key_position(self, cache, unit: int) -> int:
        """The position whose prefix fingerprint keys hash unit ``unit`` (its last one)."""
        return (unit + 1) * cache.unit - 1

    def num_released_blocks(self, layout, first_needed: int) -> int:
        """Leading block-table entries no longer needed when positions below
        ``first_needed`` are out of the window/chunk: whole blocks only."""
        return first_needed // layout.manager_block_size

    def block_table_width(self, layout, config) -> int:
        """Entries of a block-table row (``max_num_blocks_per_req``)."""
        return layout.group_spec.max_num_blocks_per_req(config, config.max_model_len)

    def slots_for(self, runner, layout, write, row):
        """The write path's (slots, stored index, content) for one request and group."""
        return runner.slots_for(layout, write, row)

    # attention hooks (``--attention``; the engine's attention only, never the reference)

    def query_local_bounds(self, bounds, lens, *, dcp_size: int, dcp_rank: int, interleave_size: int):
        """Keys each query token of a multi-token step sees on this rank of a sharded group.

        ``bounds`` are the correct ones, ``local(lens[j], r)``; ``lens[j]`` is the number of
        positions (or records) query token ``j`` sees globally."""
        return bounds

    def shard_lse(self, lse, empty):
        """The LSE ``[q, heads]`` a rank reports to the merge; ``empty[j]``: its shard holds
        no key for query token ``j`` (the correct LSE there is -inf)."""
        return lse


class InterleaveOffByOne(Fault):
    name = "interleave-off-by-one"
    bug_class = (
        "10. draft model running with W = 1 against a sharded cache (family: a writer whose "
        "rank ownership disagrees with the sharded cache's readers)"
    )
    description = (
        "sharded groups place each run of I positions on the next rank (owner ((p // I) + 1) % W "
        "instead of (p // I) % W): the symptom of a writer and readers disagreeing on ownership"
    )

    def applies_to(self, layouts) -> bool:
        return any(lay.sharded for lay in layouts)

    def slots_for(self, runner, layout, write, row):
        if not layout.sharded:
            return runner.slots_for(layout, write, row)
        return runner.slots_for(layout, write, row, rank=(runner.rank - 1) % layout.dcp_size)


class ReplicatedOwnerOnly(Fault):
    name = "replicated-owner-only"
    bug_class = "7. a replicated group masked like a sharded one (only the owner writes a position)"
    description = "in replicated groups only the position's owner rank writes it; the others keep holes"

    def applies_to(self, layouts) -> bool:
        return any(lay.replicated and lay.dcp_size > 1 and lay.storage != "ring" for lay in layouts)

    def slots_for(self, runner, layout, write, row):
        slots, index, content = runner.slots_for(layout, write, row)
        if layout.replicated and layout.dcp_size > 1 and layout.storage != "ring":
            owner = owner_rank(index, dcp_size=layout.dcp_size, interleave_size=layout.interleave_size)
            slots = np.where(owner == runner.rank, slots, PAD)
        return slots, index, content


class ForeignBlock(Fault):
    name = "foreign-block"
    bug_class = (
        "not in section 8 (write-guard check): a write into a block the request does not hold "
        "(stale or off-by-one block index)"
    )
    description = "positions that belong in the request's last block go to a block it does not hold"

    def slots_for(self, runner, layout, write, row):
        slots, index, content = runner.slots_for(layout, write, row)
        page = layout.states_per_page
        held = set(int(b) for b in row)
        stranger = next(b for b in range(1, len(held) + 2) if b not in held)
        last = int(row[-1])
        hit = (slots >= 0) & (slots // page == last)
        slots = np.where(hit, stranger * page + slots % page, slots)
        return slots, index, content


def _is_replicated_paged(layout) -> bool:
    """A replicated group with more than one rank that is not a ring (width 1 anyway)."""
    return layout.replicated and layout.dcp_size > 1 and layout.storage != RING


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

    def applies_to(self, layouts) -> bool:
        return any(lay.sharded and lay.dcp_size > 1 for lay in layouts) and all(
            lay.prefix_cacheable for lay in layouts
        )

    def applies_to_scenario(self, scenario, layouts) -> bool:
        prefixes = [r.prefix for r in scenario.requests if r.prefix and r.shared_prefix_len]
        shared = len(prefixes) > len(set(prefixes))  # two requests share a prefix
        return scenario.config.enable_prefix_caching and shared and self.applies_to(layouts)

    def prefix_key_position(self, cache, unit: int) -> int:
        hash_block = math.gcd(*(m.layout.block_size for m in cache.managers))
        return (unit + 1) * hash_block - 1


def _kernel_coordinate_slots(index, row, *, page, kernel, dcp_size, rank, interleave):
    """The bug's slots: virtual blocks of ``Bk * W`` kernel-block states, owner and local
    offset taken inside them, the kernel block table indexed by that virtual block."""
    k = page // kernel
    kernel_ids = (np.asarray(row, np.int64)[:, None] * k + np.arange(k)[None, :]).reshape(-1)
    vb, off = np.divmod(np.asarray(index, np.int64), kernel * dcp_size)
    owned = (off // interleave) % dcp_size == rank
    loc = (off // (dcp_size * interleave)) * interleave + off % interleave
    return np.where(owned, kernel_ids[vb] * kernel + loc, PAD)


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
    def _hit(layout) -> bool:
        kbs = layout.kernel_block_size
        return layout.sharded and layout.storage != RING and kbs is not None and kbs < layout.states_per_page

    def applies_to(self, layouts) -> bool:
        return any(self._hit(lay) for lay in layouts)

    def slots_for(self, runner, layout, write, row):
        slots, index, content = runner.slots_for(layout, write, row)
        if self._hit(layout):
            slots = _kernel_coordinate_slots(
                index, row, page=layout.states_per_page, kernel=layout.kernel_block_size,
                dcp_size=layout.dcp_size, rank=runner.rank, interleave=layout.interleave_size,
            )
        return slots, index, content


class ReplicatedScaledByW(Fault):
    name = "replicated-scaled-by-w"
    bug_class = "5. a replicated state (Mamba, sliding window) scaled by W as if sharded"
    description = (
        "replicated groups get block tables of cdiv(max_model_len, B*W) entries, as if sharded, "
        "so a request longer than max_model_len / W overflows its row"
    )
    configs = ({"decode_context_parallel_size": 4},)

    def applies_to(self, layouts) -> bool:
        return any(_is_replicated_paged(lay) for lay in layouts)

    def applies_to_scenario(self, scenario, layouts) -> bool:
        """Only where some request outgrows the narrow table (else the bug cannot show)."""
        cfg = scenario.config
        longest = max(r.prompt_len + r.output_len for r in scenario.requests) + cfg.num_speculative_tokens
        return any(
            _is_replicated_paged(lay)
            and lay.blocks_needed(longest) > self.block_table_width(lay, cfg)
            for lay in layouts
        )

    def block_table_width(self, layout, config) -> int:
        if _is_replicated_paged(layout):
            return cdiv(config.max_model_len, layout.block_size * layout.dcp_size)
        return super().block_table_width(layout, config)


def _drops_flag(group) -> bool:
    """A merged (not uniform-type) replicated full-attention group: dropping
    ``dcp_replicated`` turns it into a valid sharded group, silently. (A
    sliding window that lost the flag is refused loudly by the DCP group check.)"""
    spec = group.kv_cache_spec
    return isinstance(spec, FullAttentionSpec) and spec.dcp_replicated


class MergeDropsDcpReplicated(Fault):
    name = "merge-drops-dcp-replicated"
    bug_class = "6. merge of specs dropping dcp_replicated (a replicated group silently becomes sharded)"
    description = (
        "the engine merges each group's layer specs without dcp_replicated, so a replicated "
        "full-attention group (a draft model's) is laid out, allocated and written as sharded"
    )

    def applies_to(self, layouts) -> bool:
        return any(
            lay.replicated and lay.dcp_size > 1 and isinstance(lay.group_spec, FullAttentionSpec)
            for lay in layouts
        )

    def engine_layouts(self, scenario, layouts):
        import dataclasses

        from dcpsim.group_layout import build_group_layouts
        from dcpsim.grouping import KVCacheGroupSpec, group_layer_specs

        groups = []
        for group in group_layer_specs(scenario.layers):
            if _drops_flag(group):
                merged = dataclasses.replace(group.kv_cache_spec, dcp_replicated=False)
                group = KVCacheGroupSpec(group.layer_names, merged)
            groups.append(group)
        return build_group_layouts(groups, scenario.config)


class SlidingWindowEarlyRelease(Fault):
    name = "sliding-window-early-release"
    bug_class = "8. sliding-window blocks released while still inside the window"
    description = (
        "a sliding-window manager releases one block too many: the block holding the first "
        "position still inside the window goes back to the pool and its entry becomes the null block"
    )

    def applies_to(self, layouts) -> bool:
        return any(lay.retention == WINDOW for lay in layouts)

    def num_released_blocks(self, layout, first_needed: int) -> int:
        n = super().num_released_blocks(layout, first_needed)
        return n + 1 if layout.retention == WINDOW and first_needed > 0 else n


class RingRejectedOverwrite(Fault):
    name = "ring-rejected-overwrite"
    bug_class = "9. ring rows of rejected drafts overwriting the accepted boundary"
    description = (
        "a compressor ring writes a speculative step's draft rows one row early, so the first "
        "draft lands on the row of the step's true token (the accepted boundary)"
    )

    def applies_to(self, layouts) -> bool:
        return any(lay.storage == RING and lay.num_speculative_tokens > 0 for lay in layouts)

    def slots_for(self, runner, layout, write, row):
        slots, index, content = runner.slots_for(layout, write, row)
        if layout.storage == RING and write.num_drafts:
            draft = index >= write.stop - write.num_drafts
            early = ring_slot_mapping(index - 1, int(row[0]), layout.block_size)
            slots = np.where(draft, early, slots)
        return slots, index, content


def _has_sharded_attention(layouts) -> bool:
    return any(lay.sharded and lay.storage != RING for lay in layouts)


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

    def applies_to(self, layouts) -> bool:
        return _has_sharded_attention(layouts)

    def query_local_bounds(self, bounds, lens, *, dcp_size: int, dcp_rank: int, interleave_size: int):
        from dcpsim.layout import local_seq_lens

        q = len(lens)
        if q == 0:
            return bounds
        last = local_seq_lens(np.asarray(lens[-1:], np.int64), dcp_size=dcp_size,
                              interleave_size=interleave_size, dcp_rank=dcp_rank)[0]
        return np.maximum(0, last - (q - 1 - np.arange(q, dtype=np.int64)))


class EmptyShardLseZero(Fault):
    name = "empty-shard-lse-zero"
    bug_class = "4. empty shard reporting lse = 0 in the merge"
    description = (
        "a rank whose shard holds no key for a query token reports lse = 0 instead of -inf, so "
        "the merge gives it weight exp(0 - lse) and scales the other ranks' outputs down"
    )
    needs = {"attention": True}
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, layouts) -> bool:
        return _has_sharded_attention(layouts)

    def shard_lse(self, lse, empty):
        return lse.masked_fill(empty[:, None], 0.0)


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
        ForeignBlock(),
    )
}


def get_fault(name: str | None) -> Fault:
    if name is None:
        return FAULTS["none"]
    try:
        return FAULTS[name]
    except KeyError:
        raise ConfigError(
            f"--inject: unknown fault {name!r}; known: {', '.join(n for n in FAULTS if n != 'none')}"
        ) from None
