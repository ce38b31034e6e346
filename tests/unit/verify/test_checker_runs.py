"""The checker on correct runs, end to end in one process (ranks as threads).

The built-in scenarios must pass under many DCP configurations with the reference engine,
every index must be verified exactly once over the shards, ``verify_every`` must thin the
verifications, and ``paranoid`` must really gather the raw read views.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from dcpsim.model.scenario import ScenarioOverrides
from support.helpers import builtin, geometries, run

CONFIGS = [(1, 1), (2, 1), (2, 8), (3, 1), (3, 64), (4, 1), (4, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("W,I", CONFIGS, ids=[f"W{w}-I{i}" for w, i in CONFIGS])
@pytest.mark.parametrize("name", ["dsv3", "dsv41-hybrid"])
def test_builtin_scenarios_pass(name, W, I):
    sc = builtin(name, W, I)
    rep = run(sc)
    assert rep.passed and rep.failure is None, "\n".join(rep.failure.lines())
    assert rep.verified_indices > 0
    assert rep.verifications == rep.steps  # verify_every = 1
    assert rep.schedule["finished"] == len(sc.requests)
    assert "PASS" in rep.text()
    json.loads(rep.to_json())


@pytest.mark.parametrize(
    "name,ov",
    [
        ("dsv3", dict(kernel_block_size=16)),
        ("dsv41-hybrid", dict(kernel_block_size=32)),
        ("dsv3", dict(block_size=32)),
        ("dsv41-hybrid", dict(block_size=16, cp_kv_cache_interleave_size=4)),
    ],
)
def test_builtin_scenarios_pass_other_geometry(name, ov):
    ov = dict(ov)
    I = ov.pop("cp_kv_cache_interleave_size", 2)
    rep = run(builtin(name, 2, I, **ov))
    assert rep.passed, "\n".join(rep.failure.lines())


def test_sharded_verification_counts_every_index_once():
    # With pools that hold every request (no W-dependent pressure) and no prefix caching, W=1 and
    # W=2 run the same schedule; the two shards of W=2 verify exactly the indices W=1 verifies.
    base = builtin("dsv3", 1)
    base = dataclasses.replace(base, kv_cache_tokens=None, config=dataclasses.replace(base.config, enable_prefix_caching=False))
    a = run(base)
    b = run(base.with_overrides(ScenarioOverrides(decode_context_parallel_size=2)))
    assert a.passed and b.passed
    # block reuse counts differ (pages of 64 vs 128 tokens); everything else is the same schedule
    assert {k: v for k, v in a.schedule.items() if k != "reused_blocks"} == {k: v for k, v in b.schedule.items() if k != "reused_blocks"}
    assert a.verified_indices == b.verified_indices > 0


def test_all_configs_listed_are_valid():
    # W*I combos used above must be valid for every group of both built-ins (B = 64 states)
    for (W, I), name in itertools.product(CONFIGS, ["dsv3", "dsv41-hybrid"]):
        geometries(builtin(name, W, I))


def test_verify_every_checks_fewer_steps_and_the_last():
    sc = builtin("dsv3", 2, 1, verify_every=7)
    rep = run(sc, verify="full")
    assert rep.passed
    expected = {s for s in range(rep.steps) if s % 7 == 0} | {rep.steps - 1}
    assert rep.verifications == rep.full_sweeps == len(expected)
    # incremental: also the step each request finishes at (its full sweep), at most one a request
    inc = run(sc)
    assert inc.passed and inc.verify_mode == "incremental"
    assert len(expected) < inc.verifications <= len(expected) + len(sc.requests)


@pytest.mark.parametrize("name,W,I", [("dsv3", 3, 4), ("dsv41-hybrid", 2, 8)])
def test_paranoid_passes(name, W, I):
    rep = run(builtin(name, W, I), paranoid=True)
    assert rep.passed and rep.verified_indices > 0
    plain = run(builtin(name, W, I))
    assert rep.bytes_gathered > plain.bytes_gathered  # it really gathered the raw views
