"""A rank's block tables (``dcpsim.engine.worker.block_table``): rows synced from the plan."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from dcpsim.engine.worker.block_table import BlockTable, BlockTableOverflow, never_changes


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


def test_a_removed_row_is_null_again_for_the_next_request_and_padded_rows_are_null_past_the_blocks():
    t = BlockTable("g", max_num_reqs=2, max_num_blocks_per_req=10)
    t.set_row(0, "a", np.array([5, 6, 7]))
    t.set_row(0, "a", np.array([5, 6]))  # cut back: entry 2 is null again
    assert t.table[0].tolist() == [5, 6] + [0] * 8
    t.set_row(0, "a", np.array([5, 6, 8, 9]))
    t.remove_row(0)
    assert not t.table.any(), "a freed row holds no block ids"
    t.set_row(1, "b", np.array([3]))  # reuses the freed row
    assert t.row(1).tolist() == [3] and t.table[t._row_of[1]].tolist() == [3] + [0] * 9
    assert t.padded_row(1, 4).tolist() == [3, 0, 0, 0]
    assert t.padded_row(1, 0).tolist() == [3], "never fewer entries than the blocks held"
    assert t.padded_row(1, 13).tolist() == [3] + [0] * 12, "null past the table's width"


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def test_only_arrays_nobody_can_change_count_as_never_changing():
    owned = _read_only(np.arange(4))
    assert never_changes(owned) and never_changes(owned[1:]), "a snapshot, and a view of it"
    assert not never_changes(np.arange(4)) and not never_changes([1, 2])
    writable = np.arange(4)
    assert not never_changes(_read_only(writable[1:])), "its base can still change it"
    # the launcher's schedule file: a frozen snapshot comes back read-only over immutable bytes
    loaded = pickle.loads(pickle.dumps(owned, protocol=pickle.HIGHEST_PROTOCOL))
    assert never_changes(loaded) and loaded.base is not None
    assert not never_changes(pickle.loads(pickle.dumps(np.arange(4), protocol=pickle.HIGHEST_PROTOCOL)))


def test_sync_skips_a_row_handed_the_same_unchangeable_array_again(monkeypatch):
    t = BlockTable("g", max_num_reqs=2, max_num_blocks_per_req=4)
    snapshot = pickle.loads(pickle.dumps(_read_only(np.array([5, 6])), protocol=pickle.HIGHEST_PROTOCOL))
    writable = np.array([1, 2])
    t.sync({0: snapshot, 1: writable}, {})
    calls = []
    real = t.set_row
    monkeypatch.setattr(t, "set_row", lambda req, *a: (calls.append(req), real(req, *a)))
    t.sync({0: snapshot, 1: writable}, {})
    assert calls == [1], "the writable row is compared again; the snapshot's is not"
    writable[1] = 3  # the reason it is: its entries may have changed in place
    t.sync({0: snapshot, 1: writable}, {})
    assert t.row(1).tolist() == [1, 3] and t.row(0).tolist() == [5, 6]
