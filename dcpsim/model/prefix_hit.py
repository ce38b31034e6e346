"""Prefix-cache hit arithmetic across KV-cache groups (upstream vLLM 0.33.0's rule, pure).

Prefixes are hashed per hash block of ``G`` tokens, the GCD of the groups' block spans
(a group's span is the tokens one of its block-table entries covers: ``B * W`` for a
sharded group, ``B`` for a replicated one, where a compressed cache's ``B`` counts tokens,
``R`` per record). Hash blocks chain, so a group's block, ``span / G`` hash blocks long, is
found by the hash of its last hash block. Each group finds its own run of cached blocks; a
hit is the longest prefix every group holds, rounded down to the LCM of the spans (so it
ends on a block boundary of every group) and short of the request's last known token.

With an EAGLE / MTP drafter the groups the drafter's layers live in (the EAGLE groups) first give
up the last block of their run, so that the drafter recomputes it; the other groups keep theirs
(vLLM's ``KVCacheCoordinator``: ``eagle_group_ids``, the groups whose ``is_eagle_group`` is set
because they hold a draft layer, or every group when none does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def eagle_groups(draft: Sequence[bool], eagle: bool) -> tuple[bool, ...]:
    """Which groups take the EAGLE last-block drop: none without an EAGLE-style drafter
    (``eagle``), else the groups holding a draft layer (``draft[g]``), or every group when
    no group holds one (the drafter's layers are not in the model: vLLM's fallback)."""
    if not eagle:
        return (False,) * len(draft)
    if any(draft):
        return tuple(bool(d) for d in draft)
    return (True,) * len(draft)


def per_group(eagle: bool | Sequence[bool], groups: int) -> tuple[bool, ...]:
    """``eagle`` as one flag per group: a single flag stands for every group."""
    if isinstance(eagle, bool):
        return (eagle,) * groups
    flags = tuple(bool(e) for e in eagle)
    if len(flags) != groups:
        raise ValueError(f"{len(flags)} EAGLE flags for {groups} groups")
    return flags


def hash_block_tokens(spans: Sequence[int]) -> int:
    """``G``: the hash block, the GCD of the groups' spans."""
    return math.gcd(*spans)


def hit_alignment(spans: Sequence[int]) -> int:
    """The unit a hit comes in: the LCM of the groups' spans."""
    return math.lcm(*spans)


def block_key_hash_block(span: int, hash_block: int, block: int) -> int:
    """The hash block (0-based) whose chained hash finds block ``block`` of a group of
    ``span`` tokens a block: the last hash block inside it."""
    return (block + 1) * span // hash_block - 1


def longest_prefix_hit(cached_blocks: Sequence[int], block_tokens: Sequence[int], align: int, limit: int) -> int:
    """Tokens of the longest prefix hit: the largest multiple of ``align`` that is at most
    ``limit`` and at most every group's cached run, ``cached_blocks[g] * block_tokens[g]``
    tokens (``block_tokens[g]``: the tokens an engine credits one cached block of group
    ``g`` with; its span when correct)."""
    if align < 1 or not cached_blocks:
        return 0
    common = min([max(0, limit)] + [n * t for n, t in zip(cached_blocks, block_tokens)])
    return common // align * align


def blocks_in_hit(hit: int, span: int) -> int:
    """Leading blocks of a group a hit of ``hit`` tokens reuses (whole blocks only)."""
    return hit // span
