"""Two schedules ``fuzz --seed 5`` found where the reference engine and the longest-hit judge
disagreed, both about a prefix two requests computed: the reference kept one block a key (vLLM keeps
every block computing it, so handing one out leaves the key findable), and the judge counted a
block that was handed out fresh and rewritten with the same content as still cached (vLLM evicts
it on allocation). Each must pass; the judge must still catch a lost hit in the same schedule."""

from __future__ import annotations

import pytest

from dcpsim.engine.faults.base import Fault
from dcpsim.model.config import SimConfig
from dcpsim.model.scenario import RequestSpec, Scenario
from dcpsim.model.specs import FullAttentionSpec
from support.helpers import run


def _scenario(W: int, prefix: int, pool: int, prompts: list[tuple[int, int]]) -> Scenario:
    """Requests ``(prompt_len, arrival_step)``, each sharing the first ``prefix`` tokens (but a
    one-token request), one output token each."""
    requests = tuple(
        RequestSpec(
            request_id=f"r{j}",
            prompt_len=p,
            output_len=1,
            arrival_step=a,
            prefix="shared" if p > 1 else None,
            shared_prefix_len=min(p, prefix) if p > 1 else 0,
        )
        for j, (p, a) in enumerate(prompts)
    )
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16)
    config = SimConfig(
        max_model_len=max(p for p, _ in prompts) + 2,
        max_num_batched_tokens=4,
        decode_context_parallel_size=W,
        enable_prefix_caching=True,
    )
    layers = {"attn.0": full, "attn.1": full}
    return Scenario(name="fuzz-seed5", description="", source="test", layers=layers, config=config, requests=requests, kv_cache_tokens=pool)


CASES = {
    # W = 1: r0 and r3 both compute block 0 of the prefix; r0's is handed out, r3's still holds it
    "duplicate-block": _scenario(1, 4, 9, [(5, 0), (1, 0), (1, 1), (4, 0), (5, 7)]),
    # W = 4: r2 gets r0's second block fresh (its hit is one unit) and rewrites it; r3 is admitted
    # in the step that completes it: not yet findable
    "rewritten-block": _scenario(4, 32, 34, [(33, 0), (1, 0), (32, 0), (33, 7)]),
}


@pytest.mark.parametrize("name", CASES)
def test_the_reference_takes_the_hit_the_judge_allows(name):
    report = run(CASES[name])
    assert report.passed, report.text()
    assert report.schedule["finished"] == len(CASES[name].requests)


class NoHits(Fault):
    name = "no-hits"

    def prefix_hit_tokens(self, geometries, cached_blocks, limit, eagle):
        return 0


def test_a_lost_hit_in_the_duplicate_block_schedule_is_still_caught():
    report = run(CASES["duplicate-block"], engine=NoHits())
    assert not report.passed and report.failure.kind == "prefix-hit-short", report.text()
    assert "a prefix-cache hit of 0 tokens where the cache allows 4" in report.text()
