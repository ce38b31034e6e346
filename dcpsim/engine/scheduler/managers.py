"""Per-group KV-cache managers: which blocks a request holds in one group.

One manager per group, each over its own ``BlockPool``. The engine says how many
block-table entries a request needs (``B * W`` tokens an entry when sharded, ``B`` when
replicated, a single block for a ring) and which positions stop being needed (sliding
window, chunked local, ring): the leading blocks it releases go back to the pool and
their entries become the null block.
"""

from __future__ import annotations

from dcpsim.engine.geometry import GroupGeometry
from dcpsim.engine.interface import Engine
from dcpsim.engine.scheduler.block_pool import NULL_BLOCK, BlockPool
from dcpsim.model.kinds import Storage


class GroupManager:
    def __init__(self, geometry: GroupGeometry, pool: BlockPool, engine: Engine):
        self.geometry = geometry
        self.pool = pool
        self.engine = engine
        self.blocks: dict[int, list[int]] = {}

    def held(self, req: int) -> list[int]:
        return self.blocks.get(req, [])

    def num_new_blocks(self, req: int, num_tokens: int) -> int:
        return max(0, self.engine.blocks_needed(self.geometry, num_tokens) - len(self.held(req)))

    def allocate(self, req: int, num_tokens: int) -> None:
        n = self.num_new_blocks(req, num_tokens)
        if n:
            self.blocks.setdefault(req, []).extend(self.pool.allocate(n))

    def adopt(self, req: int, blocks: list[int]) -> None:
        """Start a request's table with prefix-cache hit blocks (already touched)."""
        self.blocks[req] = list(blocks)

    def release_skipped(self, req: int, num_committed: int) -> int:
        """Free the leading blocks no longer needed; returns how many."""
        first = self.engine.first_needed_position(self.geometry, num_committed)
        if self.geometry.storage is Storage.RING or first == 0:
            return 0
        table = self.blocks.get(req, [])
        released = 0
        for j in range(min(self.engine.num_released_blocks(self.geometry, first), len(table))):
            if table[j] != NULL_BLOCK:
                self.pool.free([table[j]])
                table[j] = NULL_BLOCK
                released += 1
        return released

    def free(self, req: int) -> None:
        # Free in reverse so the tail of a request is evicted first (like vLLM).
        self.pool.free(list(reversed(self.blocks.pop(req, []))))
