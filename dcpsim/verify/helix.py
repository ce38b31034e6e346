"""The checker's own Helix layout (TensorRT-LLM's decode context parallelism), from the rules alone.

Derived the way ``KVCacheManager.prepare_resources`` lays a request out, not with the
engine's arithmetic (``dcpsim.model.helix``): the request's blocks are listed in the order
they reach the ranks (the prompt's ``cdiv(P, B)`` blocks dealt round-robin at the transfer,
then one decode block per ``B`` decode iterations, on the rank TensorRT-LLM's
``((max(1, iteration) - 1) // tokens_per_block) % cp`` names for the iteration
``p - P + 1`` of its first token; under speculative decoding that count is the decode
tokens accepted before it, so a verify row of ``1 + d`` tokens may straddle two blocks and two
ranks, and a rolled-back draft's place is taken again by the token accepted there later), and
each rank numbers the blocks it receives in
arrival order: its ``n``-th block holds local slot indices ``[n * B, (n + 1) * B)``. A
position's local slot index is its block's number on its rank times ``B`` plus its
place in the block. Read through the request's block-table row at ``row[s // B] * B + s % B``.
"""

from __future__ import annotations

import functools

import numpy as np

from dcpsim.model.plan import StepPlan


@functools.lru_cache(maxsize=512)
def _blocks(prompt_len: int, length: int, block_size: int, dcp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks covering positions ``[0, length)`` in arrival order: (first position,
    owner rank, number on its rank) of each (read-only)."""
    B, W, P = block_size, dcp_size, prompt_len
    prompt_starts = np.arange(0, min(P, length), B, dtype=np.int64)
    prompt_owner = np.arange(len(prompt_starts), dtype=np.int64) % W  # dealt round-robin
    decode_starts = np.arange(P, length, B, dtype=np.int64)
    iteration = decode_starts - P + 1  # the decode iteration appending the block's first token
    decode_owner = ((np.maximum(iteration, 1) - 1) // B) % W
    starts = np.concatenate([prompt_starts, decode_starts])
    owner = np.concatenate([prompt_owner, decode_owner])
    number = np.zeros(len(owner), dtype=np.int64)
    for r in range(W):  # each rank numbers its blocks as they arrive
        mine = owner == r
        number[mine] = np.arange(int(mine.sum()), dtype=np.int64)
    for a in (starts, owner, number):
        a.flags.writeable = False
    return starts, owner, number


def helix_map(prompt_len: int, length: int, block_size: int, dcp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, local slot index)`` of every position ``< length`` of a request whose
    decoding starts at ``prompt_len``."""
    starts, owner, number = _blocks(int(prompt_len), int(length), block_size, dcp_size)
    pos = np.arange(int(length), dtype=np.int64)
    block = np.searchsorted(starts, pos, side="right") - 1
    return owner[block], number[block] * block_size + (pos - starts[block])


def helix_owner_of(index: np.ndarray, prompt_len: int, block_size: int, dcp_size: int) -> np.ndarray:
    """The rank that must hold each position of ``index``."""
    index = np.asarray(index, dtype=np.int64)
    if not len(index):
        return np.zeros(0, dtype=np.int64)
    owner, _ = helix_map(prompt_len, int(index.max()) + 1, block_size, dcp_size)
    return owner[index]


def helix_local_of(index: np.ndarray, prompt_len: int, block_size: int, dcp_size: int) -> np.ndarray:
    """Each position's local slot index on the rank that holds it."""
    index = np.asarray(index, dtype=np.int64)
    if not len(index):
        return np.zeros(0, dtype=np.int64)
    _, local = helix_map(prompt_len, int(index.max()) + 1, block_size, dcp_size)
    return local[index]


def helix_rank_positions(prompt_len: int, length: int, rank: int, block_size: int, dcp_size: int) -> np.ndarray:
    """The positions ``< length`` rank ``rank`` holds, ascending (its local order): the keys a
    verify row ending at ``length`` reads there."""
    owner, _ = helix_map(prompt_len, length, block_size, dcp_size)
    return np.flatnonzero(owner == rank).astype(np.int64)


def helix_held_below(lengths, rank: int, prompt_len: int, block_size: int, dcp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each length ``L``: (keys ``< L`` rank ``rank`` holds, local blocks they span, i.e.
    one past the block of the last of them; 0 for none)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    top = int(lengths.max(initial=0))
    owner, local = helix_map(prompt_len, top, block_size, dcp_size)
    mine = owner == rank
    held = np.concatenate([[0], np.cumsum(mine)])
    last = np.concatenate([[-1], np.maximum.accumulate(np.where(mine, local, -1))]) if top else np.array([-1])
    return held[lengths], (last[lengths] // block_size) + 1


def helix_metadata(group, plan: StepPlan, rows: dict, rank: int, prompt_len_of, width: int) -> dict:
    """The attention metadata rank ``rank`` must build for a Helix group in this step: per
    request the keys it holds below the step's length, each query token's keys below its
    position, and the local blocks those keys span, read from the row's first entries.
    ``prompt_len_of(request_id)``: where each request's decoding starts."""
    B, W = group.block_size, group.dcp_size
    kernel = group.kernel_block_size or B
    per_block = B // kernel
    seq, local, bounds, pages, indices, last = [], [], [], [], [], []
    for w in plan.writes:
        P = prompt_len_of(w.request_id)
        q = np.arange(w.start + 1, w.stop + 1, dtype=np.int64)
        held, _ = helix_held_below(np.concatenate([[w.stop], q]), rank, P, B, W)
        owner, local_slots = helix_map(P, w.stop, B, W)
        newest = int(local_slots[owner == rank].max()) if int(held[0]) else -1
        n_pages = newest // kernel + 1 if newest >= 0 else 0  # kernel pages up to the rank's newest key
        row = np.asarray(rows.get(w.req_index, np.zeros(0, np.int64)), dtype=np.int64)
        t = np.arange(n_pages, dtype=np.int64)  # kernel page t: part t % per_block of entry t // per_block
        entry = t // per_block
        inside = entry < len(row)
        indices.append(
            np.where(inside, row[np.minimum(entry, max(len(row) - 1, 0))] * per_block + t % per_block, -1)
            if len(row)
            else np.full(n_pages, -1, np.int64)
        )
        seq.append(w.stop)
        local.append(int(held[0]))
        bounds.append(held[1:])
        pages.append(n_pages)
        last.append(newest + 1 - (n_pages - 1) * kernel if n_pages else 0)
    zero = np.zeros(1, np.int64)
    q_lens = np.array([w.stop - w.start for w in plan.writes], dtype=np.int64)
    return dict(
        request_ids=tuple(w.request_id for w in plan.writes),
        seq_lens=np.array(seq, dtype=np.int64),
        query_start_loc=np.concatenate([zero, q_lens.cumsum()]).astype(np.int64),
        dcp_local_seq_lens=np.array(local, dtype=np.int64),
        query_local_bounds=np.concatenate(bounds).astype(np.int64) if bounds else np.zeros(0, np.int64),
        kv_indptr=np.concatenate([zero, np.cumsum(pages, dtype=np.int64)]).astype(np.int64),
        kv_indices=np.concatenate(indices).astype(np.int64) if indices else np.zeros(0, np.int64),
        kv_last_page_len=np.array(last, dtype=np.int64),
        block_table_width=width,
        num_dummy_requests=0,
        padded_slot_mapping=np.zeros(0, dtype=np.int64),
    )


__all__ = [
    "helix_held_below",
    "helix_local_of",
    "helix_map",
    "helix_metadata",
    "helix_owner_of",
    "helix_rank_positions",
]
