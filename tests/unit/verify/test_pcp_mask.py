"""The checker's judge of the PCP prefill attention metadata (``verify.pcp_mask``): causality over
a split row's own positions, whatever pieces a rank computes."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.plan import PcpQueryKeys
from dcpsim.verify.attention_mask import MaskJudge
from dcpsim.verify.pcp_mask import judge_pcp_keys


class _Plan:
    step = 3


def _judged(queries, spans, query_len=16, start=100):
    judge = MaskJudge(1, [], [])
    rec = PcpQueryKeys("r0", start, query_len, np.asarray(queries, np.int64), np.asarray(spans, np.int64).reshape(-1, 4))
    judge_pcp_keys(judge, _Plan(), [rec])
    return judge


@pytest.mark.parametrize("pcp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("q", [1, 2, 5, 16, 17, 63, 64, 100])
def test_the_reference_split_is_causal_on_every_rank(q, pcp):
    engine = ReferenceEngine()
    seen = []
    for r in range(pcp):
        queries, spans = engine.pcp_query_keys(q, pcp, r)
        judge = _judged(queries, spans, query_len=q)
        assert judge.count == 0 and judge.checks == 1, [str(m) for m in judge.kept]
        seen.extend(queries.tolist())
    assert sorted(seen) == list(range(q))  # every token once over the group


def test_a_query_reading_a_later_key_is_a_leak_naming_it():
    judge = _judged([5], [[0, 4, 4, 7]])  # offset 5 reads keys 0..6
    assert judge.count == 1
    assert str(judge.kept[0]) == (
        "rank 1 step 3 request r0 (PCP prefill): the query at position 105 sees the key at position 106 "
        "(1 later key(s) shown, 0 earlier key(s) hidden over the row's wrong queries)"
    )


def test_a_lost_key_and_a_key_read_twice_are_named():
    lost = _judged([8, 9], [[0, 8, 8, 9], [0, 4, 8, 10]])  # offset 9 misses keys 4..7
    assert lost.count == 1 and "the query at position 109 does not see the key at position 104" in str(lost.kept[0])
    twice = _judged([6], [[0, 6, 5, 7]])  # key 5 in both ranges
    assert twice.count == 1 and "the query at position 106 reads 2 times the key at position 105" in str(twice.kept[0])


def test_a_query_outside_the_row_is_a_shape_failure():
    judge = _judged([16], [[0, 16, 16, 17]], query_len=16)
    assert judge.count == 1 and "offsets outside the row of 16" in str(judge.kept[0])


def test_a_single_range_or_an_empty_first_range_is_causal():
    assert _judged([0, 3], [[0, 0, 0, 1], [0, 4, 4, 4]]).count == 0
