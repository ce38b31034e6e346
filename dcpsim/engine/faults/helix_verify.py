"""Helix faults of speculative decoding: the verify rows' token count (bug class 51 of
docs/dcp-semantics.md section 8; ``helix-verify-fixed-draft-len``)."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.faults.base import Fault
from dcpsim.engine.reference import HelixGeometry
from dcpsim.model.helix import helix_placement
from dcpsim.model.layout import PAD


class HelixVerifyFixedDraftLen(Fault):
    name = "helix-verify-fixed-draft-len"
    bug_class = (
        "51. Helix's verify rows with a fixed token count: the step's generation tokens grouped in rows of "
        "1 + num_speculative_tokens, where each request's row carries 1 + its own draft count (TensorRT-LLM#19273)"
    )
    description = (
        "the per-token Helix slots of a step's verify rows are laid out as if every row carried 1 + k tokens: "
        "generation token m is placed as token m % (1 + k) of row m // (1 + k), so once a request runs fewer "
        "drafts (its output nearly done) every later row's tokens take the places of the row before it"
    )
    scenarios = ("helix-spec-decode",)
    layouts = ("helix",)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        helix = any(isinstance(g, HelixGeometry) and g.dcp_size > 1 for g in geometries)
        return helix and scenario.config.num_speculative_tokens > 0 and len(scenario.requests) > 1

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        mapped = super().step_write_slots(geometry, writes, block_rows, dcp_rank)
        if not isinstance(geometry, HelixGeometry) or geometry.num_speculative_tokens == 0:
            return mapped
        q = 1 + geometry.num_speculative_tokens  # TensorRT-LLM's tokens_per_gen_seq
        rows = [i for i, w in enumerate(writes) if not w.prefill]  # the generation (verify) rows, in order
        if len(rows) < 2:
            return mapped
        m = 0  # the generation token's index in the step's flat buffer
        for i in rows:
            n = len(mapped[i][1])
            slots = np.empty(n, np.int64)
            for j in range(n):
                row = rows[(m + j) // q]  # the row a fixed group size assigns the token to
                w = writes[row]
                slots[j] = self._slot(geometry, w.request_id, w.start + (m + j) % q, block_rows[row], dcp_rank)
            mapped[i] = (slots, mapped[i][1])
            m += n
        return mapped

    def _slot(self, g, request_id: str, position: int, block_row, dcp_rank: int) -> int:
        """The slot Helix gives ``position`` of ``request_id`` on ``dcp_rank`` (``PAD``: another
        rank's, or past the row the request holds)."""
        P = self.helix_prompt_len(request_id)
        pos = np.array([position], dtype=np.int64)
        blocks = self.helix_decode_blocks(pos - P, g.block_size, g.dcp_size) if position >= P else None
        owner, local = helix_placement(pos, prompt_len=P, block_size=g.block_size, dcp_size=g.dcp_size, decode_blocks=blocks)
        row = np.asarray(block_row, dtype=np.int64)
        entry = int(local[0]) // g.block_size
        if int(owner[0]) != dcp_rank or entry >= len(row):
            return PAD
        return int(row[entry]) * g.block_size + int(local[0]) % g.block_size
