"""A naive per-token walk of TensorRT-LLM's ``KVCacheManager.prepare_resources`` under Helix
(the tests' own, sharing nothing with dcpsim's engine or checker)."""

from __future__ import annotations

import numpy as np


def walk_prepare_resources(prompt_len: int, length: int, tokens_per_block: int, cp: int):
    """Every cp rank's KV cache after the transfer and ``length - prompt_len`` decode
    iterations, token by token: ``{rank: [position at local slot 0, 1, ...]}``, ``None`` in
    the slots a block leaves unfilled. The prompt's blocks reach rank ``j % cp`` at the
    transfer (a partial last block stays partial); then at each decode iteration
    ``it = 1, 2, ...`` only the rank ``((max(1, it) - 1) // tokens_per_block) % cp`` appends
    the iteration's token, starting a new block when its last one is full or was a prompt block."""
    cache = {r: [] for r in range(cp)}
    for j, first in enumerate(range(0, min(prompt_len, length), tokens_per_block)):
        rank = j % cp
        block = list(range(first, min(first + tokens_per_block, prompt_len)))
        cache[rank].extend(block + [None] * (tokens_per_block - len(block)))
    filled = {r: 0 for r in range(cp)}  # tokens in the rank's newest decode block (0: none open)
    for it, pos in enumerate(range(prompt_len, length), start=1):
        active = ((max(1, it) - 1) // tokens_per_block) % cp
        for rank in range(cp):
            if rank != active:
                continue  # a strict no-op: nothing appended, no block taken
            if filled[rank] == 0:
                cache[rank].extend([None] * tokens_per_block)
            cache[rank][len(cache[rank]) - tokens_per_block + filled[rank]] = pos
            filled[rank] = (filled[rank] + 1) % tokens_per_block
    return cache


def expected_from_walk(prompt_len, length, B, W):
    owner = np.full(length, -1, dtype=np.int64)
    local = np.full(length, -1, dtype=np.int64)
    for rank, slots in walk_prepare_resources(prompt_len, length, B, W).items():
        for s, pos in enumerate(slots):
            if pos is not None:
                assert owner[pos] == -1, "a position on two ranks"
                owner[pos], local[pos] = rank, s
    assert (owner >= 0).all()
    return owner, local
