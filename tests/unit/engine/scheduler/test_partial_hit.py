"""Partial-block prefix-cache hits (``prefix_match_unit``) and their copy-on-write, built-in
``prefix-partial-hit``: the alias keys of a block, the hit's length and copy, the worker's
per-rank copy, the refusal of a unit that does not divide a block, and the stale copy of
``partial-hit-stale-cow`` (bug class 54)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dcpsim.engine.faults.registry import get_fault
from dcpsim.engine.scheduler.block_pool import BlockPool
from dcpsim.engine.worker.model_runner import ModelRunner
from dcpsim.errors import ConfigError
from dcpsim.model.kv_entry import CONTENT, INDEX
from dcpsim.model.plan import BlockCopy
from dcpsim.verify.report import FailureKind
from support.helpers import builtin, geometries, run_fault, scheduler


def test_an_alias_key_finds_its_block_until_the_block_is_handed_out_again():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(("whole", 0), b)
    pool.cache_alias(("partial", 0, 8, 123), b)
    pool.cache_alias(("partial", 0, 16, 456), b)
    pool.free([b])
    assert pool.lookup(("partial", 0, 16, 456)) == b
    pool.allocate(3)  # every block: b is evicted
    assert pool.lookup(("partial", 0, 8, 123)) is None and pool.lookup(("partial", 0, 16, 456)) is None
    assert pool.lookup(("whole", 0)) is None


def admissions(sc, engine=None):
    """(step, request, hit, copies) of every admission."""
    out = []
    for plan in scheduler(sc, engine).plans():
        for e in plan.events:
            if e.kind.name == "ADMITTED":
                out.append((plan.step, e.request_id, e.prefix_hit, plan.copies if e.prefix_hit else ()))
    return out


@pytest.mark.parametrize("W", [2, 4])
def test_a_hit_ending_inside_a_block_gets_a_private_copy_of_its_match_units(W):
    sc = builtin("prefix-partial-hit", W)
    got = {r: (step, hit, copies) for step, r, hit, copies in admissions(sc)}
    # doc-b waited while doc-a's block went to hog: looked up again, nothing is left to hit
    assert got["doc-b"][1:] == (0, ())
    # doc-c shares 20 tokens of the document: 2 match units of 8 inside doc-b's first block
    step, hit, copies = got["doc-c"]
    assert hit == 16 and len(copies) == 1
    (copy,) = copies
    assert (copy.group, copy.tokens) == (0, 16) and copy.src != copy.dst


def test_the_match_unit_must_divide_every_block_span():
    sc = builtin("prefix-partial-hit", 2)
    sc = dataclasses.replace(sc, config=dataclasses.replace(sc.config, prefix_match_unit=12))
    with pytest.raises(ConfigError, match="prefix_match_unit 12 must divide"):
        scheduler(sc)


@pytest.mark.parametrize("W,I,tokens", [(2, 1, 16), (4, 1, 16), (2, 4, 12), (4, 2, 24)])
def test_each_rank_copies_its_shard_of_the_hit_tokens(W, I, tokens):
    sc = builtin("prefix-partial-hit", W, I)
    (g,) = geometries(sc)
    B = g.block_size
    for rank in range(W):
        runner = ModelRunner(get_fault(None), [g], [4], rank, max_num_reqs=4)
        store = runner.stores[0]
        rows = np.zeros((B, 5), dtype=np.int64)
        rows[:, INDEX] = np.arange(B)
        rows[:, CONTENT] = 1000 + np.arange(B)
        store.write(np.arange(B) + 2 * B, rows)  # block 2
        runner._copy_block(BlockCopy(0, 2, 3, tokens))
        copied = store.read(np.arange(B) + 3 * B)
        # the rank holds the positions p < tokens with (p // I) % W == rank: their count
        held = sum((p // I) % W == rank for p in range(tokens))
        assert (copied[:held, CONTENT] == 1000 + np.arange(held)).all()
        assert (copied[held:, CONTENT] == -1).all()


@pytest.mark.parametrize("W", [2, 4])
def test_the_builtin_passes_and_the_stale_copy_fails_with_wrong_content(W):
    sc = builtin("prefix-partial-hit", W)
    assert run_fault(sc).passed
    report = run_fault(sc, "partial-hit-stale-cow")
    f = report.failure
    assert (f.kind, f.step, f.request_id) == (FailureKind.WRONG_CONTENT, 7, "doc-b"), report.text()
    # what doc-b's first block holds is hog's KV, copied from the block hog was handed
    assert any(h.writer == "hog" for h in f.holdings), report.text()


def test_a_missing_copy_is_caught_by_the_write_checks(monkeypatch):
    monkeypatch.setattr(ModelRunner, "_copy_block", lambda self, copy: None)
    report = run_fault(builtin("prefix-partial-hit", 2))
    f = report.failure
    assert (f.kind, f.request_id) == (FailureKind.WRONG_CONTENT, "doc-c"), report.text()
