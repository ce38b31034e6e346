"""``dcpsim.plural``: one noun for one, the plural otherwise, in every counted message."""

from __future__ import annotations

from dcpsim.plural import plural
from dcpsim.verify.report import RunReport


def test_plural_is_singular_only_for_one():
    assert plural(1, "request") == "1 request"
    assert [plural(n, "preemption") for n in (0, 2)] == ["0 preemptions", "2 preemptions"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"


def _report(**fields) -> RunReport:
    return RunReport(scenario="s", source="s.toml", dcp_size=1, interleave_size=1, kernel_block_size=None,
                     groups=[dict(name="g", layers=1, storage="paged", block_size=16, states_per_page=16,
                                  sharded=True, manager_block_size=1)], **fields)


def test_report_text_counts_one_of_a_kind_in_the_singular():
    text = _report(schedule=dict(steps=1, requests=1, finished=1, preemptions=1, prefix_hit_tokens=1,
                                 reused_blocks=1), verifications=1, verified_indices=1, bytes_gathered=1).text()
    for wrong in ("1 layers", "1 tokens", "1 steps", "1 requests", "1 preemptions", "1 prefix-hit tokens",
                  "1 reused blocks", "1 checks", "1 indices", "1 bytes"):
        assert wrong not in text, (wrong, text)
    assert "1 step, 1 request, 1 finished, 1 preemption, 1 prefix-hit token, 1 reused block" in text
    assert "verified: 1 check, 1 index, 1 byte gathered" in text
    assert "group g: 1 layer, paged" in text and "manager block 1 token" in text
    many = _report(schedule=dict(steps=2, requests=3, preemptions=0)).text()
    assert "2 steps, 3 requests, 0 finished, 0 preemptions" in many
