"""The checker's read path (``dcpsim.verify.read.read_slots``): slots computed by hand, and
agreement with the reference engine's write path: every index a rank stores is read back
at the slot the engine wrote it to (the checker's geometry and the engine's agree)."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import PAD
from dcpsim.model.plan import ReqWrite
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.read import read_slots
from support.helpers import builtin, expected_group


def group(storage=Storage.PAGED, *, B=64, **fields):
    retention = Retention.RING if storage is Storage.RING else Retention.FULL
    return expected_group(storage=storage, retention=retention, B=B, **fields)


def test_paged_reads_by_hand():
    row = np.array([5, 9])
    g = group()
    # local index i: block_table[i // 64] * 64 + i % 64; past the row: -1
    assert read_slots(g, row, np.array([0, 63, 64, 127, 128])).tolist() == [320, 383, 576, 639, -1]
    # kernel blocks of 16 states view the same pages: the same slots
    assert read_slots(group(Bk=16), row, np.array([0, 17, 63, 64, 127])).tolist() == [320, 337, 383, 576, 639]


def test_record_and_ring_reads_by_hand():
    # records: 128-token pages of 2-token records hold 64 records; local record c at row[c // 64]
    g = group(Storage.RECORDS, B=128, R=2)
    assert g.page_states == 64
    assert read_slots(g, np.array([3, 4]), np.array([0, 63, 64])).tolist() == [192, 255, 256]
    # a ring row s lives at block * C + s % C
    ring = group(Storage.RING, B=8, sharded=False)
    assert read_slots(ring, np.array([7]), np.array([0, 5, 8, 13])).tolist() == [56, 61, 56, 61]


CASES = [
    ("dsv3", 1, 1, None),
    ("dsv3", 2, 1, None),
    ("dsv3", 3, 64, None),
    ("dsv3", 4, 16, 16),
    ("dsv41-hybrid", 2, 8, None),
    ("dsv41-hybrid", 4, 16, 32),
    ("dsv41-hybrid", 3, 1, 16),
]


@pytest.mark.parametrize("name,W,I,Bk", CASES, ids=[f"{n}-W{w}-I{i}-Bk{b}" for n, w, i, b in CASES])
def test_reads_find_what_the_reference_engine_writes(name, W, I, Bk):
    sc = builtin(name, W, I, kernel_block_size=Bk)
    engine = ReferenceEngine()
    n = 1000
    write = ReqWrite(0, "r", 0, np.arange(n, dtype=np.int64))
    for geometry, expected in zip(engine.geometries(sc.layers, sc.config), expected_groups(sc), strict=True):
        assert (geometry.name, geometry.sharded) == (expected.name, expected.sharded)
        width = engine.blocks_needed(geometry, n)
        row = np.arange(width, dtype=np.int64) * 3 + 2  # distinct, not contiguous
        stored = []
        for r in range(W):
            slots, index = engine.write_slots(geometry, write, row, r)
            mine = slots != PAD
            assert mine.any()
            slots, index = slots[mine], index[mine]
            if expected.sharded:  # the rank's own indices, in increasing (local) order
                assert np.all((index // expected.interleave_size) % W == r) and np.all(np.diff(index) > 0)
                local = np.arange(len(index), dtype=np.int64)
            else:
                local = index
            assert np.array_equal(read_slots(expected, row, local), slots), (geometry.name, r)
            stored.append(index)
        if expected.sharded:  # every position (or record) of the write on exactly one rank
            everything = np.arange(n // expected.tokens_per_state)
            assert np.array_equal(np.sort(np.concatenate(stored)), everything)


@pytest.mark.parametrize("storage,Bk", [(Storage.PAGED, None), (Storage.PAGED, 16), (Storage.RECORDS, None), (Storage.RING, None)])
def test_reading_a_group_s_requests_in_one_pass_equals_reading_each(storage, Bk):
    """``read_slots_all`` (one pass over every request of a group) gives each request's
    ``read_slots``, concatenated: rows of different lengths (empty ones too), indices past a
    short row (-1), kernel blocks, records and rings."""
    from dcpsim.verify.read import read_slots_all

    if storage is Storage.RECORDS:
        g = group(storage, B=32, R=2)
    else:
        g = group(storage, B=32 if storage is Storage.PAGED else 8, sharded=storage is Storage.PAGED, Bk=Bk)
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(1, 6))
        rows = [rng.integers(1, 50, size=int(rng.integers(0 if storage is not Storage.RING else 1, 5))) for _ in range(n)]
        local = [np.sort(rng.integers(0, 160, size=int(rng.integers(0, 12)))) for _ in range(n)]
        each = np.concatenate([read_slots(g, row, x) for row, x in zip(rows, local)])
        assert read_slots_all(g, rows, local).tolist() == each.tolist()
    assert read_slots_all(g, [], []).tolist() == []
