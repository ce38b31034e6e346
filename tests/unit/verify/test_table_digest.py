"""The block tables' digests kept across checks equal the digests from scratch."""

import numpy as np
import pytest

from dcpsim.verify.digest import as_int64s, ordered_digests
from dcpsim.verify.table_digest import TableDigests


def from_scratch(num_groups: int, reqs: list[int], table: list[np.ndarray]) -> np.ndarray:
    """Per group, the ordered digest of ``req_index, len(row), *row`` over the requests in order."""
    out = []
    n = len(reqs)
    for g in range(num_groups):
        flat = [x for req, row in zip(reqs, table[g * n : (g + 1) * n]) for x in (req, len(row), *row.tolist())]
        flat = np.array(flat, dtype=np.int64)
        out.append(ordered_digests(flat, np.zeros(len(flat), np.int64), np.array([len(flat)]))[0] if len(flat) else 0)
    return as_int64s(np.array(out, dtype=np.uint64))


def evolve(rng, row: np.ndarray) -> np.ndarray:
    """A row's next step: appended, an entry nulled or replaced, cut off, or as it was."""
    row = row.copy()
    what = rng.integers(0, 5)
    if what == 0:
        row = np.concatenate([row, rng.integers(0, 40, size=rng.integers(1, 4))])
    elif what == 1 and len(row):
        row[rng.integers(0, len(row))] = 0
    elif what == 2 and len(row):
        row[rng.integers(0, len(row))] = rng.integers(0, 40)
    elif what == 3 and len(row):
        row = row[: rng.integers(0, len(row))]
    return row


@pytest.mark.parametrize("scratch_below", [0, 12, 10**6], ids=["kept", "both", "scratch"])
def test_kept_digests_equal_the_digests_from_scratch_as_rows_change(scratch_below):
    """Kept row by row (``0``), digested from scratch (small groups: the default in a matrix
    cell), and groups crossing the limit as they grow and shrink (``12``)."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        groups = int(rng.integers(1, 4))
        kept = TableDigests(scratch_below)
        live = {int(r): [rng.integers(0, 40, size=rng.integers(0, 6)) for _ in range(groups)] for r in rng.choice(9, 3, replace=False)}
        for _ in range(25):
            for req in list(live):
                if rng.random() < 0.1:
                    del live[req]  # finished (maybe back later: its row is digested anew)
                else:
                    live[req] = [evolve(rng, row) for row in live[req]]
            if rng.random() < 0.2:
                live[int(rng.integers(0, 9))] = [rng.integers(0, 40, size=rng.integers(0, 6)) for _ in range(groups)]
            reqs = sorted(live, key=lambda r: (r * 5) % 9)  # any order, the same on every rank
            table = [live[r][g] for g in range(groups) for r in reqs]
            assert kept.digests(groups, reqs, table).tolist() == from_scratch(groups, reqs, table).tolist()


@pytest.mark.parametrize("scratch_below", [0, 10**6])
def test_a_changed_entry_changes_the_kept_digest(scratch_below):
    kept = TableDigests(scratch_below)
    row = np.arange(1, 200, dtype=np.int64)
    first = kept.digests(1, [0], [row])
    again = row.copy()
    again[150] = 0  # a released block
    assert kept.digests(1, [0], [again]).tolist() != first.tolist()
    assert kept.digests(1, [0], [row]).tolist() == first.tolist()
