"""Per-group KV-cache managers: which blocks a request holds in one group.

One manager per group, each over its own ``BlockPool``. The group's
``GroupLayout`` says how many tokens a block-table entry covers (``B * W``
when sharded, ``B`` when replicated, a single block for a ring) and which
positions stop being needed (sliding window, chunked local): whole blocks
below that point go back to the pool and their entries become the null block.
"""

from __future__ import annotations

from dcpsim.faults import Fault
from dcpsim.group_layout import GroupLayout
from dcpsim.scheduler.block_pool import NULL_BLOCK, BlockPool


class GroupManager:
    def __init__(self, layout: GroupLayout, pool: BlockPool, fault: Fault | None = None):
        self.layout = layout
        self.pool = pool
        self.fault = fault or Fault()
        self.blocks: dict[int, list[int]] = {}

    def held(self, req: int) -> list[int]:
        return self.blocks.get(req, [])

    def num_new_blocks(self, req: int, num_tokens: int) -> int:
        return max(0, self.layout.blocks_needed(num_tokens) - len(self.held(req)))

    def allocate(self, req: int, num_tokens: int) -> None:
        n = self.num_new_blocks(req, num_tokens)
        if n:
            self.blocks.setdefault(req, []).extend(self.pool.allocate(n))

    def adopt(self, req: int, blocks: list[int]) -> None:
        """Start a request's table with prefix-cache hit blocks (already touched)."""
        self.blocks[req] = list(blocks)

    def release_skipped(self, req: int, num_committed: int) -> int:
        """Free whole blocks below the first still-needed position; returns how many."""
        first = self.layout.first_needed_position(num_committed)
        if self.layout.storage == "ring" or first == 0:
            return 0
        table = self.blocks.get(req, [])
        released = 0
        # whole blocks below ``first``: first // manager_block_size (a fault may differ)
        for j in range(min(self.fault.num_released_blocks(self.layout, first), len(table))):
            if table[j] != NULL_BLOCK:
                self.pool.free([table[j]])
                table[j] = NULL_BLOCK
                released += 1
        return released

    def free(self, req: int) -> None:
        # Free in reverse so the tail of a request is evicted first (like vLLM).
        self.pool.free(list(reversed(self.blocks.pop(req, []))))
