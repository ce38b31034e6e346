"""The rows a step read (``BlockTable.mark_read``, ``read_rows``): the retention judge's view of
the block tables as the step's attention read them, kept only for rows that changed since."""

from __future__ import annotations

import numpy as np

from dcpsim.engine.worker.block_table import BlockTable


def _rows(**rows):
    return {int(k[1:]): np.array(v, dtype=np.int64) for k, v in rows.items()}


def test_only_the_rows_changed_after_the_read_are_kept_as_read():
    table = BlockTable("g", max_num_reqs=4, max_num_blocks_per_req=8)
    ids = {0: "a", 1: "b", 2: "c", 3: "d"}
    table.mark_read(False)
    table.sync(_rows(r0=[1, 2, 3], r1=[4, 5], r2=[6]), ids)  # the step reads these
    table.mark_read(True)
    table.sync(_rows(r0=[0, 2, 3], r1=[4, 5], r3=[7]), ids)  # released, kept, new; r2 dropped
    table.sync(_rows(r0=[0, 0, 3], r1=[4, 5], r3=[7]), ids)  # a second change keeps the first copy
    read = table.read_rows()
    assert sorted(read) == [0, 2, 3]
    assert read[0].tolist() == [1, 2, 3] and read[2].tolist() == [6] and read[3].tolist() == []
    assert table.row(0).tolist() == [0, 0, 3]  # the table itself holds the rows after


def test_the_next_step_starts_a_new_record():
    table = BlockTable("g", max_num_reqs=2, max_num_blocks_per_req=4)
    ids = {0: "a"}
    table.sync(_rows(r0=[1, 2]), ids)
    table.mark_read(True)
    table.sync(_rows(r0=[0, 2]), ids)
    assert table.read_rows()[0].tolist() == [1, 2]
    table.mark_read(False)
    table.sync(_rows(r0=[0, 2, 3]), ids)  # the next step's rows: not a change after its read
    table.mark_read(True)
    assert table.read_rows() == {}
