"""Admission faults: the longest request the engine admits (``Engine.max_admissible_tokens``).

A plain engine fault, not a P/D one (``faults.pd``): the report (sglang#39731) is on a P/D decode
instance admitting a request whose KV the connector loads, but the rule it breaks is admission's,
whatever the tokens' origin. dcpsim's scheduler applies the decision to every admission, a P/D
decode instance's included, so the fault runs in every run where it applies and the checker
judges it in every run (``verify.admission``).
"""

from __future__ import annotations

from dcpsim.engine.faults.base import Fault, has_sharded_attention
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Retention, Storage


class AdmissionLimitPerRankRows(Fault):
    name = "admission-limit-per-rank-rows"
    bug_class = "53. a request's logical tokens counted against one rank's KV rows at admission (sglang#39731)"
    description = (
        "the longest request the engine admits is one rank's rows (a sharded group's blocks times B, not B*W): "
        "a request longer than one rank's share of the pool but within the DCP group's is refused "
        "(sglang#39731: a 1M-token request against 690,240 rows while DCP8 holds 5.52M)"
    )
    layouts = ("vllm",)
    """Helix's rows keep a spare entry; the checker does not judge its admission."""
    configs = ({"decode_context_parallel_size": 2},)

    def max_admissible_tokens(self, geometries, pool_sizes):
        limits = [
            n * g.block_size  # one rank's rows (B tokens a block), not times W
            for g, n in zip(geometries, pool_sizes)
            if g.retention is Retention.FULL and g.storage in (Storage.PAGED, Storage.RECORDS)
        ]
        return min(limits, default=None)

    def applies_to_scenario(self, scenario, geometries) -> bool:
        """Some request of the scenario is longer than one rank's rows but within the pools."""
        from dcpsim.engine.scheduler.scheduler import pool_sizes  # the scheduler imports the interface

        if not has_sharded_attention(geometries):
            return False
        reference = ReferenceEngine()
        sizes = pool_sizes(scenario, reference, geometries)
        right, wrong = reference.max_admissible_tokens(geometries, sizes), self.max_admissible_tokens(geometries, sizes)
        k = scenario.config.num_speculative_tokens
        lengths = [r.prompt_len + r.output_len + k for r in scenario.requests]
        return wrong is not None and any(wrong < n and (right is None or n <= right) for n in lengths)
