"""The longest prefix hit: the engine's default hit (``Engine.prefix_hit_tokens``, the EAGLE drop
included) against a brute force; the checker's ``prefix-hit-short`` judgement: the built-ins with
prefix hits pass under the reference, a hybrid lookup whose EAGLE margin is one page (vllm-ascend
0.23.0.post1's, ``eagle-margin-unscaled``) and an engine that never hits both fail naming the
request and both lengths."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcpsim.engine.reference import ReferenceEngine
from support.helpers import builtin, geometries, run


def brute_force_hit(cached, spans, limit, eagle):
    """The largest multiple of the spans' LCM that every group's run covers, each run first capped
    at the limit in whole blocks and, with an EAGLE drafter, less its last block."""
    unit = math.lcm(*spans)
    best = 0
    for hit in range(0, limit + 1, unit):
        ok = True
        for n, span in zip(cached, spans):
            blocks = min(n, limit // span)
            if eagle and blocks:
                blocks -= 1
            ok &= hit <= blocks * span
        if ok:
            best = hit
    return best


@given(st.data(), st.booleans())
def test_the_default_hit_is_the_longest_the_semantics_allow(data, eagle):
    sc = builtin("prefix-ragged-spans", data.draw(st.sampled_from([1, 2, 4])))
    groups = geometries(sc)
    spans = [g.manager_block_size for g in groups]
    limit = data.draw(st.integers(0, 3000))
    cached = [data.draw(st.integers(0, limit // s)) for s in spans]  # the caller's runs stop at the limit
    assert ReferenceEngine().prefix_hit_tokens(groups, cached, limit, eagle) == brute_force_hit(cached, spans, limit, eagle)


@pytest.mark.parametrize(
    "W, reference, faulty", [(4, 576, 512), (2, 608, 576)], ids=["W4", "W2"]
)  # fmt: skip
def test_a_hybrid_eagle_margin_of_one_page_loses_a_block(W, reference, faulty):
    sc = builtin("eagle-hybrid-hit", W)
    ref = run(sc)
    assert ref.passed and ref.schedule["prefix_hit_tokens"] == reference, ref.text()
    report = run(sc, inject="eagle-margin-unscaled")
    assert not report.passed and report.failure.kind == "prefix-hit-short", report.text()
    assert report.failure.step == 6 and report.failure.request_id == "reader"
    assert f"a prefix-cache hit of {faulty} tokens where the cache allows {reference}" in report.text(), report.text()
    assert "each group's cached run: 640, 640 tokens, less its last block for the EAGLE drafter" in report.text()


def test_at_one_rank_the_page_is_the_block_and_the_margin_is_right():
    report = run(builtin("eagle-hybrid-hit", 1), inject="eagle-margin-unscaled")
    assert report.passed and report.schedule["prefix_hit_tokens"] == 624, report.text()


def test_without_the_eagle_drafter_the_whole_run_is_hit():
    sc = builtin("eagle-hybrid-hit", 4)
    report = run(dataclasses.replace(sc, config=dataclasses.replace(sc.config, speculative_method="ngram")))
    assert report.passed and report.schedule["prefix_hit_tokens"] == 640, report.text()


class NeverHits(ReferenceEngine):
    """An engine whose lookups find nothing: every hit is lost."""

    def prefix_hit_tokens(self, geometries, cached_blocks, limit, eagle):
        return 0


@pytest.mark.parametrize("name, W", [("prefix-sharing", 2), ("llama-draft", 2), ("prefix-ragged-spans", 4), ("prefix-preemption", 2)])
def test_an_engine_that_never_hits_is_caught(name, W):
    sc = builtin(name, W)
    assert run(sc).passed
    report = run(sc, engine=NeverHits())
    assert not report.passed and report.failure.kind == "prefix-hit-short", report.text()
    assert "a prefix-cache hit of 0 tokens where the cache allows" in report.text(), report.text()
