"""The retention judge (``verify.retention``): every key a step's queries read must be held, by
the rank that owns it, in the rows the step read, whatever the rows hold after the step."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.faults.retention import ReleaseAtAllocationScheduler
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.kv_entry import CONTENT, FIELDS, GROUP, INDEX, WRITER
from dcpsim.model.plan import RequestView, ReqWrite, StepPlan
from dcpsim.verify.geometry import ExpectedGroup
from dcpsim.verify.retention import RetentionJudge, read_keys
from support.helpers import builtin, run

B = 4


def group(retention=Retention.WINDOW, sharded=False, **kw) -> ExpectedGroup:
    fields = dict(
        name="g", layer_names=("l",), storage=Storage.PAGED, retention=retention, sharded=sharded, dcp_size=2,
        interleave_size=1, tokens_per_state=1, block_size=B, kernel_block_size=None,
    )  # fmt: skip
    return ExpectedGroup(**{**fields, **kw})


class Rank:
    """A rank's store and block table as a ``RankView`` shows them: each block holds ``B`` slots."""

    def __init__(self, num_blocks=16):
        self.store = np.full((num_blocks * B, len(FIELDS)), -1, dtype=np.int64)
        self.rows: dict[int, np.ndarray] = {}
        self.read_rows: dict[int, np.ndarray] = {}

    def put(self, slot, index, content, writer=0):
        self.store[slot, [GROUP, INDEX, CONTENT, WRITER]] = [0, index, content, writer]

    def block_table_row(self, group, req):
        return self.rows[req].copy()

    def step_read_rows(self, group):
        return dict(self.read_rows)

    def read_entries(self, group, slots):
        slots = np.asarray(slots)
        out = np.full((len(slots), len(FIELDS)), -1, dtype=np.int64)
        inside = (slots >= 0) & (slots < len(self.store))
        out[inside] = self.store[slots[inside]]
        return out


FINGERPRINTS = np.arange(1000, 1100, dtype=np.int64)


def replicated_rank(row, length) -> Rank:
    """A replicated group's rank holding positions ``[0, length)`` at ``row``'s slots (null
    columns hold nothing)."""
    rank = Rank()
    rank.rows[0] = np.asarray(row, dtype=np.int64)
    for p in range(length):
        block = rank.rows[0][p // B]
        if block:
            rank.put(block * B + p % B, p, FINGERPRINTS[p])
    return rank


def step(start, q, committed, step=5):
    write = ReqWrite(0, "r0", start, FINGERPRINTS[start : start + q].copy())
    view = RequestView(0, "r0", committed, FINGERPRINTS)
    return StepPlan(step=step, writes=(write,), rows_before=({},), views=(view,), rows_after=({},))


def judge(g, rank, plan) -> RetentionJudge:
    j = RetentionJudge(0, [g], [0], {0: "r0"})
    j.judge(plan, rank)
    return j


def test_the_keys_a_step_reads():
    window, chunk = group(sliding_window=8), group(Retention.CHUNK, attention_chunk_size=8)
    assert read_keys(window, 20, 21) == (13, 20)  # the query at 20 reads (12, 20]
    assert read_keys(chunk, 20, 21) == (16, 20)  # its chunk [16, 24)
    assert read_keys(group(Retention.FULL), 20, 22) == (0, 20)
    records = group(Retention.FULL, storage=Storage.RECORDS, tokens_per_state=2)
    assert read_keys(records, 20, 22) == (0, 10)  # records emitted before position 20


def test_a_window_whose_oldest_key_is_held_passes():
    g = group(sliding_window=8)
    # the decode of position 20 reads 13..20: blocks 3 (12-15) and 4 (16-19) hold its context
    rank = replicated_rank([0, 0, 0, 3, 4, 5], 21)
    j = judge(g, rank, step(20, 1, 21))
    assert j.count == 0 and j.read == 1  # only 13: the check after the step judges 14..19


def test_a_window_released_one_token_early_fails():
    g = group(sliding_window=6)
    # the query at 20 reads 15..20; a window started one token late (at 16) freed block 3 (12-15)
    rank = replicated_rank([0, 0, 0, 0, 4, 5], 21)
    j = judge(g, rank, step(20, 1, 21))
    assert j.count == 1
    (m,) = j.kept
    assert (m.step, m.request_id, m.query_position, m.key, m.block) == (5, "r0", 20, 15, 0)
    assert m.content == FINGERPRINTS[15] and m.owner == "all"
    assert "the query at position 20 reads the position 15" in str(m) and "null block" in str(m)
    # the same row holds everything the next query needs: only a judge at the read sees it
    assert judge(g, rank, step(21, 1, 22)).count == 0


def test_a_row_released_after_the_read_is_judged_as_read():
    g = group(sliding_window=9)
    rank = replicated_rank([0, 0, 0, 3, 4, 5], 21)
    rank.read_rows[0] = rank.rows[0].copy()
    rank.rows[0][3] = 0  # released after the step: the next query (21) reads from 13
    assert judge(g, rank, step(20, 1, 21)).count == 0
    rank.read_rows[0][4] = 0  # the block of 16..19 was missing when the step read it
    j = judge(g, rank, step(20, 1, 21))
    assert j.count == 4 and j.kept[0].key == 16  # a changed column is judged past the retained start


def test_a_chunk_whose_keys_are_gone_fails():
    g = group(Retention.CHUNK, attention_chunk_size=8)
    rank = replicated_rank([0, 0, 0, 0, 4, 5], 23)  # the query at 23 reads its chunk 16..23
    assert judge(g, rank, step(23, 1, 24)).count == 0  # 16..22 are held
    rank.rows[0][4] = 0
    # crossing into the next chunk: the check after the step no longer needs 16..23
    j = judge(g, rank, step(23, 1, 24))
    assert j.count == 4 and j.kept[0].key == 16


def test_a_sharded_rank_judges_its_own_keys_at_their_local_index():
    g = group(Retention.FULL, sharded=True)  # W = 2, I = 1: rank 1 holds the odd positions
    rank = Rank()
    rank.rows[0] = np.array([3, 4], dtype=np.int64)  # each block: 4 local keys = 8 positions
    for p in range(1, 12, 2):
        local = p // 2
        rank.put(rank.rows[0][local // B] * B + local % B, p, FINGERPRINTS[p])
    j = RetentionJudge(1, [g], [0], {0: "r0"})
    j.judge(step(12, 1, 13), rank)
    assert j.count == 0 and j.read == 0  # full attention: the check after the step reads it all
    rank.read_rows[0] = np.array([3, 0], dtype=np.int64)  # its second block missing at the read
    j.judge(step(12, 1, 13), rank)
    assert j.count == 2 and (j.kept[0].key, j.kept[0].owner) == (9, 1)  # local 4, 5: positions 9, 11


# --- the fault, run in process ------------------------------------------------------------


class ReleaseAtAllocation(ReferenceEngine):
    """vLLM's release timing with the right window."""

    def make_scheduler(self, scenario, geometries, connector=None):
        return ReleaseAtAllocationScheduler(scenario, self, geometries, connector=connector)


def test_release_at_allocation_with_the_right_window_passes():
    report = run(builtin("gpt-oss-hybrid", 2), engine=ReleaseAtAllocation())
    assert report.passed, report.failure and report.failure.lines()


def test_a_window_released_one_early_is_caught_without_attention():
    report = run(builtin("gpt-oss-hybrid", 2), inject="sliding-window-release-one-early")
    f = report.failure
    assert f.kind == "retention-at-read", f.lines()
    assert (f.step, f.query_position, f.index) == (7, 686, 559) and f.group.startswith("SlidingWindow")
    assert f.request_id == "long-1" and f.expected_owner == "all"
    assert any("rank 1 step 7" in d and "no longer held" in d for d in f.details)


def test_only_the_judge_at_the_read_sees_it(monkeypatch):
    monkeypatch.setattr(RetentionJudge, "judge", lambda self, plan, view: None)
    assert run(builtin("gpt-oss-hybrid", 2), inject="sliding-window-release-one-early").passed


@pytest.mark.parametrize("name", ["sliding-window-early-release", "none"])
def test_the_judge_leaves_other_verdicts_alone(name):
    report = run(builtin("dsv41-hybrid", 2), inject=None if name == "none" else name)
    assert report.passed if name == "none" else report.failure.kind == "wrong-content"
    assert FAULTS["sliding-window-release-one-early"].applies_to(
        ReferenceEngine().geometries(builtin("dsv41-hybrid", 2).layers, builtin("dsv41-hybrid", 2).config)
    )
