"""The spec-decode (verify) mask check: the checker's expectation against a brute-force one, the
reference engine's mask passes it, and a mask built as if the interleave were 1 (vllm-ascend
0.23.0.post1's) fails as ``attention-mask`` naming the rank, the query and the key."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.plan import SpecDecodeMask, StepPlan
from dcpsim.verify.attention_mask import MaskJudge, expected_visible, rank_key_positions
from dcpsim.verify.geometry import ExpectedGroup
from support.helpers import builtin, geometries, run


def group(W: int, I: int) -> ExpectedGroup:
    return ExpectedGroup("g", ("l",), Storage.PAGED, Retention.FULL, True, W, I, 1, 64, None, num_speculative_tokens=3)


@given(st.integers(1, 8), st.integers(1, 16), st.integers(0, 300), st.data())
def test_key_positions_are_the_ranks_own_in_order(W, I, length, data):
    rank = data.draw(st.integers(0, W - 1))
    want = [p for p in range(length) if (p // I) % W == rank]
    assert rank_key_positions(group(W, I), length, rank).tolist() == want


def test_the_expected_mask_is_causal_over_positions():
    # W = 2, I = 4, context 6, 3 query tokens (positions 6, 7, 8); rank 0 holds 0-3 and 8
    assert expected_visible(group(2, 4), 6, 3, 0).astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # rank 1 holds 4-7: position 7 is hidden from the query at 6
    assert expected_visible(group(2, 4), 6, 3, 1).astype(int).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


@given(st.integers(1, 8), st.integers(1, 16), st.integers(0, 200), st.integers(1, 4), st.data())
def test_the_quick_test_of_a_mask_is_equality_with_the_expected_one(W, I, context, q, data):
    """``MaskJudge``'s test of a mask (each row shows as many keys as it must, all of them
    first) says exactly whether it equals ``expected_visible``: for the expected mask and for
    it with a key flipped, a row's keys shifted by one, or a column too many or too few."""
    from dcpsim.verify.attention_mask import _shows_exactly_its_prefixes

    rank = data.draw(st.integers(0, W - 1))
    want = expected_visible(group(W, I), context, q, rank)
    have = want.copy()
    change = data.draw(st.sampled_from(["none", "flip", "shift", "wider", "narrower"]))
    if change == "flip" and have.size:
        have[data.draw(st.integers(0, q - 1)), data.draw(st.integers(0, have.shape[1] - 1))] ^= True
    elif change == "shift" and have.shape[1] > 1:
        j = data.draw(st.integers(0, q - 1))
        have[j] = np.roll(have[j], 1)
    elif change == "wider":
        have = np.concatenate([have, np.zeros((q, 1), bool)], axis=1)
    elif change == "narrower" and have.shape[1]:
        have = have[:, :-1]
    same = have.shape == want.shape and np.array_equal(have, want)
    assert _shows_exactly_its_prefixes(group(W, I), context, q, rank, have) == same


@pytest.mark.parametrize("W,I", [(2, 1), (2, 128), (4, 8), (3, 32)])
def test_the_reference_mask_matches_the_expectation(W, I):
    sc = builtin("mtp-mask-interleave", W, I)
    g = next(g for g in geometries(sc) if g.sharded)
    engine = ReferenceEngine()
    context, q = np.array([250, 1020, 1023, 7], np.int64), np.array([4, 4, 2, 1], np.int64)
    for rank in range(W):
        masks = engine.spec_decode_mask(g, context, q, rank)
        judge = MaskJudge(rank, [group(W, I)], [g.group_id])
        plan = StepPlan(step=0, writes=(), views=(), rows_before=(), rows_after=())
        judge.judge(plan, [SpecDecodeMask(g.group_id, ("a", "b", "c", "d"), context, q, tuple(masks))])
        assert judge.checks == 4 and judge.count == 0, judge.kept


def test_a_wrong_shape_is_reported():
    judge = MaskJudge(0, [group(2, 4)], [0])
    plan = StepPlan(step=3, writes=(), views=(), rows_before=(), rows_after=())
    judge.judge(plan, [SpecDecodeMask(0, ("r",), np.array([6]), np.array([3]), (np.ones((3, 4), bool),))])
    assert judge.count == 1 and "the spec-decode mask is (3, 4), expected (3, 5)" in str(judge.kept[0])


def test_the_builtin_passes_and_the_interleave_one_mask_fails_it():
    assert run(builtin("mtp-mask-interleave", 2, 128)).passed
    report = run(builtin("mtp-mask-interleave", 2, 128), inject="spec-mask-interleave-one")
    assert not report.passed and report.failure.kind == "attention-mask", report.text()
    text = report.text()
    assert "rank 1 step 1" in text and "the query at position 250 sees the key at position 251" in text, text
    assert "rank 0 step 1" in text and "the query at position 250 does not see the key at position 126" in text, text
    # at I = 1 the fault's mask is the right one
    assert run(builtin("mtp-mask-interleave", 2, 1), inject="spec-mask-interleave-one").passed


def test_a_long_contexts_mask_is_judged_row_by_row_and_a_leak_still_named():
    """From 16K entries on the judge looks at a mask row by row: the right mask of a 40K-token
    context passes, one later key shown is reported with its position, as below that size."""
    W, context, q = 2, 40_000, 4
    want = expected_visible(group(W, 1), context, q, 1)
    assert want.size >= 1 << 14
    plan = StepPlan(step=5, writes=(), views=(), rows_before=(), rows_after=())
    judge = MaskJudge(1, [group(W, 1)], [0])
    judge.judge(plan, [SpecDecodeMask(0, ("r",), np.array([context]), np.array([q]), (want,))])
    assert judge.checks == 1 and judge.count == 0
    leak = want.copy()
    leak[0, -1] = True  # query 0 (position 40,000) shown rank 1's last key, position 40,003
    judge.judge(plan, [SpecDecodeMask(0, ("r",), np.array([context]), np.array([q]), (leak,))])
    assert judge.count == 1 and judge.kept[0].key_position == 40_003 and judge.kept[0].query_position == context
