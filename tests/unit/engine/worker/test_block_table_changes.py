"""The block table's change record, row by row as a long request's row changes."""

import numpy as np

from dcpsim.engine.worker.block_table import ALL_COLUMNS, BlockTable


def test_a_row_of_the_same_length_records_the_entries_that_changed():
    table = BlockTable("g", max_num_reqs=2, max_num_blocks_per_req=8)
    table.set_row(1, "b", np.array([4, 5, 6, 7]))
    assert table.take_changes() == {1: ALL_COLUMNS}
    table.set_row(1, "b", np.array([0, 5, 9, 7]))  # a window block released, one replaced
    assert table.take_changes()[1].tolist() == [0, 2]
    assert table.row(1).tolist() == [0, 5, 9, 7]


def test_the_record_matches_the_rows_compared_entry_by_entry():
    rng = np.random.default_rng(3)
    table = BlockTable("g", max_num_reqs=1, max_num_blocks_per_req=12)
    row = rng.integers(0, 6, size=5)
    table.set_row(0, "a", row)
    table.take_changes()
    for _ in range(300):
        new = rng.integers(0, 6, size=int(rng.integers(0, 13)))
        table.set_row(0, "a", new)
        got = table.take_changes().get(0, np.zeros(0, np.int64))
        span = max(len(row), len(new))
        padded = [np.concatenate([r, np.zeros(span - len(r), np.int64)]) for r in (row, new)]
        want = sorted(set(np.flatnonzero(padded[0] != padded[1]).tolist()) | set(range(min(len(row), len(new)), span)))
        assert got is not ALL_COLUMNS and got.tolist() == want
        assert table.row(0).tolist() == new.tolist() and not table.table[0, len(new) :].any()
        row = new
