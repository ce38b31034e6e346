"""A rank's block tables (``dcpsim.engine.worker.block_table``): rows synced from the plan."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.worker.block_table import BlockTable, BlockTableOverflow


def test_block_table_rows():
    t = BlockTable("g", max_num_reqs=3, max_num_blocks_per_req=4)
    t.sync({0: np.array([5, 6]), 2: np.array([1, 2, 3, 4])}, {0: "a", 2: "c"})
    assert list(t.row(0)) == [5, 6] and list(t.row(2)) == [1, 2, 3, 4]
    t.sync({2: np.array([0, 2, 3])}, {})
    assert list(t.row(2)) == [0, 2, 3]
    with pytest.raises(KeyError):  # request 0 no longer holds a row
        t.row(0)
    t.sync({0: np.array([7]), 2: np.array([0, 2, 3])}, {0: "a"})  # it can take a row again
    assert list(t.row(0)) == [7] and list(t.row(2)) == [0, 2, 3]
    with pytest.raises(BlockTableOverflow, match="needs 5 block-table entries"):
        t.set_row(1, "b", np.arange(1, 6))
