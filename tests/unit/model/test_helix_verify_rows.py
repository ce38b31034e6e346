"""Helix's verify rows (speculative decoding, semantics section 15): the engine's math
(``model.helix``) and the checker's (``verify.helix``) against a naive token-by-token ledger
written here, in which each verify row appends its own ``1 + d`` tokens on the rank whose
decode block each lands in, then rolls the rejected drafts back."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpsim.model.helix import helix_local_keys, helix_local_seq_lens, helix_placement, helix_slot_mapping
from dcpsim.model.layout import PAD
from dcpsim.verify.helix import helix_map, helix_rank_positions


class Ledger:
    """Every rank's cache of one request, slot by slot (``None``: a gap): the prompt's blocks
    dealt round-robin (a partial last block stays partial); then each decode token, counted from
    the first decode step by the tokens *accepted* so far, goes to the rank its decode block
    ``count // B`` names (``% W``), which appends it at its write pointer (taking a new block
    when the pointer reaches the end of its blocks). A rollback clears the rejected tokens and
    moves the pointers of their ranks back."""

    def __init__(self, prompt_len: int, B: int, W: int):
        self.P, self.B, self.W = prompt_len, B, W
        self.cache = {r: [] for r in range(W)}
        for j, first in enumerate(range(0, prompt_len, B)):
            block = list(range(first, min(first + B, prompt_len)))
            self.cache[j % W].extend(block + [None] * (B - len(block)))
        self.pointer = {r: len(self.cache[r]) for r in range(W)}
        self.count = 0  # decode tokens accepted (the ledger's decode count)
        self.in_flight: list[tuple[int, int]] = []  # (rank, slot) of the row's tokens

    def verify_row(self, num_tokens: int) -> list[tuple[int, int, int]]:
        """Append a row of ``num_tokens = 1 + d`` tokens; ``(position, rank, slot)`` of each."""
        placed = []
        for j in range(num_tokens):
            t = self.count + j
            rank = (t // self.B) % self.W
            if self.pointer[rank] == len(self.cache[rank]):
                self.cache[rank].extend([None] * self.B)
            slot = self.pointer[rank]
            self.cache[rank][slot] = self.P + t
            self.pointer[rank] += 1
            placed.append((self.P + t, rank, slot))
        self.in_flight = [(r, s) for _, r, s in placed]
        return placed

    def accept(self, accepted_drafts: int) -> None:
        """Keep the row's true token and its first ``accepted_drafts`` drafts; roll the rest back."""
        keep = 1 + accepted_drafts
        for rank, slot in reversed(self.in_flight[keep:]):
            self.cache[rank][slot] = None
            self.pointer[rank] -= 1
        self.count += keep
        self.in_flight = []

    def placement(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        owner = np.full(length, -1, np.int64)
        local = np.full(length, -1, np.int64)
        for rank, slots in self.cache.items():
            for s, pos in enumerate(slots):
                if pos is not None and pos < length:
                    assert owner[pos] == -1, "a position on two ranks"
                    owner[pos], local[pos] = rank, s
        return owner, local


rows_strategy = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(B=st.integers(1, 8), W=st.integers(1, 4), prompt_len=st.integers(1, 40), rows=rows_strategy)
def test_verify_rows_match_the_ledger(B, W, prompt_len, rows):
    """Each row of ``1 + d`` tokens (``d`` drawn per row, as each request runs its own) is placed,
    in flight, where the ledger puts it, by the engine's and the checker's math; after the
    rejections the committed positions are where the ledger holds them, and each rank's keys
    below every verify token are the ledger's."""
    ledger = Ledger(prompt_len, B, W)
    for drafts, accept in rows:
        start = prompt_len + ledger.count
        placed = ledger.verify_row(1 + drafts)
        stop = start + 1 + drafts
        positions = np.arange(start, stop, dtype=np.int64)
        want_owner = np.array([r for _, r, _ in placed], np.int64)
        want_local = np.array([s for _, _, s in placed], np.int64)
        owner, local = helix_placement(positions, prompt_len=prompt_len, block_size=B, dcp_size=W)  # the engine's
        np.testing.assert_array_equal(owner, want_owner)
        np.testing.assert_array_equal(local, want_local)
        c_owner, c_local = helix_map(prompt_len, stop, B, W)  # the checker's
        np.testing.assert_array_equal(c_owner[start:], want_owner)
        np.testing.assert_array_equal(c_local[start:], want_local)
        l_owner, _ = ledger.placement(stop)
        for r in range(W):
            held = np.flatnonzero(l_owner == r)
            np.testing.assert_array_equal(helix_rank_positions(prompt_len, stop, r, B, W), held)  # the verify mask's keys
            keys, _ = helix_local_keys(stop, prompt_len=prompt_len, block_size=B, dcp_size=W, dcp_rank=r)
            np.testing.assert_array_equal(keys, held)
            bounds = helix_local_seq_lens(positions + 1, prompt_len=prompt_len, block_size=B, dcp_size=W, dcp_rank=r)
            np.testing.assert_array_equal(bounds, [int((held <= p).sum()) for p in positions])  # each verify token's keys
        ledger.accept(min(accept, drafts))
    committed = prompt_len + ledger.count
    owner, local = ledger.placement(committed)
    assert (owner >= 0).all()
    c_owner, c_local = helix_map(prompt_len, committed, B, W)
    np.testing.assert_array_equal(c_owner, owner)
    np.testing.assert_array_equal(c_local, local)


def test_a_verify_row_straddles_two_ranks_and_rejections_roll_back():
    """P = 5, B = 4, W = 2: prompt block 0 on rank 0 (slots 0-3), block 1 (position 4 alone) on
    rank 1 (slot 0, its tail a gap). A row of 1 + 3 at position 5 is decode block 0: rank 0,
    slots 4-7. One draft accepted: the next row starts at position 7 (decode token 2), its first
    two tokens retake rank 0's slots 6, 7 (the rejected drafts' places), the other two open
    decode block 1 on rank 1 at slots 4, 5: one row on two ranks. A row of 1 + 1 after one
    acceptance of 3 lands in decode block 1 alone."""
    P, B, W = 5, 4, 2
    row = np.arange(5, 9)
    owner, local = helix_placement(row, prompt_len=P, block_size=B, dcp_size=W)
    assert owner.tolist() == [0, 0, 0, 0] and local.tolist() == [4, 5, 6, 7]
    row = np.arange(7, 11)  # after 1 of 3 drafts accepted: positions 5, 6 committed
    owner, local = helix_placement(row, prompt_len=P, block_size=B, dcp_size=W)
    assert owner.tolist() == [0, 0, 1, 1] and local.tolist() == [6, 7, 4, 5]
    c_owner, c_local = helix_map(P, 11, B, W)
    assert c_owner[7:].tolist() == [0, 0, 1, 1] and c_local[7:].tolist() == [6, 7, 4, 5]
    # through a row [10, 11, 12] of entries: rank 1 writes the straddling row's last two tokens only
    slots = helix_slot_mapping(row, [10, 11, 12], prompt_len=P, block_size=B, dcp_size=W, dcp_rank=1)
    assert slots.tolist() == [PAD, PAD, 11 * 4 + 0, 11 * 4 + 1]
    row = np.arange(11, 13)  # all 3 accepted: decode tokens 6, 7
    owner, local = helix_placement(row, prompt_len=P, block_size=B, dcp_size=W)
    assert owner.tolist() == [1, 1] and local.tolist() == [6, 7]
