"""``--verify incremental`` piece by piece: the change records of the worker's stores and
block tables, the checker's mapping of them back to local indices (``verify.changes``), and
faults that start late in a run (after the first full reads), which the incremental read
must catch at the same step and index as the full one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.worker.block_table import ALL_COLUMNS, BlockTable
from dcpsim.engine.worker.kv_store import KVStore
from dcpsim.model.layout import PAD
from dcpsim.model.plan import RequestView, ReqWrite
from dcpsim.verify.changes import (
    expected_at,
    locals_of_columns,
    locals_of_slots,
    locals_of_slots_groups,
    locals_of_slots_per_row,
    owned_index,
)
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.oracle import expected_on_rank, owned_count
from dcpsim.verify.read import read_slots
from dcpsim.verify.write_guard import WriteGuard
from support.helpers import builtin, run

# ----------------------------------------------------------------------------- change records


def test_the_store_records_every_written_slot_once_until_taken():
    store = KVStore(0, num_blocks=4, states_per_page=4)
    store.write(np.array([9, 3, 3]), np.zeros((3, 5), np.int64))
    store.write(np.array([5]), np.zeros((1, 5), np.int64))
    assert store.take_written().tolist() == [3, 5, 9]
    assert store.take_written().tolist() == []


def test_the_block_table_records_changed_columns_and_whole_rows():
    table = BlockTable("g", max_num_reqs=2, max_num_blocks_per_req=6)
    table.set_row(0, "a", np.array([4, 5, 6]))
    assert table.take_changes() == {0: ALL_COLUMNS}  # a new row
    table.set_row(0, "a", np.array([4, 5, 6]))
    assert table.take_changes() == {}  # nothing changed
    table.set_row(0, "a", np.array([0, 5, 7, 8]))  # entry 0 nulled, 2 replaced, 3 grown
    assert table.take_changes()[0].tolist() == [0, 2, 3]
    table.set_row(0, "a", np.array([0, 5]))  # cut off
    assert table.take_changes()[0].tolist() == [2, 3]
    assert table.row(0).tolist() == [0, 5] and table.table[0].tolist() == [0, 5, 0, 0, 0, 0]
    table.remove_row(0)
    assert table.take_changes() == {0: ALL_COLUMNS}


# ----------------------------------------------------------------------------- mapping back


@pytest.mark.parametrize("W,I", [(2, 1), (3, 4), (8, 16)])
def test_owned_index_and_count_match_the_naive_oracle(W, I):
    (group,) = [g for g in expected_groups(builtin("dsv3", W, I)) if g.sharded]
    fingerprints = np.arange(5000, dtype=np.int64) * 7
    for stop in (0, 1, I, I * W - 1, 999, 5000):
        view = RequestView(0, "r", stop, fingerprints)
        for rank in range(W):
            index, content = expected_on_rank(group, view, rank)
            assert owned_count(group, rank, stop) == len(index)
            local = np.arange(len(index), dtype=np.int64)
            assert np.array_equal(owned_index(group, rank, local), index)
            got_index, got_content = expected_at(group, view, rank, local)
            assert np.array_equal(got_index, index) and np.array_equal(got_content, content)


@pytest.mark.parametrize("bk", [None, 16])
def test_a_written_slot_maps_back_to_every_local_index_that_reads_it(bk):
    (group,) = [g for g in expected_groups(builtin("dsv3", 2)) if g.sharded]
    group = dataclasses.replace(group, kernel_block_size=bk)
    page = group.page_states
    rng = np.random.default_rng(0)
    row = np.array([3, 9, 0, 9, 5, 0], np.int64)  # block 9 twice, null entries
    slots = np.unique(rng.integers(0, 12 * page, size=40))
    local = locals_of_slots(row, slots, page)
    every = np.arange(len(row) * page, dtype=np.int64)
    reads = read_slots(group, row, every)
    assert sorted(local.tolist()) == every[np.isin(reads, slots)].tolist()
    assert locals_of_columns(np.array([1, 4]), page).tolist() == list(range(page, 2 * page)) + list(range(4 * page, 5 * page))


def test_written_slots_map_through_a_groups_rows_at_once_as_one_by_one():
    """The checker maps the written slots through all of a group's rows in one pass: the
    same local indices, in the same order, as row by row (empty rows, shared blocks)."""
    rng = np.random.default_rng(1)
    page = 4
    for _ in range(100):
        rows = [rng.integers(0, 10, size=rng.integers(0, 5)) for _ in range(int(rng.integers(1, 5)))]
        slots = np.unique(rng.integers(0, 10 * page, size=rng.integers(0, 12)))
        together = locals_of_slots_per_row(rows, slots, page)
        assert [x.tolist() for x in together] == [locals_of_slots(r, slots, page).tolist() for r in rows]
        assert all((np.diff(x) > 0).all() for x in together)  # sorted and distinct: locals_to_read_groups relies on it


def test_written_slots_map_through_every_groups_rows_at_once_as_group_by_group():
    """The checker maps every group's written slots through its rows in one pass (blocks
    numbered apart per group, pages of their own): the same as group by group (groups with
    no rows, no writes, overlapping block ids)."""
    rng = np.random.default_rng(2)
    for _ in range(100):
        groups = int(rng.integers(1, 5))
        pages = [int(rng.choice([1, 2, 4, 16])) for _ in range(groups)]
        rows_of = [[rng.integers(0, 10, size=rng.integers(0, 5)) for _ in range(int(rng.integers(0, 4)))] for _ in range(groups)]
        slots_of = [np.unique(rng.integers(0, 10 * p, size=rng.integers(0, 12))) for p in pages]
        flats = [np.concatenate(r) if r and rng.random() < 0.5 else None for r in rows_of]
        together = locals_of_slots_groups(rows_of, slots_of, pages, flats)
        alone = [locals_of_slots_per_row(r, s, p) if r else [] for r, s, p in zip(rows_of, slots_of, pages)]
        assert [[x.tolist() for x in g] for g in together] == [[x.tolist() for x in g] for g in alone]
        assert [[x.tolist() for x in g] for g in together] == [
            [locals_of_slots(r, s, p).tolist() for r in rows] for rows, s, p in zip(rows_of, slots_of, pages)
        ]


# ----------------------------------------------------------------------------- late faults


class LateStrayWrite(ReferenceEngine):
    """Once the first request decodes past ``after`` on rank ``rank``, its write also lands
    on a slot the second request's earliest index is read from (in ``group``)."""

    def __init__(self, after: int, rank: int, group: int):
        super().__init__()
        self.after, self.rank, self.group = after, rank, group

    def step_write_slots(self, geometry, writes, block_rows, dcp_rank):
        mapped = super().step_write_slots(geometry, writes, block_rows, dcp_rank)
        if (
            dcp_rank != self.rank
            or geometry.group_id != self.group
            or len(writes) < 2
            or writes[0].start < self.after
            or writes[1].start < 64
        ):
            return mapped
        other = writes[1]
        probe = ReqWrite(other.req_index, other.request_id, other.start - 64, np.zeros(64, np.int64))
        slots_b, _ = self.write_slots(geometry, probe, block_rows[1], dcp_rank)
        slots_b = np.asarray(slots_b)[np.asarray(slots_b) != PAD]
        slots_a, index_a = (np.asarray(x) for x in mapped[0])
        mine = slots_a != PAD
        if not len(slots_b) or not mine.any():
            return mapped
        mapped[0] = (np.append(slots_a, slots_b[0]), np.append(index_a, index_a[mine][0]))
        return mapped


class LateDroppedWrite(ReferenceEngine):
    """Once a request decodes past ``after``, rank ``rank`` maps its first position to PAD."""

    def __init__(self, after: int, rank: int, group: int):
        super().__init__()
        self.after, self.rank, self.group = after, rank, group

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if dcp_rank == self.rank and geometry.group_id == self.group and write.start >= self.after:
            slots = np.array(slots, copy=True)
            slots[np.flatnonzero(slots != PAD)[:1]] = PAD
        return slots, index


def outcome(rep):
    f = rep.failure
    return rep.passed, f and f.kind, f and f.step, f and f.group, f and f.request_id, f and f.index


CASES = [  # (scenario, W, engine, kind without the write guard)
    ("dsv3", 2, LateStrayWrite(after=300, rank=1, group=0), "wrong-content"),
    ("dsv41-hybrid", 2, LateStrayWrite(after=650, rank=0, group=0), "wrong-content"),  # replicated SWA
    ("dsv41-hybrid", 4, LateStrayWrite(after=650, rank=3, group=1), "wrong-content"),  # sharded records
    ("dsv3", 2, LateDroppedWrite(after=300, rank=0, group=0), "wrong-content"),
]


@pytest.mark.slow
@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
@pytest.mark.parametrize("name,W,engine,kind", CASES, ids=[f"{c[0]}-W{c[1]}-{type(c[2]).__name__}" for c in CASES])
def test_a_late_fault_is_caught_where_and_when_the_full_check_catches_it(name, W, engine, kind, guard, monkeypatch):
    if not guard:
        monkeypatch.setattr(WriteGuard, "judge", lambda self, plan, writes, shapes: None)
    sc = builtin(name, W)
    full = run(sc, engine=engine, verify="full")
    incremental = run(sc, engine=engine)
    assert not full.passed and full.failure.step > 0  # late: after the first (full) reads
    assert outcome(incremental) == outcome(full)
    if not guard:
        assert full.failure.kind == kind
    assert incremental.verified_indices < full.verified_indices


def test_groups_sharing_one_store_both_see_its_record():
    from dcpsim.verify.changes import ChangeTracker

    class View:
        def __init__(self):
            self.taken = []

        def take_written_slots(self, store):
            self.taken.append(store)
            return np.array([store * 10 + len(self.taken)])

        def take_table_changes(self, store):
            return {0: np.array([store])}

    tracker = ChangeTracker(View(), [1, 1, 2])
    tracker.take([])
    assert [w.tolist() for w in tracker.written] == [[11], [11], [22]]
    assert [c[0].tolist() for c in tracker.changed] == [[1], [1], [2]]
