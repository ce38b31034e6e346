"""The prefill and decode sides of a P/D transfer (issue 30).

P/D class 6 (vllm-ascend#5224): a prefill rank holds a finished prompt's blocks for the decode
ranks' pulls and frees each exactly once, after the last pull the transfer plan expects
(``PrefillBlocks``, ``PrefillRelease``); the fault ``prefill-frees-per-pull`` frees a block at its
first pull, so a later pull reads a freed block. P/D class 7 (sglang#32837): every decode rank is
notified of each prompt's completion with exact entry counts, a rank owning none of it too
(``KVConnector.notices``, ``harness.pd.judge_notices``; fault ``nixl-skips-empty-rank-notice``)."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.connector import PrefillBlocks, PrefillRelease
from dcpsim.engine.faults import get_pd_fault
from dcpsim.model.connector import InstanceLayout, token_routes
from dcpsim.model.kv_entry import EMPTY, FIELDS

B = 4
EMPTY_PAGES = np.zeros((0, len(FIELDS)), np.int64)


def _blocks(release, blocks=3):
    """One request (index 0, "r") of ``blocks`` blocks of ``B`` entries in group 0, ids 7, 8, 9..."""
    pages = np.arange(blocks * B * len(FIELDS), dtype=np.int64).reshape(-1, len(FIELDS))
    rows = np.arange(7, 7 + blocks, dtype=np.int64)
    return PrefillBlocks(1, {0: {0: pages}}, {0: {0: rows}}, [B], {0: "r"}, release)


def test_each_block_is_freed_after_its_last_pull_and_an_unpulled_one_at_the_end():
    ledger = _blocks(PrefillRelease())
    first, second = np.array([0, 1, 4]), np.array([2, 3, 5])  # block 0 by both, block 1 by both, block 2 by none
    for local in (first, second):
        ledger.expect(0, 0, local)
    a = ledger.pull(0, 0, first, EMPTY_PAGES)
    assert not ledger.frees[(0, 0, 0)] and (a != EMPTY).all()
    b = ledger.pull(0, 0, second, EMPTY_PAGES)
    assert (b != EMPTY).all() and ledger.frees[(0, 0, 0)] == ledger.frees[(0, 0, 1)] == 1
    assert ledger.finish() == [] and ledger.frees[(0, 0, 2)] == 1


def test_a_block_freed_at_its_first_pull_is_read_freed_by_the_second():
    ledger = _blocks(get_pd_fault("prefill-frees-per-pull").release())
    first, second = np.array([0, 1, 4]), np.array([2, 3, 5])
    for local in (first, second):
        ledger.expect(0, 0, local)
    assert (ledger.pull(0, 0, first, EMPTY_PAGES) != EMPTY).all()
    got = ledger.pull(0, 0, second, EMPTY_PAGES)
    assert (got == EMPTY).all()  # both blocks were freed by the first pull
    problems = ledger.finish()
    assert problems[0] == "prefill rank 1: request r group 0 block 0 (id 7) pulled after it was freed (2 of 2 pulls)"
    assert len(problems) == 2 and "block 1 (id 8)" in problems[1]


def test_a_block_never_freed_or_freed_twice_is_a_problem():
    class Never(PrefillRelease):
        def frees(self, pulls, expected):
            return False

    class Each(PrefillRelease):
        def frees(self, pulls, expected):
            return True

    never, each = _blocks(Never(), blocks=1), _blocks(Each(), blocks=1)
    for ledger in (never, each):
        for _ in range(2):
            ledger.expect(0, 0, np.array([0]))
        for _ in range(2):
            ledger.pull(0, 0, np.array([0]), EMPTY_PAGES)
    assert never.finish() == ["prefill rank 1: request r group 0 block 0 (id 7) freed 0 times, expected once"]
    assert each.finish() == [
        "prefill rank 1: request r group 0 block 0 (id 7) pulled after it was freed (2 of 2 pulls)",
        "prefill rank 1: request r group 0 block 0 (id 7) freed 2 times, expected once",
    ]


@pytest.mark.parametrize("connector", ["nixl-like", "resharding"])
def test_the_fault_changes_nothing_where_every_block_has_one_pull(connector):
    """Under NIXL every prefill block goes to one decode rank: freeing at the first pull is right.
    Re-sharding prefill I = 1 onto decode I = 16 pulls each block from several decode ranks."""
    src = InstanceLayout(2, 16 if connector == "nixl-like" else 1, 16)
    dst = InstanceLayout(4, 16, 16)
    routes = [r for r in token_routes(200, src, dst) if r.src_rank == 0]
    pulls = {}
    for r in routes:
        for b in np.unique(r.src_local // 16).tolist():
            pulls[b] = pulls.get(b, 0) + 1
    assert (max(pulls.values()) == 1) == (connector == "nixl-like")


# --- P/D class 7: every decode rank notified, with exact final-page counts (sglang#32837) ---------


def test_final_page_entries_across_page_boundaries():
    from dcpsim.engine.connector import final_page_entries

    assert [final_page_entries(n, 64) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 1, 63, 64, 1, 64, 1]


def test_every_decode_rank_is_notified_a_rank_owning_nothing_too():
    from dcpsim.engine.connector import NixlConnector
    from dcpsim.model.connector import block_matches

    src, dst = InstanceLayout(2, 64, 64), InstanceLayout(4, 64, 64)
    routes = block_matches(90, src, dst)
    assert NixlConnector().notices(routes, dst) == {0: (64, 64), 1: (26, 26), 2: (0, 0), 3: (0, 0)}
    bad = get_pd_fault("nixl-skips-empty-rank-notice").connector("nixl")
    assert bad.notices(routes, dst) == {0: (64, 64), 1: (26, 26)}
    # 300 tokens: rank 0 owns blocks 0 and 4 (64 + 44), rank 1 block 1 (64): its final page is whole
    assert NixlConnector().notices(block_matches(300, src, dst), dst) == {0: (108, 44), 1: (64, 64), 2: (64, 64), 3: (64, 64)}


def test_the_decode_side_judges_notices_from_its_own_layout():
    from dcpsim.campaigns.pd_selftest import _scenario
    from dcpsim.harness.pd import judge_notices
    from dcpsim.harness.pd_job import PDJob

    scenario = _scenario("nixl")
    notices = PDJob(scenario).notices()
    assert all(judge_notices(scenario, d, notices[d]) == [] for d in range(4))
    short = next(i for i, r in enumerate(scenario.requests) if r.request_id == "short")
    bad = PDJob(scenario, inject="nixl-skips-empty-rank-notice").notices()
    assert bad[2, short].tolist() == [-1, -1]
    assert judge_notices(scenario, 2, bad[2]) == ["decode rank 2: request short never notified of its transfer (it owns 0 of its entries)"]
    wrong = notices[1].copy()
    wrong[short] = (26, 0)  # a final page counted as tokens % B at the wrong boundary
    assert judge_notices(scenario, 1, wrong) == [
        "decode rank 1: request short notified of 26 entries, 0 on the final page; it owns 26, 26 on the final page"
    ]
