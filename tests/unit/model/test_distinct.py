import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dcpsim.model.distinct import has_repeats, member_of, sorted_distinct

ints = st.lists(st.integers(-5, 50), max_size=60).map(lambda v: np.array(v, dtype=np.int64))


@given(ints)
def test_sorted_distinct_is_np_unique(values):
    got = sorted_distinct(values)
    assert got.dtype == np.int64
    assert np.array_equal(got, np.unique(values))


@given(ints)
def test_has_repeats_says_whether_a_value_occurs_twice(values):
    assert has_repeats(values) == (len(set(values.tolist())) < len(values))


long_ints = st.lists(st.integers(-5, 500), min_size=64, max_size=200)
in_order = long_ints.map(lambda v: np.array(sorted(v), dtype=np.int64))  # already sorted: no sort needed
almost = long_ints.map(lambda v: np.array(sorted(v)[1:] + sorted(v)[:1], dtype=np.int64))  # one value out of order


@given(st.one_of(in_order, almost, long_ints.map(lambda v: np.array(v, dtype=np.int64))))
def test_long_arrays_in_order_or_not(values):
    """From 64 values on, an array in order skips the sort: the same answers either way."""
    original = values.copy()
    got = sorted_distinct(values)
    assert np.array_equal(got, np.unique(values))
    assert has_repeats(values) == (len(set(values.tolist())) < len(values))
    got[:] = -1  # a new array: the caller's is untouched
    assert np.array_equal(values, original)


@given(ints, ints)
def test_member_of_is_np_isin(values, pool):
    got = member_of(values, pool)
    assert got.dtype == bool and np.array_equal(got, np.isin(values, pool))


wide = st.lists(st.integers(-(1 << 40), 1 << 40), max_size=60).map(lambda v: np.array(v, dtype=np.int64))


@given(st.one_of(ints, wide), st.one_of(ints, wide))
def test_member_of_is_np_isin_over_any_range(values, pool):
    """Both ways: a table over a narrow range of ``values``, a sort of the pool otherwise."""
    got = member_of(values, pool)
    assert got.dtype == bool and np.array_equal(got, np.isin(values, pool))


@st.composite
def long_arrays(draw):
    """From 640 values (``TABLE_MIN``) on: a step's slots, in a range near their count, or
    values too widely spread for a table; drawn by numpy from a seed (Hypothesis draws a long
    list slowly)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(640, 1000))
    if draw(st.booleans()):
        return rng.integers(1000, 1000 + draw(st.integers(1, 4)) * n, size=n, dtype=np.int64)
    return rng.integers(-(1 << 40), 1 << 40, size=n, dtype=np.int64)


@given(long_arrays())
def test_long_arrays_out_of_order_by_a_table_or_a_sort(values):
    """A long array out of order in a narrow range is marked in a table, in a wide one sorted:
    the same answers as np.unique either way, in the values' dtype, the caller's array untouched."""
    from dcpsim.model.distinct import _arranged

    narrow_range = int(values.max()) - int(values.min()) <= 4 * len(values)
    in_order = bool((values[1:] >= values[:-1]).all())
    assert (_arranged(values)[1] is not None) == (narrow_range and not in_order)
    original = values.copy()
    got = sorted_distinct(values)
    assert got.dtype == values.dtype and np.array_equal(got, np.unique(values))
    assert has_repeats(values) == (len(np.unique(values)) < len(values))
    got[:] = -1
    assert np.array_equal(values, original)
    if narrow_range:
        as32 = values.astype(np.int32)
        assert sorted_distinct(as32).dtype == np.int32 and np.array_equal(sorted_distinct(as32), np.unique(as32))


def test_a_table_tells_one_repeat_among_distinct_values():
    values = np.arange(5000, 4000, -1, dtype=np.int64)  # out of order, all distinct
    assert not has_repeats(values) and np.array_equal(sorted_distinct(values), np.arange(4001, 5001))
    values[500] = values[900]  # one value twice
    assert has_repeats(values) and len(sorted_distinct(values)) == 999
