"""The text of a run report: counted nouns, and a PASS line that says what was verified."""

from __future__ import annotations

from dcpsim.verify.report import RunReport


def _report(**fields) -> RunReport:
    return RunReport(
        scenario="s",
        source="s.toml",
        dcp_size=1,
        interleave_size=1,
        kernel_block_size=None,
        groups=[dict(name="g", layers=1, storage="paged", block_size=16, states_per_page=16, sharded=True, manager_block_size=1)],
        **fields,
    )


def test_report_text_counts_one_of_a_kind_in_the_singular():
    text = _report(
        schedule=dict(steps=1, requests=1, finished=1, preemptions=1, prefix_hit_tokens=1, reused_blocks=1),
        verifications=1,
        verified_indices=1,
        bytes_gathered=1,
    ).text()
    for wrong in (
        "1 layers",
        "1 tokens",
        "1 steps",
        "1 requests",
        "1 preemptions",
        "1 prefix-hit tokens",
        "1 reused blocks",
        "1 checks",
        "1 indices",
        "1 bytes",
    ):
        assert wrong not in text, (wrong, text)
    assert "1 step, 1 request, 1 finished, 1 preemption, 1 prefix-hit token, 1 reused block" in text
    assert "verified: 1 check, 1 index, 1 byte gathered" in text
    assert "group g: 1 layer, paged" in text and "manager block 1 token" in text
    many = _report(schedule=dict(steps=2, requests=3, preemptions=0)).text()
    assert "2 steps, 3 requests, 0 finished, 0 preemptions" in many


def test_the_pass_line_says_what_was_verified():
    writes_only = _report().text().splitlines()[-1]
    assert writes_only.startswith("PASS: writes verified: ") and "attention" not in writes_only
    attention = dict(heads=8, head_dim=16, value_dim=16, tolerance=1e-4, lse_base="e")
    both = _report(attention=attention, attention_checks=138).text().splitlines()[-1]
    assert both.startswith("PASS: writes and attention verified: ")
    assert both.endswith("and 138 attention checks matched the full-context reference")
    one = _report(attention=attention, attention_checks=1).text().splitlines()[-1]
    assert one.endswith("and 1 attention check matched the full-context reference")
