"""``verify.passing``: an exchange's at-once judgement of its queued steps says yes only when
every column shows what a passing step shows, and no to each single way a step fails. The
message's layout is the checker's own (``verify.check``'s row columns and header), so a change
of either that ``passing`` does not follow fails here."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.verify.check import _RETAINED, _ROW, _TABLES, BAD, COUNT, LOCALS, MULTISET, ORDERED, SHARE
from dcpsim.verify.digest import as_int64s
from dcpsim.verify.passing import (
    COUNTED,
    IGNORED,
    MULTISET_SUM,
    REPLICA_LOCALS,
    REPLICA_ORDERED,
    SAME,
    SHARE_SUM,
    ZERO,
    all_pass,
    column_roles,
)

COUNTERS, TABLES = _TABLES - 1, 2  # the judges' counts, then the digests' count, then the table digests
HEADER = COUNTERS + 1 + TABLES
ROW = len(_ROW)
# items: sharded read in part, sharded read in full, replicated
SHARDED = np.array([True, True, False])
PARTIAL = np.array([True, False, True])


def passing_step(world: int = 3) -> np.ndarray:
    """Every rank's message of a step that passes: counts 0, equal tables, a full read whose
    pieces add up to the shares, replicas with one ordered digest."""
    rng = np.random.default_rng(7)
    out = np.zeros((world, HEADER + 3 * ROW), dtype=np.int64)
    out[:, COUNTERS] = TABLES
    out[:, COUNTERS + 1 : HEADER] = rng.integers(-(2**62), 2**62, TABLES)
    rows = out[:, HEADER:].reshape(world, 3, ROW)
    rows[:, :, COUNT] = rng.integers(1, 50, (world, 3))
    pieces = rng.integers(0, 2**63, world, dtype=np.uint64) * np.uint64(2)  # wraps past 2**64
    shares = rng.integers(0, 2**63, world, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the same sum mod 2**64
        shares[-1] += pieces.sum(dtype=np.uint64) - shares.sum(dtype=np.uint64)
    rows[:, 1, MULTISET], rows[:, 1, SHARE] = as_int64s(pieces), as_int64s(shares)
    rows[:, 2, ORDERED] = 12345  # the same everywhere
    rows[:, 2, LOCALS] = 99  # every rank re-read the same indices
    return out


def roles() -> np.ndarray:
    return column_roles(COUNTERS, HEADER, SHARDED, PARTIAL)


def row_of(roles: dict[int, int]) -> list[int]:
    """An item row's roles, by the checker's column (the others ignored)."""
    return [roles.get(column, IGNORED) for column in range(ROW)]


PARTIAL_READ = row_of({BAD: ZERO, COUNT: COUNTED})
FULL_READ = row_of({BAD: ZERO, COUNT: COUNTED, MULTISET: MULTISET_SUM, SHARE: SHARE_SUM})
REPLICA = row_of({BAD: ZERO, COUNT: COUNTED, ORDERED: REPLICA_ORDERED, LOCALS: REPLICA_LOCALS})


def test_column_roles_follow_the_message_layout():
    r = roles()
    assert r[:COUNTERS].tolist() == [ZERO] * COUNTERS and r[_RETAINED] == ZERO
    assert r[COUNTERS] == IGNORED and r[COUNTERS + 1 : HEADER].tolist() == [SAME] * TABLES
    assert r[HEADER:].reshape(3, ROW).tolist() == [PARTIAL_READ, FULL_READ, REPLICA]


def test_a_passing_step_passes_with_the_entries_read_summed():
    step = passing_step()
    assert all_pass(step, roles()) == int(step[:, HEADER:].reshape(3, 3, ROW)[:, :, COUNT].sum())


def test_several_queued_steps_are_judged_together():
    steps = np.concatenate([passing_step(), passing_step()], axis=1)
    both = np.concatenate([roles(), roles()])
    assert all_pass(steps, both) == 2 * all_pass(passing_step(), roles())
    steps[1, HEADER + 3 * ROW + 0] = 1  # the second step's first counter on rank 1
    assert all_pass(steps, both) is None


def bad(column: int, rank: int = 1, value: int = 1):
    def change(step):
        step[rank, column] += value

    return change


def item(k: int, field: int) -> int:
    return HEADER + k * ROW + field


def unequal_locals(step):
    step[1, item(2, ORDERED)] += 1
    step[1, item(2, LOCALS)] += 1


@pytest.mark.parametrize(
    "break_it",
    [
        *(bad(c) for c in range(COUNTERS)),  # a write violation, metadata, events, masks, hits, keys missing
        bad(COUNTERS + 1),  # block tables differ
        bad(item(0, BAD)),  # a bad entry of a partial read
        bad(item(1, BAD), rank=0),  # a bad entry of a full read
        bad(item(2, BAD), rank=2),  # a bad replica entry
        bad(item(1, MULTISET)),  # the pieces do not add up to the shares
        bad(item(1, SHARE), rank=0),
        bad(item(2, ORDERED)),  # replicas read the same indices, digests differ
    ],
)
def test_each_way_a_step_fails_is_no(break_it):
    step = passing_step()
    break_it(step)
    assert all_pass(step, roles()) is None


def test_replicas_that_read_different_indices_are_left_to_the_oracle():
    step = passing_step()
    unequal_locals(step)  # different digests, but not over the same local indices
    assert all_pass(step, roles()) is not None


def test_columns_whose_role_is_ignored_never_decide():
    step = passing_step()
    step[:, COUNTERS] = [1, 2, 3]  # the digests' count
    step[:, item(0, ORDERED)] = [5, 6, 7]  # a partial sharded read sends no digest
    step[:, item(2, MULTISET)] = [5, 6, 7]
    assert all_pass(step, roles()) is not None


def test_steps_of_one_shape_share_one_read_only_roles_array():
    again = column_roles(COUNTERS, HEADER, SHARDED.copy(), PARTIAL.copy())
    assert again is roles() and not again.flags.writeable
    other = column_roles(COUNTERS, HEADER, SHARDED, ~PARTIAL)
    assert other is not again and other[HEADER:].reshape(3, ROW)[0].tolist() == FULL_READ
