"""A pool of KV-cache block ids for one group, with ref counts and a cache index.

Block 0 is the reserved null block: never handed out, never written. Freed
blocks go to the tail of an LRU free queue; a cached (prefix) block stays
findable until it is handed out again. Several blocks may hold one key (two
requests computed the same prefix before either found it cached, as vLLM's
``BlockHashToBlockMap`` keeps them): a lookup finds the first still cached, so
handing one out leaves the key findable through the others.
"""

from __future__ import annotations

from collections import OrderedDict

from dcpsim.errors import ConfigError

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ConfigError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * (num_blocks + 1)
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks + 1))
        self._by_key: dict[object, dict[int, None]] = {}
        """Key -> the blocks holding it, in the order they were cached."""
        self._key_of: dict[int, object] = {}
        self._aliases_of: dict[int, list[object]] = {}
        """Block -> the alias keys of the partial prefixes it holds (``cache_alias``)."""
        self._ever_used = [False] * (num_blocks + 1)
        self.num_reused = 0
        """Allocations of a block that an earlier request had held and freed."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        popitem, ref, ever = self._free.popitem, self._ref, self._ever_used
        out = [popitem(last=False)[0] for _ in range(n)]
        if self._key_of or self._aliases_of:  # a cached block loses its keys (nothing to evict without prefix caching)
            for block in out:
                self.evict(block)
        for block in out:
            ref[block] = 1
            self.num_reused += ever[block]
            ever[block] = True
        return out

    def evict(self, block: int) -> None:
        """A free block is handed out again: its content is about to be overwritten, so it
        loses its cache key and the key stops being findable (``uncache``). The seam that
        decides when a freed block's key is dropped."""
        key = self._key_of.pop(block, None)
        if key is not None:
            self.uncache(key, block)
        for alias in self._aliases_of.pop(block, ()):
            self.uncache(alias, block)

    def uncache(self, key: object, block: int) -> None:
        """Remove ``block`` from the blocks holding ``key``: with no other, its prefix is no
        longer found."""
        holders = self._by_key[key]
        del holders[block]
        if not holders:
            del self._by_key[key]

    def touch(self, blocks: list[int]) -> None:
        """Take another reference (a prefix-cache hit)."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def cache(self, key: object, block: int) -> None:
        if block in self._key_of:
            return
        self._by_key.setdefault(key, {})[block] = None
        self._key_of[block] = key

    def cache_alias(self, key: object, block: int) -> None:
        """Make ``block`` findable under ``key`` too: the key of a prefix ending inside the
        block (a partial-block hit, ``prefix_match_unit``); it goes when the block is handed
        out again, with the block's own key."""
        aliases = self._aliases_of.setdefault(block, [])
        if key not in aliases:
            aliases.append(key)
            self._by_key.setdefault(key, {})[block] = None

    def lookup(self, key: object) -> int | None:
        holders = self._by_key.get(key)
        return next(iter(holders)) if holders else None
