"""The rules of known backends an interleave size breaks, each with its source."""

from __future__ import annotations

from dcpsim.views.backend_rules import RULES, broken_rules, layout_context
from support.helpers import builtin, make_scenario, mla_spec, request_spec


def ids(sc):
    return [r["id"] for r in broken_rules(layout_context(sc))]


def test_every_rule_names_its_source():
    assert len({r.id for r in RULES}) == len(RULES)
    for rule in RULES:
        assert rule.kind in ("rejected", "backend", "performance")
        assert "docs/dcp-semantics.md" in rule.source or "vllm/" in rule.source, rule.id


def test_interleave_1_breaks_nothing_on_a_plain_mla_model():
    assert ids(builtin("dsv3", 4, 1)) == []


def test_speculative_decoding_with_interleave_above_1():
    got = ids(builtin("dsv3", 4, 8))
    assert got == ["mtp-needs-interleave-support", "flashinfer-mla-needs-interleave-1", "spec-steps-not-batched-as-decodes"]
    # without drafts only the FlashInfer MLA rule is left; on plain full attention only the MTP rule
    no_drafts = make_scenario({"mla": mla_spec(16)}, [request_spec("a", 10, 5)], W=4, I=8, k=0)
    assert ids(no_drafts) == ["flashinfer-mla-needs-interleave-1"]
    assert ids(builtin("llama-gqa", 4, 8)) == ["mtp-needs-interleave-support"]


def test_an_interleave_above_the_block_names_the_group():
    (rule,) = [r for r in broken_rules(layout_context(builtin("dsv3", 4, 128))) if r["id"] == "interleave-divides-block"]
    assert rule["kind"] == "rejected" and rule["where"] == ["MLAAttention[model.layers.0.self_attn.mla_attn+60]: 64 tokens per page"]


def test_compressed_groups_and_the_indexer_rule():
    assert "indexer-interleave-multiple-of-R" in ids(builtin("dsv41-hybrid", 4, 1))
    assert "indexer-interleave-multiple-of-R" not in ids(builtin("dsv41-hybrid", 4, 2))


def test_nothing_is_broken_without_dcp():
    assert ids(builtin("dsv3", 1, 8)) == []
