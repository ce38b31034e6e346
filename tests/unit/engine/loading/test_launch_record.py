"""``launch_record.written_bytes``: the bytes a launch's stores wrote, as the recorded effect
keeps them, whatever the stores' order, overlaps and item sizes."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

from dcpsim.engine.loading.launch_record import written_bytes


def naive(stores) -> np.ndarray:
    """Every byte of every store, sorted and distinct."""
    return np.unique(np.concatenate([(o[:, None] + np.arange(size)).ravel() for o, size in stores]))


@given(
    st.lists(
        st.tuples(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, 200), min_size=0, max_size=40)),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_written_bytes_are_every_stored_byte_once_ascending(raw, aligned):
    """Aligned stores (offsets a multiple of the item size, the kernels' case) and arbitrary ones,
    one item size or several, repeated and unordered offsets."""
    stores = [(np.asarray([o - o % size if aligned else o for o in offsets], dtype=np.int64), size) for size, offsets in raw]
    assume(sum(len(o) for o, _ in stores))  # an access with no live lane records no store
    got = written_bytes(stores)
    assert got.dtype == np.int64
    assert np.array_equal(got, naive(stores))


def test_a_kernels_store_in_order_keeps_its_bytes_in_order():
    stores = [(np.arange(0, 80, 8, dtype=np.int64), 8), (np.arange(80, 160, 8, dtype=np.int64)[::-1].copy(), 8)]
    assert np.array_equal(written_bytes(stores), np.arange(160))
    # two lanes storing to one element, and a store half over another: still each byte once
    assert np.array_equal(written_bytes([(np.array([8, 8, 0], dtype=np.int64), 8)]), np.arange(16))
    assert np.array_equal(written_bytes([(np.array([0, 4], dtype=np.int64), 8)]), np.arange(12))
