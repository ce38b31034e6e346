"""Prefix-cache faults: hash units, advertised KV events, compressed hit lengths and the EAGLE
drop (bug classes 1, 21, 23, 32, 40, 41 and 47), and the copy-on-write of a partial-block hit (54)."""

from __future__ import annotations

import math

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.geometry import GroupGeometry
from dcpsim.model.kinds import Storage
from dcpsim.model.prefix_hit import per_group


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


class PrefixHitGcdAligned(Fault):
    name = "prefix-hit-gcd-aligned"
    bug_class = (
        "32. a prefix hit aligned to the GCD of the groups' block spans (the hash block) instead of their "
        "LCM: a group whose span the hit does not divide reuses fewer blocks than the hit covers"
    )
    description = (
        "hits come in hash blocks (the GCD of the spans) instead of whole units of every group (their LCM): "
        "where the spans do not divide each other (64 and 48 tokens a block) a hit ends inside a block of "
        "one group, which reuses only the whole blocks below it, and the positions between are never computed"
    )
    configs = ({"decode_context_parallel_size": 2},)

    def applies_to(self, geometries) -> bool:
        """Where the spans do not divide each other: otherwise every group's cached run ends on
        a multiple of the largest span, the LCM, and the GCD rounding changes nothing."""
        spans = [self.prefix_block_tokens(g) for g in geometries]
        return all(g.prefix_cacheable for g in geometries) and math.lcm(*spans) > max(spans)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return scenario.config.enable_prefix_caching and self.applies_to(geometries)

    def prefix_hash_unit(self, geometries) -> int:
        return self.prefix_hash_block_size(geometries)


class EagleMarginUnscaled(Fault):
    name = "eagle-margin-unscaled"
    bug_class = (
        "40. the EAGLE margin of a hybrid prefix lookup not scaled by DCP: each later group looks up at most "
        "one page (B tokens) past the hit so far instead of one block of its own span (B*W), then drops its "
        "last block (vllm-ascend 0.23.0.post1 AscendHybridKVCacheCoordinator.find_longest_cache_hit, "
        "patch/platform/patch_kv_cache_coordinator.py:306, 409)"
    )
    description = (
        "with an EAGLE / MTP drafter and two or more KV-cache groups, the groups are looked up one after another; "
        "each drops its last cached block, and a later group may look one margin past the hit so far so that its "
        "drop lands on the same boundary. The margin is the group's page (B tokens) where its blocks span B*W: "
        "under DCP the later group finds no block past the hit, drops one inside it, and the hit loses a whole "
        "block (W = 4, B = 16, 640 tokens cached, a 700-token prompt: 512 tokens where 576 are right)"
    )
    scenarios = ("eagle-hybrid-hit",)

    def applies_to(self, geometries) -> bool:
        return len(geometries) > 1 and all(g.prefix_cacheable for g in geometries) and any(g.sharded and g.dcp_size > 1 for g in geometries)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return scenario.config.enable_prefix_caching and scenario.config.eagle_drop and self.applies_to(geometries)

    def prefix_hit_tokens(self, geometries, cached_blocks, limit, eagle) -> int:
        drops = per_group(eagle, len(geometries))
        if not any(drops) or len(geometries) < 2:
            return super().prefix_hit_tokens(geometries, cached_blocks, limit, eagle)
        hit = limit
        for g, blocks, drop in zip(geometries, cached_blocks, drops):
            span = self.prefix_block_tokens(g)
            if not drop:  # a group the drafter does not use: no margin, no drop
                hit = min(blocks, hit // span) * span
                continue
            reach = min(hit + g.block_size, limit)  # the margin: one page, not one block of the group's span
            hit = max(0, min(blocks, reach // span) - 1) * span
        unit = self.prefix_hash_unit(geometries)
        return hit // unit * unit


class EagleDropUnscaled(Fault):
    name = "eagle-drop-unscaled"
    bug_class = (
        "41. the EAGLE last-block drop of a prefix hit not scaled by DCP: the hit gives up B tokens (one page) "
        "instead of one manager block of B*W (vllm#50438, vllm#50897, vllm-ascend#13750)"
    )
    description = (
        "with an EAGLE / MTP drafter, the hit found in whole blocks gives up the spec's page (B tokens, B*R for a "
        "compressed cache) instead of one block of B*W: under DCP the hit ends inside the last reused block, which "
        "the group cannot reuse (whole blocks only), so the positions between its start and the hit are never "
        "computed (W = 4, B = 16, 640 tokens cached: a hit of 624 over 9 blocks of 64, where 576 are right)"
    )
    scenarios = ("eagle-hybrid-hit",)
    configs = ({}, {"decode_context_parallel_size": 2})

    def applies_to(self, geometries) -> bool:
        """Where a block spans more than its page: a sharded group over more than one rank."""
        return all(g.prefix_cacheable for g in geometries) and any(g.sharded and g.dcp_size > 1 for g in geometries)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return scenario.config.enable_prefix_caching and scenario.config.eagle_drop and self.applies_to(geometries)

    def prefix_hit_tokens(self, geometries, cached_blocks, limit, eagle) -> int:
        drops = per_group(eagle, len(geometries))
        if not any(drops):
            return super().prefix_hit_tokens(geometries, cached_blocks, limit, eagle)
        whole = super().prefix_hit_tokens(geometries, cached_blocks, limit, False)
        return max(0, whole - max(g.block_size for g, drop in zip(geometries, drops) if drop))  # one page, not B*W


class EagleDropEveryGroup(Fault):
    name = "eagle-drop-every-group"
    bug_class = (
        "47. the EAGLE last-block drop of a prefix hit applied to every KV-cache group, not only to the groups "
        "the drafter's layers use (local-inference-lab/vllm#466: a valid 13,824-token hit became 12,288)"
    )
    description = (
        "with an EAGLE / MTP drafter whose layers live in some KV-cache groups (the EAGLE groups), every group "
        "gives up the last block of its cached run, the target's too: where a target group's run binds the hit "
        "(its blocks span more than the draft group's, which caches a block past it) the hit loses a whole unit "
        "(eagle-draft-hit, W = 4: 576 tokens where 640 are right)"
    )
    scenarios = ("eagle-draft-hit",)
    """The drafter's replicated layer (span B) in a group of its own beside the sharded target (B*W), a
    prompt whose limit cuts the target's last unit where the draft group still caches a block."""

    def applies_to(self, geometries) -> bool:
        """Where a group holding a draft layer sits beside one that holds none."""
        drafts = {g.draft for g in geometries}
        return all(g.prefix_cacheable for g in geometries) and drafts == {True, False}

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return scenario.config.enable_prefix_caching and scenario.config.eagle_drop and self.applies_to(geometries)

    def prefix_hit_tokens(self, geometries, cached_blocks, limit, eagle) -> int:
        drops = per_group(eagle, len(geometries))
        return super().prefix_hit_tokens(geometries, cached_blocks, limit, [any(drops)] * len(drops))


class PartialHitStaleCow(Fault):
    name = "partial-hit-stale-cow"
    bug_class = (
        "54. a partial prefix-cache hit copied on write from stale hit metadata: the hit found at an earlier "
        "admission attempt is copied, not the one refreshed at the admission, so a source block handed out "
        "and rewritten since is copied into the request's private block (vllm#51705)"
    )
    description = (
        "with prefix_match_unit, a request whose admission found a partial-block hit but could not get its "
        "blocks keeps that hit's record (source block, tokens); its later admission copies the recorded "
        "source block into its private block instead of looking the partial hit up again, after the source "
        "was handed out to another request and rewritten"
    )
    scenarios = ("prefix-partial-hit",)
    configs = ({"decode_context_parallel_size": 2}, {"decode_context_parallel_size": 4})

    def applies_to_scenario(self, scenario, geometries) -> bool:
        return scenario.config.enable_prefix_caching and scenario.config.prefix_match_unit > 0

    def partial_hit_to_copy(self, recorded, found):
        return found if recorded is None else recorded
