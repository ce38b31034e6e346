"""The checker's ``blocks held`` counts the drafter's lookahead (semantics section 5): with an
EAGLE / MTP drafter a request holds the entries of its step's tokens plus ``k`` slots, never past
``max_model_len``; with ngram, of its tokens only. A scheduler that leaves the lookahead out (as
vLLM does not), or reserves it for a drafter without KV, fails ``attention-metadata`` at the first
step whose lookahead crosses an entry boundary."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

import dcpsim.engine.scheduler.scheduler as scheduler_module
from dcpsim.model.kinds import Storage
from support.helpers import builtin, run


@contextlib.contextmanager
def slots_rule(rule):
    """Every scheduler built inside allocates ``rule(geometry, config, num_tokens)`` slots a step."""
    kept = scheduler_module.lookahead_slots
    scheduler_module.lookahead_slots = rule
    try:
        yield
    finally:
        scheduler_module.lookahead_slots = kept


def no_lookahead(geometry, config, num_tokens):
    return num_tokens


def lookahead_for_any_drafter(geometry, config, num_tokens):
    if geometry.storage is Storage.STATE:
        return num_tokens
    return min(num_tokens + config.num_speculative_tokens, config.max_model_len)


def with_method(sc, method):
    return dataclasses.replace(sc, config=dataclasses.replace(sc.config, speculative_method=method))


@pytest.mark.parametrize(
    "name,short",
    [
        ("eagle-hybrid-hit", "blocks held is 8, expected 9 (cdiv(512 + 2 lookahead, 64))"),  # a first chunk of 512 at B*W = 64
        ("eagle-draft-hit", "blocks held is 16, expected 17 (cdiv(256 + 2 lookahead, 16))"),  # the replicated draft group, B = 16
    ],
)
def test_eagle_rows_without_the_lookahead_are_short(name, short):
    sc = builtin(name, 4)
    assert run(sc).passed
    with slots_rule(no_lookahead):
        report = run(sc)
    assert not report.passed and report.failure.kind == "attention-metadata", report.text()
    assert report.failure.step == 0
    assert any(short in d for d in report.failure.details), report.failure.details


def test_an_ngram_drafter_holds_no_lookahead():
    sc = with_method(builtin("eagle-hybrid-hit", 4), "ngram")
    assert run(sc).passed
    with slots_rule(lookahead_for_any_drafter):
        report = run(sc)
    assert not report.passed and report.failure.kind == "attention-metadata", report.text()
    assert any("blocks held is 9, expected 8 (cdiv(512, 64))" in d for d in report.failure.details), report.failure.details
