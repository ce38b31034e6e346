"""Per-group KV-cache managers: which blocks a request holds in one group.

One manager per group, each over its own ``BlockPool``. The engine says how many
block-table entries a request needs (``B * W`` tokens an entry when sharded, ``B`` when
replicated, a single block for a ring, ``1 + k`` for a Mamba state) and which positions
stop being needed (sliding window, chunked local, ring, state): the leading blocks it
releases go back to the pool and their entries become the null block.
"""

from __future__ import annotations

import numpy as np

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
        self._released: dict[int, int] = {}
        """Request -> how many leading entries of its row are known null (released or
        padded): ``release_skipped`` starts there, so a step costs O(newly released)."""
        self._arrays: dict[int, np.ndarray] = {}
        """Request -> its row as int64 numpy, kept in step with ``blocks`` (``row_array``)."""
        self._snapshots: dict[int, np.ndarray] = {}
        """Request -> the read-only copy of its mirror ``row_array`` last handed out, while the
        row has not changed since: a step's plans share it (no copy per row per snapshot)."""

    def held(self, req: int) -> list[int]:
        return self.blocks.get(req, [])

    def row_array(self, req: int) -> np.ndarray:
        """A read-only int64 copy of the request's row (a plan's snapshot): a copy of a mirror
        updated with each change, not a conversion of the whole list every step; the same
        array again while the row has not changed (snapshots never change, so they can be
        shared, and the worker skips a row it was handed before)."""
        row = self.blocks.get(req, [])
        snapshot = self._snapshots.get(req)
        if snapshot is not None and len(snapshot) == len(row):  # in-place changes drop it (release_skipped)
            return snapshot
        mirror = self._arrays.get(req)
        if mirror is None or len(mirror) != len(row):
            have = 0 if mirror is None else min(len(mirror), len(row))
            tail = np.asarray(row[have:], dtype=np.int64)
            mirror = tail if mirror is None else np.concatenate([mirror[:have], tail])
            self._arrays[req] = mirror
        snapshot = mirror.copy()
        snapshot.flags.writeable = False
        self._snapshots[req] = snapshot
        return snapshot

    def row_arrays(self) -> dict[int, np.ndarray]:
        """``row_array`` of every request holding a row (a plan's rows of this group)."""
        return {req: self.row_array(req) for req in self.blocks}

    def _forget(self, req: int) -> None:
        self._released.pop(req, None)
        self._arrays.pop(req, None)
        self._snapshots.pop(req, None)

    def num_new_blocks(self, req: int, num_tokens: int) -> int:
        return max(0, self.engine.blocks_needed(self.geometry, num_tokens) - len(self.blocks.get(req, ())))

    def allocate(self, req: int, num_tokens: int) -> None:
        n = self.num_new_blocks(req, num_tokens)
        if n:
            self.blocks.setdefault(req, []).extend(self.pool.allocate(n))

    def adopt(self, req: int, blocks: list[int]) -> None:
        """Start a request's table with prefix-cache hit blocks (already touched)."""
        self.blocks[req] = list(blocks)
        self._forget(req)

    def release_skipped(self, req: int, num_committed: int) -> int:
        """Free the leading blocks no longer needed; returns how many."""
        first = self.engine.first_needed_position(self.geometry, num_committed)
        if self.geometry.storage is Storage.RING or first == 0:
            return 0
        table = self.blocks.get(req, [])
        done = self._released.get(req, 0)
        upto = min(self.engine.num_released_blocks(self.geometry, first), len(table))
        if upto <= done:
            return 0
        # Entries below ``done`` are null already: a row only grows at its end (``allocate``)
        # and is replaced whole (``adopt``) or dropped (``free``), which forget the cursor.
        self._released[req] = upto
        freed = [b for b in table[done:upto] if b != NULL_BLOCK]
        if not freed:
            return 0
        self.pool.free(freed)  # in row order, as one block at a time would
        table[done:upto] = [NULL_BLOCK] * (upto - done)
        mirror = self._arrays.get(req)
        if mirror is not None:
            mirror[done:upto] = NULL_BLOCK  # (the part of it the mirror holds)
        self._snapshots.pop(req, None)
        return len(freed)

    def free(self, req: int) -> None:
        # Free in reverse so the tail of a request is evicted first (like vLLM).
        self.pool.free(list(reversed(self.blocks.pop(req, []))))
        self._forget(req)


class StateManager(GroupManager):
    """A Mamba (recurrent state) group, after vLLM's ``MambaManager``.

    The row has ``Engine.blocks_needed`` entries (``1 + k`` in ``none`` mode; in ``align``
    mode one per ``block_size`` tokens plus ``k``), but only its last ``1 + k`` entries,
    the state window, get blocks: new entries below the window are the null block, as
    vLLM pads them. The engine's ``first_needed_position`` (the last committed token) then
    releases the entries below the committed state. vLLM also moves leftover speculative
    blocks to the end of the row instead of allocating new ones; here they are released
    and new ones allocated, so a request can hold up to ``2 * (1 + k) + 1`` blocks at once
    in ``align`` mode (vLLM: ``2 + k``).
    """

    @property
    def window(self) -> int:
        return self.geometry.spec.num_state_blocks

    def _new_entries(self, req: int, num_tokens: int) -> tuple[int, int]:
        """(null entries, block entries) to append for a row of ``num_tokens`` tokens."""
        have = len(self.held(req))
        need = self.engine.blocks_needed(self.geometry, num_tokens)
        first_real = max(have, need - self.window)
        return max(0, first_real - have), max(0, need - first_real)

    def num_new_blocks(self, req: int, num_tokens: int) -> int:
        return self._new_entries(req, num_tokens)[1]

    def allocate(self, req: int, num_tokens: int) -> None:
        nulls, real = self._new_entries(req, num_tokens)
        if nulls or real:
            self.blocks.setdefault(req, []).extend([NULL_BLOCK] * nulls + self.pool.allocate(real))

    def blocks_per_request(self) -> int:
        return state_blocks_per_request(self.geometry)


def state_blocks_per_request(geometry: GroupGeometry) -> int:
    """The most blocks one request holds at once in a Mamba group (what its pool must offer)."""
    window = geometry.spec.num_state_blocks
    if geometry.spec.mamba_cache_mode == "align":
        return 2 * window + 1  # the old window, the new one, a block the committed state left behind
    return window


def make_manager(geometry: GroupGeometry, pool: BlockPool, engine: Engine) -> GroupManager:
    """The manager of one group: a ``StateManager`` for a Mamba group, else a ``GroupManager``."""
    cls = StateManager if geometry.storage is Storage.STATE else GroupManager
    return cls(geometry, pool, engine)
