"""Sorted distinct values of an int array, by a sort or by a table over its range.

numpy 2.x's ``np.unique`` of a large int64 array is ~10x slower than a sort and a
comparison of neighbours (16K ids: 2.7 ms against 0.27 ms), and the change records and
write checks of a long-context step pass it thousands of ids. Those ids are a step's slots
of one store: out of order (a chunk's slots per group, the groups one after another), but
in a range not much wider than their count. There a table over the range (each value
marked, then the marks read back in order) costs a fifteenth of the sort (16K slots over a
range of 17K: 0.04 ms against 0.66 ms), which was a tenth of a rank's CPU at 1M tokens.
"""

from __future__ import annotations

import numpy as np

_SORTED_TEST_MIN = 64
"""From this many values on, ``sorted_distinct`` and ``has_repeats`` first test whether the
array is already in order (one comparison pass, a tenth of a sort's cost): a prefill step's
slots and block ids mostly are. Below it the sort costs less than the test."""


TABLE_MIN = 640
"""From this many values on, an array out of order but in a narrow range (``_arranged``) is
marked in a table instead of sorted; below it the sort costs less than the table's passes
(at 400 values 7.0 us against 9.2 us, at 800 13.3 against 10.6)."""

_TABLE_WIDTH = 4
"""``_arranged`` marks a range of up to this many times the values' count (plus ``_TABLE_SLACK``)."""


def _arranged(values: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None, int]:
    """``(ordered, None, 0)``: ``values`` sorted (``values`` itself when a long array is in
    order already); or ``(None, marked, lo)`` for a long int array out of order in a range at
    most ``_TABLE_WIDTH`` times its length (plus ``_TABLE_SLACK``): a table over ``[lo, max]``
    with each value marked. One call a question: the short arrays of a step ask it often."""
    n = len(values)
    if n >= _SORTED_TEST_MIN and bool((values[1:] >= values[:-1]).all()):
        return values, None, 0
    if n >= TABLE_MIN and values.dtype.kind == "i":
        lo, hi = values.min(), values.max()
        if int(hi) - int(lo) <= _TABLE_WIDTH * n + _TABLE_SLACK:
            marked = np.zeros(int(hi) - int(lo) + 1, dtype=bool)
            marked[values - lo] = True  # within the range: no overflow in the values' own dtype
            return None, marked, int(lo)
    return np.sort(values), None, 0


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` for a 1-d int array (a new array, never ``values`` itself)."""
    values = np.asarray(values)
    ordered, marked, lo = _arranged(values)
    if marked is not None:
        return (np.flatnonzero(marked) + lo).astype(values.dtype, copy=False)
    if len(ordered) < 2:
        return ordered  # a sort's copy: short arrays are always sorted
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def has_repeats(values: np.ndarray) -> bool:
    """Whether some value of the 1-d array occurs more than once."""
    if len(values) < 2:
        return False
    ordered, marked, _ = _arranged(np.asarray(values))
    if marked is not None:
        return int(np.count_nonzero(marked)) < len(values)
    return bool((ordered[1:] == ordered[:-1]).any())


_TABLE_SLACK = 1 << 16
"""``member_of`` marks a table over ``values``' range when it spans at most this many more
entries than both arrays hold."""


def member_of(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """``np.isin(values, pool)`` for 1-d int arrays: np.isin's dispatch costs ~100 us a call
    on the short arrays of one step.

    When ``values`` span a narrow range (a step's block ids, tested against a request's
    whole block-table row), by a table over that range: the pool's members in it marked,
    then looked up, in time linear in both, with no sort of the pool (a 10M-token row is
    164K entries, whose sort cost 5-17 ms a step against 0.4 ms); otherwise by a sort of
    ``pool`` and a binary search."""
    values = np.asarray(values)
    if not len(pool) or not len(values):
        return np.zeros(len(values), dtype=bool)
    pool = np.asarray(pool)
    lo, hi = int(values.min()), int(values.max())
    if hi - lo <= 2 * (len(values) + len(pool)) + _TABLE_SLACK:
        marked = np.zeros(hi - lo + 1, dtype=bool)
        marked[pool[(pool >= lo) & (pool <= hi)] - lo] = True
        return marked[values - lo]
    pool = np.sort(pool)
    at = np.searchsorted(pool, values)
    np.minimum(at, len(pool) - 1, out=at)
    return pool[at] == values
