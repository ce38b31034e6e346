"""Bug class 47 (issue 30, local-inference-lab/vllm#466): the EAGLE last-block drop belongs to the
EAGLE groups only, the groups holding a layer of the drafter (every group when none does, vLLM's
fallback). The rule in the reference engine (``Engine.prefix_hit_tokens`` with one flag per group,
from ``model.prefix_hit.eagle_groups``) and, independently, in the checker's longest-hit judge
(``verify.prefix_hit``), whose runs are counted in whole blocks before the drop (rounded to hit
units first they would expect the short hit and hide the bug); the fault that drops in every group
(``eagle-drop-every-group``) caught on ``eagle-draft-hit`` by ``selftest``, in process and on gloo."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcpsim.cli import main
from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.prefix_hit import eagle_groups
from dcpsim.verify.geometry import expected_groups
from dcpsim.verify.prefix_hit import PrefixHitJudge
from support.helpers import builtin, geometries, run, scheduler

FAULT = "eagle-drop-every-group"
CASES = [("eagle-draft-hit", 4), ("eagle-hybrid-hit", 4), ("llama-draft", 2)]


def test_the_eagle_groups_are_the_drafters_or_every_group_when_none_is():
    assert eagle_groups([False, True], True) == (False, True)
    assert eagle_groups([True, False, True], True) == (True, False, True)
    assert eagle_groups([False, False], True) == (True, True)  # vLLM's fallback: the drafter's layers unknown
    assert eagle_groups([False, True], False) == (False, False)  # no EAGLE-style drafter: no drop at all


@pytest.mark.parametrize(
    "name, W, want",
    [("eagle-draft-hit", 4, (False, True)), ("eagle-hybrid-hit", 4, (True, True)), ("llama-draft", 2, (False, False))],
)  # fmt: skip
def test_the_scheduler_and_the_judge_each_find_the_eagle_groups(name, W, want):
    sc = builtin(name, W)
    assert scheduler(sc).prefix_cache.eagle == want  # the engine's side
    assert PrefixHitJudge(0, expected_groups(sc), sc.config.eagle_drop, {}).eagle == want  # the checker's, its own


def test_the_reference_drops_only_in_the_eagle_group():
    """eagle-draft-hit at W = 4, a 680-token prompt (limit 679): the target (span 64) caches 10 blocks,
    the draft group (span 16) 42; only the draft group gives up one."""
    groups = geometries(builtin("eagle-draft-hit", 4))
    assert [g.manager_block_size for g in groups] == [64, 16] and [g.draft for g in groups] == [False, True]
    ref = ReferenceEngine()
    assert ref.prefix_hit_tokens(groups, [10, 42], 679, (False, True)) == 640
    assert ref.prefix_hit_tokens(groups, [10, 42], 679, (True, True)) == 576  # the drop in every group
    assert ref.prefix_hit_tokens(groups, [10, 42], 679, True) == 576  # one bool: every group
    assert ref.prefix_hit_tokens(groups, [10, 42], 679, (False, False)) == 640
    assert FAULTS[FAULT].prefix_hit_tokens(groups, [10, 42], 679, (False, True)) == 576
    assert FAULTS[FAULT].prefix_hit_tokens(groups, [10, 42], 679, (False, False)) == 640  # no drafter, no drop


def _judge_with_document(name: str, W: int, cached: int) -> tuple[PrefixHitJudge, np.ndarray]:
    """A judge whose cache holds every block of the first ``cached`` tokens of a prompt (whole units),
    in every group, and the prompt's fingerprints."""
    sc = builtin(name, W)
    judge = PrefixHitJudge(0, expected_groups(sc), sc.config.eagle_drop, {})
    fingerprints = np.arange(1, 1001, dtype=np.int64) * 7919
    block = 1
    for g, span in enumerate(judge.spans):
        for k in range(cached // span):
            judge.hold(block, g, judge.key(fingerprints, g, k))
            block += 1
    return judge, fingerprints


def test_the_judge_counts_whole_blocks_and_drops_only_in_the_eagle_group():
    judge, fingerprints = _judge_with_document("eagle-draft-hit", 4, 704)  # 11 units of 64 cached
    assert judge.longest_hit(fingerprints, 679) == (640, (640, 672))  # rounded first: (640, 640) and 576
    judge.eagle = (True, True)  # the rule of dropping in every group expects the short hit
    assert judge.longest_hit(fingerprints, 679) == (576, (640, 672))


def test_the_judge_keeps_the_every_group_drop_without_draft_layers():
    judge, fingerprints = _judge_with_document("eagle-hybrid-hit", 4, 640)
    assert judge.eagle == (True, True) and judge.longest_hit(fingerprints, 699) == (576, (640, 640))


def test_the_judge_registers_only_whole_units():
    """A block whose holder has not committed its whole unit is not findable (the engine registers
    units): after step 2 "warm" has committed 700 tokens, 10 units and 60 tokens of the 11th, and the
    draft group's blocks 40-42 (whole blocks of 16 inside that unit) stay out of the holds until the
    unit is complete."""
    sc = builtin("eagle-draft-hit", 4)
    judge = PrefixHitJudge(0, expected_groups(sc), sc.config.eagle_drop, {})
    seen = []
    for plan in scheduler(sc).plans():
        judge.judge(plan)
        warm = next((v for v in plan.views if v.request_id == "warm"), None)
        if warm is None:
            continue
        held = judge.held_keys(1)
        inside = {judge.key(warm.fingerprints, 1, k) for k in range(40, 43)}
        seen.append((warm.num_committed, inside <= held, bool(inside & held)))
    assert (700, False, False) in seen, seen  # committed whole, but their unit is not
    assert all(whole == (n >= 704) and any_ == whole for n, whole, any_ in seen), seen


def test_the_built_in_passes_and_the_drop_in_every_group_is_caught():
    sc = builtin("eagle-draft-hit", 4)
    ref = run(sc)
    assert ref.passed and ref.schedule["prefix_hit_tokens"] == 640, ref.text()
    bad = run(sc, inject=FAULT)
    assert not bad.passed and bad.failure.kind == "prefix-hit-short", bad.text()
    assert bad.failure.step == 6 and bad.failure.request_id == "reader"
    assert "a prefix-cache hit of 576 tokens where the cache allows 640" in bad.text(), bad.text()
    assert "each group's cached run: 640, 672 tokens, less its last block in the EAGLE groups (group 1" in bad.text()


@pytest.mark.parametrize("W, hit", [(1, 656), (2, 640), (8, 512)])
def test_where_the_draft_group_caches_nothing_past_the_target_both_rules_agree(W, hit):
    sc = builtin("eagle-draft-hit", W)
    for engine in (None, FAULTS[FAULT]):
        report = run(sc, engine=engine)
        assert report.passed and report.schedule["prefix_hit_tokens"] == hit, report.text()


def test_the_fault_applies_beside_a_draft_group_with_an_eagle_drafter_only():
    fault = FAULTS[FAULT]
    applies = {name: fault.applies_to_scenario(builtin(name, W), geometries(builtin(name, W))) for name, W in CASES}
    assert applies == {"eagle-draft-hit": True, "eagle-hybrid-hit": False, "llama-draft": False}  # no draft layer; ngram


@pytest.mark.slow
@pytest.mark.parametrize("world", ["in-process", "gloo"])
def test_selftest_catches_the_drop_in_every_group(capsys, world):
    argv = ["selftest", "--fault", FAULT, "--json", "--timeout", "60"] + (["--in-process"] if world == "in-process" else [])
    code = main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc["summary"]
    rows = [r for r in doc["rows"] if r["fault"] == FAULT]
    assert [(r["scenario"], r["outcome"], r["kind"]) for r in rows] == [("eagle-draft-hit", "detected", "prefix-hit-short")], rows
    assert rows[0]["report"].startswith("FAIL at step 6: 1 prefix-cache hit(s) shorter than the cache allows")
    base = [r for r in doc["rows"] if r["fault"] != FAULT]
    assert base and all(r["outcome"] == "pass" for r in base), base
