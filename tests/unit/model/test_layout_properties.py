"""Property tests of ``dcpsim.model.layout`` against a brute-force reference.

The reference below is written with plain Python loops straight from the
formulas of docs/dcp-semantics.md sections 2-4 (virtual block ``B*W``, owner
from the offset inside the virtual block, kernel-block expansion done by
building the kernel id list, local lengths by counting a round-robin stream).
It deliberately shares no expression with ``dcpsim/layout.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpsim.errors import ConfigError
from dcpsim.model.layout import (
    PAD,
    kernel_block_table,
    local_seq_lens,
    owner_rank,
    query_local_seq_lens,
    record_emit_positions,
    record_slot_mapping,
    records_emitted,
    ring_slot_mapping,
    ring_states_to_write,
    runs_slot_mapping,
    slot_mapping,
)

FAST = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# --------------------------------------------------------------------------------------
# Brute-force reference (plain loops, from the doc)
# --------------------------------------------------------------------------------------


def ref_divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ref_kernel_ids(bt: list[int], B: int, Bk: int) -> list[int]:
    """KV block b expands to kernel ids b*k + 0, ..., b*k + k-1 (k = B // Bk)."""
    k = B // Bk
    out = []
    for b in bt:
        for j in range(k):
            out.append(b * k + j)
    return out


def ref_owner(p: int, *, B: int, W: int, I: int) -> int:
    """Owner from the offset inside the virtual block (doc section 2, first form)."""
    off = p % (B * W)
    return (off // I) % W


def ref_sharded_slot(p: int, r: int, kids: list[int], *, B: int, W: int, I: int, Bk: int) -> int:
    """Slot of position p on rank r of a sharded group, or PAD."""
    span = B * W
    vb = p // span
    off = p % span
    if (off // I) % W != r:
        return PAD
    loc = (off // (W * I)) * I + off % I
    assert 0 <= loc < B
    k = B // Bk
    return kids[vb * k + loc // Bk] * Bk + loc % Bk


def ref_plain_slot(p: int, bt: list[int], B: int) -> int:
    """Replicated (and W == 1) groups: the plain mapping on every rank."""
    return bt[p // B] * B + p % B


def ref_round_robin_owners(n: int, W: int, I: int) -> list[int]:
    """Owners of positions 0..n-1 by walking the stream: I positions per rank, then the next."""
    owners = []
    rank = 0
    run = 0
    for _ in range(n):
        owners.append(rank)
        run += 1
        if run == I:
            run = 0
            rank = (rank + 1) % W
    return owners


def ref_local_len(L: int, r: int, W: int, I: int) -> int:
    """How many positions < L rank r owns: a naive count."""
    return sum(1 for o in ref_round_robin_owners(L, W, I) if o == r)


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------

BLOCK_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


@st.composite
def geometries(draw, max_blocks: int = 4):
    """(W, B, I, Bk, block table) with I | B and Bk | B; distinct block ids."""
    W = draw(st.integers(1, 8))
    B = draw(st.sampled_from(BLOCK_SIZES))
    I = draw(st.sampled_from(ref_divisors(B)))
    Bk = draw(st.sampled_from(ref_divisors(B)))
    bt = draw(st.lists(st.integers(1, 400), min_size=1, max_size=max_blocks, unique=True))
    return W, B, I, Bk, bt


def _slots(positions, bt, *, B, W, r, I, Bk, replicated=False):
    return slot_mapping(
        positions,
        np.array(bt, dtype=np.int64),
        block_size=B,
        dcp_size=W,
        dcp_rank=r,
        interleave_size=I,
        kernel_block_size=Bk,
        replicated=replicated,
    )


# --------------------------------------------------------------------------------------
# Doc worked examples
# --------------------------------------------------------------------------------------


def test_doc_example_slot_mapping_b16_w2_i4():
    rank0 = slot_mapping(range(0, 40), [5, 6], block_size=16, dcp_size=2, dcp_rank=0, interleave_size=4)
    rank1 = slot_mapping(range(0, 40), [5, 6], block_size=16, dcp_size=2, dcp_rank=1, interleave_size=4)
    P = [PAD] * 4
    # block 5 -> slots 80..95 on each rank, block 6 -> 96..111
    expected0 = [80, 81, 82, 83] + P + [84, 85, 86, 87] + P + [88, 89, 90, 91] + P + [92, 93, 94, 95] + P + [96, 97, 98, 99] + P
    expected1 = P + [80, 81, 82, 83] + P + [84, 85, 86, 87] + P + [88, 89, 90, 91] + P + [92, 93, 94, 95] + P + [96, 97, 98, 99]
    assert rank0.tolist() == expected0
    assert rank1.tolist() == expected1
    # the array path gives the same
    arr = np.arange(40)
    assert slot_mapping(arr, [5, 6], block_size=16, dcp_size=2, dcp_rank=0, interleave_size=4).tolist() == expected0
    assert slot_mapping(arr, [5, 6], block_size=16, dcp_size=2, dcp_rank=1, interleave_size=4).tolist() == expected1


def test_doc_example_local_lengths_w2_i4():
    lens = [1, 4, 5, 8, 9]
    expected = [[1, 0], [4, 0], [4, 1], [4, 4], [5, 4]]
    assert local_seq_lens(lens, dcp_size=2, interleave_size=4).tolist() == expected
    assert local_seq_lens(lens, dcp_size=2, interleave_size=4, dcp_rank=0).tolist() == [1, 4, 4, 4, 5]
    assert local_seq_lens(lens, dcp_size=2, interleave_size=4, dcp_rank=1).tolist() == [0, 0, 1, 4, 4]


def test_query_local_lens_differ_from_local_minus_k_under_interleaving():
    # W=2, I=4, history H=3, q=4 query tokens -> token j sees global length 4, 5, 6, 7.
    # Rank 0 owns positions 0..3 (and next 8..11): local(4..7, 0) = 4, 4, 4, 4.
    # The wrong "local(L) - k" form: local(7, 0) = 4, minus (q-1-j) = 3, 2, 1, 0 -> 1, 2, 3, 4.
    per_token = query_local_seq_lens(3, 4, dcp_size=2, dcp_rank=0, interleave_size=4)
    assert per_token.tolist() == [4, 4, 4, 4]
    L = 3 + 4
    local_L = int(local_seq_lens([L], dcp_size=2, interleave_size=4, dcp_rank=0)[0])
    wrong = [local_L - (4 - 1 - j) for j in range(4)]
    assert wrong == [1, 2, 3, 4]
    assert per_token.tolist() != wrong
    # rank 1 owns 4..7: local(4..7, 1) = 0, 1, 2, 3 (here the two forms happen to agree)
    assert query_local_seq_lens(3, 4, dcp_size=2, dcp_rank=1, interleave_size=4).tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------
# Slot mapping: sharded and replicated
# --------------------------------------------------------------------------------------


def _check_sharded_full_span(W, B, I, Bk, bt):
    total = len(bt) * B * W
    kids = ref_kernel_ids(bt, B, Bk)
    per_rank_range = [_slots(range(0, total), bt, B=B, W=W, r=r, I=I, Bk=Bk) for r in range(W)]
    per_rank_array = [_slots(np.arange(total), bt, B=B, W=W, r=r, I=I, Bk=Bk) for r in range(W)]
    for r in range(W):
        assert per_rank_range[r].dtype == np.int64
        assert per_rank_range[r].tolist() == per_rank_array[r].tolist()
    for p in range(total):
        owner = ref_owner(p, B=B, W=W, I=I)
        non_pad = [r for r in range(W) if per_rank_array[r][p] != PAD]
        assert non_pad == [owner], (p, non_pad, owner)
        expected = ref_sharded_slot(p, owner, kids, B=B, W=W, I=I, Bk=Bk)
        assert per_rank_array[owner][p] == expected, (p, owner)
    return per_rank_array


@FAST
@given(geometries())
def test_sharded_every_position_has_exactly_one_owner_with_reference_slot(geo):
    _check_sharded_full_span(*geo)


@pytest.mark.parametrize("W", range(1, 9))
@pytest.mark.parametrize("B", [4, 6, 12, 16])
def test_sharded_sweep_all_interleaves_and_kernel_blocks(W, B):
    """Deterministic coverage: every W in 1..8 (3, 5, 6, 7 included), every I | B, every Bk | B."""
    bt = [7, 3, 11]
    for I in ref_divisors(B):
        for Bk in ref_divisors(B):
            _check_sharded_full_span(W, B, I, Bk, bt)


@FAST
@given(geometries())
def test_replicated_every_rank_has_plain_slot(geo):
    W, B, I, Bk, bt = geo
    total = len(bt) * B
    expected = [ref_plain_slot(p, bt, B) for p in range(total)]
    for r in range(W):
        got_range = _slots(range(0, total), bt, B=B, W=W, r=r, I=I, Bk=Bk, replicated=True)
        got_array = _slots(np.arange(total)[::-1], bt, B=B, W=W, r=r, I=I, Bk=Bk, replicated=True)
        assert got_range.tolist() == expected
        assert got_array.tolist() == expected[::-1]


@FAST
@given(geometries())
def test_slots_of_one_rank_are_distinct_and_inside_the_requests_blocks(geo):
    W, B, I, Bk, bt = geo
    total = len(bt) * B * W
    kernel_set = set(ref_kernel_ids(bt, B, Bk))
    for r in range(W):
        slots = _slots(range(0, total), bt, B=B, W=W, r=r, I=I, Bk=Bk)
        owned = [int(s) for s in slots if s != PAD]
        # every virtual block gives each rank exactly B slots
        assert len(owned) == len(bt) * B
        assert len(set(owned)) == len(owned)
        for s in owned:
            assert s // B in bt
            assert s // Bk in kernel_set
        # and the expanded kernel table from the library is the same list
        assert kernel_block_table(bt, block_size=B, kernel_block_size=Bk).tolist() == ref_kernel_ids(bt, B, Bk)


@FAST
@given(geometries())
def test_local_order_of_owned_positions_equals_slot_order(geo):
    W, B, I, Bk, bt = geo
    total = len(bt) * B * W
    for table in (bt, sorted(bt)):
        for r in range(W):
            slots = _slots(np.arange(total), table, B=B, W=W, r=r, I=I, Bk=Bk)
            owned_positions = [p for p in range(total) if slots[p] != PAD]
            # the k-th owned position (in position order) is local index k of the rank
            for k, p in enumerate(owned_positions):
                assert slots[p] == table[k // B] * B + k % B
            if table == sorted(table):
                owned_slots = [int(slots[p]) for p in owned_positions]
                assert owned_slots == sorted(owned_slots)
                assert len(set(owned_slots)) == len(owned_slots)


@FAST
@given(geometries(), st.data())
def test_range_fast_path_equals_array_path(geo, data):
    W, B, I, Bk, bt = geo
    total = len(bt) * B * W
    start = data.draw(st.integers(0, total - 1), label="start")
    length = data.draw(st.one_of(st.integers(1, max(1, W * I - 1)), st.integers(1, total - start)), label="length")
    stop = min(total, start + length)
    kids = ref_kernel_ids(bt, B, Bk)
    for r in range(W):
        fast = _slots(range(start, stop), bt, B=B, W=W, r=r, I=I, Bk=Bk)
        general = _slots(np.arange(start, stop), bt, B=B, W=W, r=r, I=I, Bk=Bk)
        assert fast.tolist() == general.tolist()
        assert fast.tolist() == [ref_sharded_slot(p, r, kids, B=B, W=W, I=I, Bk=Bk) for p in range(start, stop)]
    rstop = min(stop, len(bt) * B)
    if start < rstop:
        for r in range(W):
            fast = _slots(range(start, rstop), bt, B=B, W=W, r=r, I=I, Bk=Bk, replicated=True)
            general = _slots(np.arange(start, rstop), bt, B=B, W=W, r=r, I=I, Bk=Bk, replicated=True)
            assert fast.tolist() == general.tolist() == [ref_plain_slot(p, bt, B) for p in range(start, rstop)]


@pytest.mark.parametrize(
    "start,stop",
    [(0, 1), (1, 2), (3, 5), (5, 7), (6, 7), (13, 14), (7, 18), (17, 40), (40, 41), (0, 96), (95, 96)],
)
@pytest.mark.parametrize("W,B,I", [(3, 8, 2), (5, 4, 4), (6, 6, 3), (7, 12, 1), (8, 16, 4)])
def test_range_fast_path_short_and_offset_ranges(start, stop, W, B, I):
    bt = [9, 2, 14, 5, 20]
    total = len(bt) * B * W
    assert stop <= total
    kids = ref_kernel_ids(bt, B, B)
    for r in range(W):
        fast = _slots(range(start, stop), bt, B=B, W=W, r=r, I=I, Bk=None)
        assert fast.tolist() == [ref_sharded_slot(p, r, kids, B=B, W=W, I=I, Bk=B) for p in range(start, stop)]
        assert fast.tolist() == _slots(np.arange(start, stop), bt, B=B, W=W, r=r, I=I, Bk=None).tolist()


@FAST
@given(geometries(), st.data())
def test_arbitrary_position_arrays(geo, data):
    """Non-contiguous, unsorted, repeated positions, as a list or an array."""
    W, B, I, Bk, bt = geo
    total = len(bt) * B * W
    positions = data.draw(st.lists(st.integers(0, total - 1), min_size=0, max_size=60), label="positions")
    kids = ref_kernel_ids(bt, B, Bk)
    for r in range(W):
        got = _slots(positions, bt, B=B, W=W, r=r, I=I, Bk=Bk)
        got_arr = _slots(np.array(positions, dtype=np.int32), bt, B=B, W=W, r=r, I=I, Bk=Bk)
        expected = [ref_sharded_slot(p, r, kids, B=B, W=W, I=I, Bk=Bk) for p in positions]
        assert got.tolist() == expected
        assert got_arr.tolist() == expected
        assert got.dtype == np.int64
    owners = owner_rank(positions, dcp_size=W, interleave_size=I).tolist()
    assert owners == [ref_owner(p, B=B, W=W, I=I) for p in positions]
    replicated_positions = [p for p in positions if p < len(bt) * B]
    got = _slots(replicated_positions, bt, B=B, W=W, r=W - 1, I=I, Bk=Bk, replicated=True)
    assert got.tolist() == [ref_plain_slot(p, bt, B) for p in replicated_positions]


@st.composite
def position_arrays(draw, total: int):
    """Arrays that do and do not look like a run: a run (as int64, int32, a reversed copy's
    reverse, a strided view), a run with two entries swapped (same endpoints and length),
    a run with a repeat, shuffled, sorted with gaps, a single position."""
    start = draw(st.integers(0, total - 1))
    stop = draw(st.integers(start + 1, total))
    run = np.arange(start, stop, dtype=np.int64)
    kind = draw(st.sampled_from(["run", "run32", "reversed twice", "strided view", "swapped", "repeat", "shuffled", "gaps", "single"]))
    if kind == "run32":
        return kind, run.astype(np.int32)
    if kind == "reversed twice":
        return kind, run[::-1].copy()[::-1]
    if kind == "strided view":
        wide = np.repeat(run, 2)
        return kind, wide[::2]
    if kind == "swapped" and run.size >= 4:  # two inner entries: the endpoints stay
        i = draw(st.integers(1, run.size - 3))
        run[[i, i + 1]] = run[[i + 1, i]]
        return kind, run
    if kind == "repeat" and run.size >= 2:
        i = draw(st.integers(1, run.size - 1))
        run[i] = run[i - 1]
        return kind, run
    if kind == "shuffled":
        return kind, np.array(draw(st.permutations(run.tolist())), dtype=np.int64)
    if kind == "gaps":
        keep = draw(st.lists(st.booleans(), min_size=run.size, max_size=run.size))
        return kind, run[np.array(keep, dtype=bool)]
    if kind == "single":
        return kind, run[:1]
    return kind, run


@FAST
@given(geometries(max_blocks=6), st.data())
def test_every_kind_of_position_array_equals_the_naive_formula(geo, data):
    """Contiguous arrays take the range fast path, the rest the general one: both must equal
    the reference slot (PAD where the rank does not store the position), on every rank."""
    W, B, I, Bk, bt = geo
    total = len(bt) * B * W
    kind, positions = data.draw(position_arrays(total), label="positions")
    kids = ref_kernel_ids(bt, B, Bk)
    owners = [0] * len(positions)
    for r in range(W):
        got = _slots(positions, bt, B=B, W=W, r=r, I=I, Bk=Bk)
        expected = [ref_sharded_slot(int(p), r, kids, B=B, W=W, I=I, Bk=Bk) for p in positions]
        assert got.dtype == np.int64 and got.tolist() == expected, kind
        for j, s in enumerate(got.tolist()):
            owners[j] += s != PAD
    assert owners == [1] * len(positions), "every position has exactly one rank"
    plain = positions[positions < len(bt) * B]
    got = _slots(plain, bt, B=B, W=W, r=0, I=I, Bk=Bk, replicated=True)
    assert got.tolist() == [ref_plain_slot(int(p), bt, B) for p in plain], kind


def test_contiguous_arrays_are_told_from_look_alikes():
    from dcpsim.model.layout import _contiguous_range

    assert _contiguous_range(np.arange(3, 90_000, dtype=np.int64)) == range(3, 90_000)  # spans chunks
    assert _contiguous_range(np.array([5, 6], dtype=np.int64)) == range(5, 7)
    assert _contiguous_range(np.array([0, 2, 1, 3], dtype=np.int64)) is None  # same endpoints and length
    late = np.arange(0, 90_000, dtype=np.int64)
    late[[80_000, 80_001]] = late[[80_001, 80_000]]  # out of order in the second chunk only
    assert _contiguous_range(late) is None
    assert _contiguous_range(np.array([4], dtype=np.int64)) is None  # one position: the general path
    assert _contiguous_range(np.array([3, 2], dtype=np.int64)) is None


def test_a_negative_block_id_is_not_hidden_by_the_pad_clamp():
    # not a real block id; the general path must still give the formula's value, not PAD
    bt = [-3, 2]
    positions = np.array([5, 0, 1, 4], dtype=np.int64)
    kids = ref_kernel_ids(bt, 2, 2)
    for r in range(2):
        got = _slots(positions, bt, B=2, W=2, r=r, I=1, Bk=2)
        assert got.tolist() == [ref_sharded_slot(int(p), r, kids, B=2, W=2, I=1, Bk=2) for p in positions]


def test_empty_positions():
    for positions in (range(5, 5), [], np.array([], dtype=np.int64)):
        out = slot_mapping(positions, [1], block_size=4, dcp_size=2, dcp_rank=1, interleave_size=2)
        assert out.shape == (0,) and out.dtype == np.int64


# --------------------------------------------------------------------------------------
# Local sequence lengths
# --------------------------------------------------------------------------------------


@FAST
@given(
    W=st.integers(1, 8),
    I=st.integers(1, 16),
    lens=st.lists(st.integers(0, 300), min_size=1, max_size=8),
)
def test_local_seq_lens_equal_naive_counts(W, I, lens):
    owners = ref_round_robin_owners(max(lens), W, I)
    naive = [[sum(1 for o in owners[:L] if o == r) for r in range(W)] for L in lens]
    matrix = local_seq_lens(lens, dcp_size=W, interleave_size=I)
    assert matrix.shape == (len(lens), W)
    assert matrix.tolist() == naive
    for r in range(W):
        vec = local_seq_lens(lens, dcp_size=W, interleave_size=I, dcp_rank=r)
        assert vec.shape == (len(lens),)
        assert vec.tolist() == [row[r] for row in naive]
    for L, row in zip(lens, matrix.tolist()):
        assert sum(row) == L
        assert all(row[r] >= row[r + 1] for r in range(W - 1))
        assert max(row) - min(row) <= I


@FAST
@given(geometries(max_blocks=3), st.data())
def test_local_seq_len_counts_the_owned_slots(geo, data):
    """The count of positions < L with a non-PAD slot on rank r is local(L, r)."""
    W, B, I, Bk, bt = geo
    total = len(bt) * B * W
    L = data.draw(st.integers(0, total), label="L")
    for r in range(W):
        slots = _slots(range(0, total), bt, B=B, W=W, r=r, I=I, Bk=Bk)
        owned = sum(1 for s in slots[:L] if s != PAD)
        assert owned == int(local_seq_lens([L], dcp_size=W, interleave_size=I, dcp_rank=r)[0])


@FAST
@given(
    W=st.integers(1, 8),
    I=st.integers(1, 8),
    H=st.integers(0, 150),
    q=st.integers(0, 40),
)
def test_query_local_seq_lens_equal_per_token_counts(W, I, H, q):
    owners = ref_round_robin_owners(H + q, W, I)
    for r in range(W):
        got = query_local_seq_lens(H, q, dcp_size=W, dcp_rank=r, interleave_size=I)
        expected = [sum(1 for o in owners[: H + j + 1] if o == r) for j in range(q)]
        assert got.tolist() == expected


def test_empty_shard_when_short():
    # L < W*I: the last ranks own nothing.
    assert local_seq_lens([5], dcp_size=4, interleave_size=2).tolist() == [[2, 2, 1, 0]]
    assert ref_local_len(5, 3, 4, 2) == 0


# --------------------------------------------------------------------------------------
# Compressed records, ring buffers
# --------------------------------------------------------------------------------------


@st.composite
def record_geometries(draw):
    W = draw(st.integers(1, 8))
    R = draw(st.sampled_from([1, 2, 4]))
    N = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))  # records per page = B // R
    I = draw(st.sampled_from(ref_divisors(N)))
    d = draw(st.sampled_from(ref_divisors(N)))  # kernel block, in records
    bt = draw(st.lists(st.integers(1, 300), min_size=1, max_size=4, unique=True))
    return W, R, N, I, d, bt


@FAST
@given(record_geometries())
def test_record_slot_mapping_matches_record_owner(geo):
    W, R, N, I, d, bt = geo
    B = N * R
    num_records = len(bt) * N * W
    kb = None if d == N else d * R
    records = list(range(num_records))
    got = [
        record_slot_mapping(
            records,
            bt,
            block_size=B,
            tokens_per_state=R,
            dcp_size=W,
            dcp_rank=r,
            interleave_size=I,
            kernel_block_size=kb,
        ).tolist()
        for r in range(W)
    ]
    for c in records:
        owner = (c // I) % W
        local_index = (c // (I * W)) * I + c % I
        expected = bt[local_index // N] * N + local_index % N  # pages of B // R records
        for r in range(W):
            assert got[r][c] == (expected if r == owner else PAD), (c, r)
    # replicated compressed cache: every rank, plain record mapping
    rep = record_slot_mapping(
        records[: len(bt) * N],
        bt,
        block_size=B,
        tokens_per_state=R,
        dcp_size=W,
        dcp_rank=W - 1,
        interleave_size=I,
        replicated=True,
    )
    assert rep.tolist() == [bt[c // N] * N + c % N for c in records[: len(bt) * N]]


@FAST
@given(start=st.integers(0, 200), length=st.integers(0, 80), R=st.integers(1, 9))
def test_records_emitted_brute_force(start, length, R):
    stop = start + length
    expected = [c for c in range(0, stop + 1) if start <= (c + 1) * R - 1 < stop]
    got = records_emitted(start, stop, R)
    assert got.tolist() == expected
    emit = record_emit_positions(got, R).tolist()
    assert emit == [(c + 1) * R - 1 for c in expected]
    assert all(start <= p < stop and (p + 1) % R == 0 for p in emit)


@FAST
@given(
    start=st.integers(0, 100),
    length=st.integers(0, 50),
    C=st.integers(1, 16),
    block=st.integers(0, 50),
)
def test_ring_states_and_slots(start, length, C, block):
    stop = start + length
    expected = [s for s in range(start, stop) if stop - s <= C]  # the last C states of the chunk
    states = ring_states_to_write(start, stop, C)
    assert states.tolist() == expected
    slots = ring_slot_mapping(states, block, C).tolist()
    assert slots == [block * C + s % C for s in expected]
    assert len(set(slots)) == len(slots)  # no row written twice in one chunk
    assert all(block * C <= s < (block + 1) * C for s in slots)


def test_ring_worked_example():
    # capacity 8, block 3: states 0..11 in one chunk -> only 4..11 written, at 24 + s % 8
    assert ring_states_to_write(0, 12, 8).tolist() == list(range(4, 12))
    assert ring_slot_mapping([4, 5, 6, 7, 8, 9, 10, 11], 3, 8).tolist() == [28, 29, 30, 31, 24, 25, 26, 27]
    with pytest.raises(ConfigError, match="capacity must be >= 1, got 0"):
        ring_slot_mapping([0], 1, 0)


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def _call(**overrides):
    kw = dict(block_size=16, dcp_size=2, dcp_rank=0, interleave_size=4, kernel_block_size=None)
    kw.update(overrides)
    positions = kw.pop("positions", range(0, 8))
    table = kw.pop("block_table", [1, 2])
    return slot_mapping(positions, table, **kw)


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (dict(interleave_size=32), r"cp_kv_cache_interleave_size \(32\).*block_size \(16\)"),
        (dict(interleave_size=6), r"block_size \(16\).*cp_kv_cache_interleave_size \(6\)"),
        (dict(kernel_block_size=6), r"kernel_block_size \(6\).*block_size \(16\)"),
        (dict(kernel_block_size=0), r"kernel_block_size.*got 0"),
        (dict(dcp_size=0), r"decode_context_parallel_size.*got 0"),
        (dict(interleave_size=0), r"cp_kv_cache_interleave_size.*got 0"),
        (dict(block_size=0), r"block_size.*got 0"),
        (dict(dcp_rank=2), r"dcp_rank.*\[0, 2\).*got 2"),
        (dict(dcp_rank=-1), r"dcp_rank.*got -1"),
        (dict(dcp_size=3, dcp_rank=3, interleave_size=1), r"dcp_rank.*\[0, 3\).*got 3"),
    ],
)
def test_invalid_config_raises_config_error_naming_values(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _call(**overrides)


def test_invalid_kernel_block_raises_for_replicated_too():
    with pytest.raises(ConfigError, match=r"kernel_block_size \(5\).*block_size \(16\)"):
        _call(kernel_block_size=5, replicated=True)


@pytest.mark.parametrize("as_range", [True, False])
def test_position_beyond_block_table_raises(as_range):
    # sharded W=2, B=16: 2 entries cover 2 * 32 = 64 positions (0..63)
    ok = range(0, 64) if as_range else np.arange(64)
    assert _call(positions=ok).shape == (64,)
    bad = range(60, 65) if as_range else np.array([3, 64, 1])
    with pytest.raises(ValueError, match=r"position 64.*2 entries"):
        _call(positions=bad)
    # replicated: the same 2 entries only cover 2 * 16 = 32 positions
    with pytest.raises(ValueError, match=r"position 32.*2 entries"):
        _call(positions=range(0, 33) if as_range else np.array([32]), replicated=True)


@pytest.mark.parametrize("as_range", [True, False])
def test_negative_position_raises(as_range):
    bad = range(-3, 4) if as_range else np.array([0, -3, 2])
    with pytest.raises(ValueError, match=r"positions must be >= 0, got -3"):
        _call(positions=bad)


def test_local_seq_lens_validation():
    with pytest.raises(ConfigError, match=r"dcp_rank.*\[0, 2\).*got 5"):
        local_seq_lens([4], dcp_size=2, interleave_size=1, dcp_rank=5)
    with pytest.raises(ConfigError, match=r"decode_context_parallel_size.*got 0"):
        local_seq_lens([4], dcp_size=0)
    with pytest.raises(ConfigError, match=r"cp_kv_cache_interleave_size.*got 0"):
        local_seq_lens([4], dcp_size=2, interleave_size=0)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        local_seq_lens([-1], dcp_size=2)
    with pytest.raises(ValueError, match="history_len"):
        query_local_seq_lens(-1, 2, dcp_size=2, dcp_rank=0)


def test_record_slot_mapping_validation():
    with pytest.raises(ConfigError, match=r"block_size \(6\).*tokens_per_state \(4\)"):
        record_slot_mapping([0], [1], block_size=6, tokens_per_state=4)
    with pytest.raises(ConfigError, match=r"tokens_per_state.*got 0"):
        record_slot_mapping([0], [1], block_size=8, tokens_per_state=0)
    with pytest.raises(ConfigError, match=r"kernel_block_size \(6\).*tokens_per_state \(4\)"):
        record_slot_mapping([0], [1], block_size=24, tokens_per_state=4, kernel_block_size=6)
    # records per page B // R = 4 with I = 8 under W = 2: interleave larger than a page of records
    with pytest.raises(ConfigError, match=re.escape("cp_kv_cache_interleave_size (8)")):
        record_slot_mapping([0], [1], block_size=16, tokens_per_state=4, dcp_size=2, interleave_size=8)


# --- a step's runs at once (runs_slot_mapping) ------------------------------------------


@FAST
@given(
    B_exp=st.integers(0, 4),
    W=st.integers(1, 5),
    I_exp=st.integers(0, 4),
    replicated=st.booleans(),
    runs=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), min_size=0, max_size=5),
    data=st.data(),
)
def test_runs_slot_mapping_is_slot_mapping_of_each_run(B_exp, W, I_exp, replicated, runs, data):
    """Each run's part of the joined mapping is ``slot_mapping`` of that run alone (the
    reference engine's ``step_write_slots`` maps a step's writes with it)."""
    B = 2**B_exp
    I = 2 ** min(I_exp, B_exp)
    r = data.draw(st.integers(0, W - 1))
    span = B * (W if W > 1 and not replicated else 1)
    rows = [
        np.array(
            data.draw(st.lists(st.integers(0, 999), min_size=(s + n - 1) // span + 1 if n else 0, max_size=12 + (s + n) // span)), np.int64
        )
        for s, n in runs
    ]
    slots, positions, ends = runs_slot_mapping(
        [s for s, _ in runs], [s + n for s, n in runs], rows, block_size=B, dcp_size=W, dcp_rank=r, interleave_size=I, replicated=replicated
    )
    assert len(ends) == len(runs) and positions.dtype == slots.dtype == np.int64
    lo = 0
    for (s, n), row, hi in zip(runs, rows, ends.tolist()):
        want = slot_mapping(range(s, s + n), row, block_size=B, dcp_size=W, dcp_rank=r, interleave_size=I, replicated=replicated)
        assert slots[lo:hi].tolist() == want.tolist()
        assert positions[lo:hi].tolist() == list(range(s, s + n))
        lo = hi
