"""Helix faults: TensorRT-LLM's decode-block owner (bug class 50 of docs/dcp-semantics.md
section 8; ``helix-decode-owner-unclamped``)."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.reference import HelixGeometry


class HelixDecodeOwnerUnclamped(Fault):
    name = "helix-decode-owner-unclamped"
    bug_class = (
        "50. Helix's decode-block owner without the step clamp: the first decode iteration, counted as 0, "
        "gives ((0 - 1) // tokens_per_block) % cp = cp - 1, so the first decode token lands on the last rank "
        "instead of rank 0 (TensorRT-LLM#17795, #17866)"
    )
    description = (
        "the first decode token of every request goes to rank W - 1 (TensorRT-LLM's (iteration - 1) // "
        "tokens_per_block without max(1, iteration), for a first iteration counted as 0), at the start of that "
        "rank's first decode block; rank 0, which owns decode block 0, never receives it"
    )
    scenarios = ("helix-decode",)
    layouts = ("helix",)

    def applies_to(self, geometries) -> bool:
        return any(isinstance(g, HelixGeometry) and g.dcp_size > 1 for g in geometries)

    def helix_decode_blocks(self, decode_tokens, block_size, dcp_size):
        blocks = np.asarray(super().helix_decode_blocks(decode_tokens, block_size, dcp_size), dtype=np.int64).copy()
        first = np.asarray(decode_tokens) == 0
        # iteration 0 unclamped: block (0 - 1) // B = -1, whose rank is -1 % W = W - 1; the token
        # goes to that rank's first decode block (its block W - 1 of the request's decode blocks)
        blocks[first] = (-1 // block_size) % dcp_size
        return blocks
