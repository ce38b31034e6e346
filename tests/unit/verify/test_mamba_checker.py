"""The checker on Mamba state groups, end to end in one process (ranks as threads): the
Qwen3-Next built-in passes in both cache modes at many W; the checker's own state column
matches a hand-made table; and engines that put the state in the wrong block, skip the
speculative states, write a stale state or leave a replica behind are caught with a report
that names the group, the request and the state."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Storage
from dcpsim.model.layout import PAD
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.oracle import state_column
from support.helpers import builtin, run, scheduler

NAME = "qwen3-next-hybrid"


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (3, 4), (4, 16), (8, 1)])
def test_the_builtin_passes(W, I):
    sc = builtin(NAME, W, I)
    rep = run(sc)
    assert rep.passed, "\n".join(rep.failure.lines())
    state = next(g for g in rep.groups if g["storage"] == "state")
    assert not state["sharded"] and state["states_per_page"] == 1 and state["block_size"] == 8192
    s = rep.schedule
    assert s["finished"] == s["requests"] == 7 and s["preemptions"] >= 1 and s["reused_blocks"] > 0


@pytest.mark.parametrize("W,B", [(2, 16), (4, 16), (2, 64)])
def test_the_builtin_passes_in_align_mode(W, B):
    rep = run(builtin(NAME, W, mamba_cache_mode="align", block_size=B))
    assert rep.passed, "\n".join(rep.failure.lines())
    (eng,) = [g for g in rep.engine["groups"] if g["name"].startswith("Mamba")]
    assert eng["manager_block_size"] == B and eng["block_table_width"] == -(-8192 // B) + 2


def test_every_live_request_has_one_state_verified_per_rank():
    sc = builtin(NAME, 2)
    rep = run(sc, verify="full")
    views = sum(len(p.views) for p in scheduler(sc).plans())
    # every view: one state on each of the 2 ranks, plus its attention positions (sharded)
    attn = sum(v.num_committed for p in scheduler(sc).plans() for v in p.views)
    assert rep.verified_indices == attn + 2 * views
    # incremental: the states are still read at every check (their slot moves), fewer positions
    inc = run(sc)
    assert 2 * views < inc.verified_indices < attn + 2 * views


def test_state_column_by_hand():
    (g,) = [g for g in expected_groups(builtin(NAME, 2)) if g.storage is Storage.STATE]
    (a,) = [g for g in expected_groups(builtin(NAME, 2, mamba_cache_mode="align", block_size=16)) if g.storage is Storage.STATE]
    # none mode: a prefill chunk [0, 512) -> column 0; a decode [700, 703) with 2 drafts, 1 accepted
    # (committed 702: the state after 701 = token 1 of the step) -> column 1
    assert state_column(g, 0, 512, 0, 512) == 0
    assert state_column(g, 700, 703, 2, 702) == 1
    assert state_column(g, 700, 703, 2, 701) == 0 and state_column(g, 700, 703, 2, 703) == 2
    # align mode, B = 16: the step's last token 702 is in block 43; the chunk [512, 1024) ends in 63
    assert state_column(a, 700, 703, 2, 702) == 44
    assert state_column(a, 512, 1024, 0, 1024) == 63


class StateInColumnZero(ReferenceEngine):
    """Every state of a decode step in the first state block (the speculative blocks unused)."""

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if geometry.storage is Storage.STATE:
            slots = np.full(len(slots), int(block_row[0]))[-1:]
            index = index[-1:]
        return slots, index


class NoDraftStates(ReferenceEngine):
    """Only the true token's state: the states of accepted drafts are never written."""

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if geometry.storage is Storage.STATE and write.num_drafts:
            return slots[:1], index[:1]
        return slots, index


class StaleState(ReferenceEngine):
    """A prefill chunk stores the state of the position before its last token."""

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if geometry.storage is Storage.STATE and len(index) == 1 and write.stop - write.start > 1:
            index = index - 1
        return slots, index


class Rank1KeepsItsState(ReferenceEngine):
    """Rank 1 skips the state writes of decode steps (its replica goes stale)."""

    def write_slots(self, geometry, write, block_row, dcp_rank):
        slots, index = super().write_slots(geometry, write, block_row, dcp_rank)
        if geometry.storage is Storage.STATE and dcp_rank == 1 and write.stop - write.start - write.num_drafts == 1:
            slots = np.full(len(slots), PAD)
        return slots, index


@pytest.mark.parametrize(
    "engine,W", [(StateInColumnZero(), 2), (NoDraftStates(), 2), (StaleState(), 2), (Rank1KeepsItsState(), 2), (NoDraftStates(), 4)]
)
def test_a_misplaced_missing_or_stale_state_is_caught(engine, W):
    rep = run(builtin(NAME, W), engine=engine)
    f = rep.failure
    assert not rep.passed and f.kind == "wrong-content", rep.text()
    assert f.group.startswith("Mamba[") and f.index_kind == "state after position"
    assert f.expected_owner == "all" and f.expected_content is not None
    assert len(f.holdings) == W
    if isinstance(engine, StaleState):
        assert f.step == 0 and any(h.index == f.index - 1 for h in f.holdings)
    if isinstance(engine, Rank1KeepsItsState):
        rank0, rank1 = f.holdings[0], f.holdings[1]
        assert rank0.index == f.index and rank0.content == f.expected_content
        assert rank1.index != f.index


def test_a_misplaced_state_is_caught_in_align_mode_too():
    rep = run(builtin(NAME, 2, mamba_cache_mode="align", block_size=16), engine=NoDraftStates())
    assert not rep.passed and rep.failure.kind == "wrong-content" and rep.failure.group.startswith("Mamba[")
