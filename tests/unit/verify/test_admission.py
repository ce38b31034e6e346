"""The admission check (``verify.admission``): a request's logical tokens count once against the
logical capacity (per-rank rows x W for a DCP-sharded group, x 1 for a replicated one; the tightest
group decides), judged against the engine's ``max_admissible_tokens`` before the first step.
Every number below is computed by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.engine.scheduler.scheduler import pool_sizes
from dcpsim.errors import ConfigError
from dcpsim.model.kinds import Retention, Storage
from dcpsim.verify.admission import judge_admission, logical_capacity
from dcpsim.verify.geometry import ExpectedGroup, expected_groups
from support.helpers import builtin, builtin_names_at, expected_group, geometries, make_scenario, mla_spec, request_spec, run, scheduler

FAULT = "admission-limit-per-rank-rows"


def group(name="g", *, W=8, B=64, **fields) -> ExpectedGroup:
    return expected_group(name, W=W, B=B, **fields)


def scenario(*lengths, k=0):
    """Requests ``r0, r1, ...`` of ``lengths[i]`` tokens (prompt = length - 1, output 1)."""
    requests = [SimpleNamespace(request_id=f"r{i}", prompt_len=n - 1, output_len=1) for i, n in enumerate(lengths)]
    return SimpleNamespace(requests=requests, config=SimpleNamespace(num_speculative_tokens=k))


# --- the arithmetic -------------------------------------------------------------------------


def test_sglang_39731_numbers_dcp8():
    # 10,785 blocks of 64 rows: 690,240 rows per rank; x 8 = 5,521,920 logical tokens
    cap = logical_capacity([group(W=8, B=64)], [10_785])
    assert (cap.rows, cap.shards, cap.tokens) == (690_240, 8, 5_521_920)
    one_million = scenario(1_000_000)
    f = judge_admission([group(W=8, B=64)], [10_785], one_million, 690_240, rank=3)
    assert f is not None and f.kind == "admission" and f.request_id == "r0"
    for words in ("rank 3", "request r0 of 1000000 tokens", "at most 690240", "5521920 logical tokens", "690240 rows per rank x W = 8"):
        assert words in f.message, f.message
    assert any("x W for a DCP-sharded group, x 1 for a dcp_replicated one" in d for d in f.details)
    assert judge_admission([group(W=8, B=64)], [10_785], one_million, 5_521_920, rank=3) is None


def test_a_request_at_the_capacity_is_held_one_past_it_is_not_judged_as_refused():
    # W = 8, B = 16, 100 blocks: 1,600 rows per rank, 12,800 tokens
    g = [group(W=8, B=16)]
    assert judge_admission(g, [100], scenario(12_800), 12_800, 0) is None
    f = judge_admission(g, [100], scenario(12_800), 12_799, 0)
    assert f is not None and "of 12800 tokens refused" in f.message
    # a request of 12,801 tokens the pool does not hold: refusing it is right
    assert judge_admission(g, [100], scenario(12_801), 12_800, 0) is None


def test_replicated_group_counts_its_rows_once():
    # replicated at W = 4: 50 blocks of 16 = 800 rows, x 1 = 800 tokens
    g = [group(sharded=False, W=4, B=16)]
    assert logical_capacity(g, [50]).tokens == 800
    assert judge_admission(g, [50], scenario(800), 800, 0) is None
    f = judge_admission(g, [50], scenario(700), 3_200, 0)  # the limit multiplied by W again
    assert f is not None and f.request_id is None
    assert "at most 3200 tokens" in f.message and "800 logical tokens" in f.message and "x 1 (replicated)" in f.message
    assert "a request of 801 tokens would be admitted" in f.message


def test_tightest_group_decides():
    # sharded W = 2: 100 blocks of 16 -> 1,600 rows x 2 = 3,200; replicated: 150 x 16 = 2,400
    g = [group("s", W=2, B=16), group("r", sharded=False, W=2, B=16)]
    cap = logical_capacity(g, [100, 150])
    assert (cap.name, cap.tokens) == ("r", 2_400)
    assert judge_admission(g, [100, 150], scenario(2_400), 2_400, 0) is None
    assert judge_admission(g, [100, 150], scenario(2_000), 3_200, 0).group == "r"  # admits past the replicated pool


def test_compressed_records_count_r_tokens_a_row():
    # records of R = 4 tokens, pages of 64 tokens = 16 records; 10 blocks x 16 = 160 rows x 4 x W = 2 = 1,280
    cap = logical_capacity([group(W=2, B=64, R=4, storage=Storage.RECORDS)], [10])
    assert (cap.rows, cap.tokens_per_row, cap.tokens) == (160, 4, 1_280)


def test_groups_holding_a_bounded_share_do_not_bound_the_length():
    window = group("w", sharded=False, W=2, B=16, retention=Retention.WINDOW)
    state = group("m", sharded=False, W=2, B=2048, storage=Storage.STATE, retention=Retention.STATE)
    assert logical_capacity([window, state], [1, 1]) is None
    assert judge_admission([window, state], [1, 1], scenario(50_000), None, 0) is None
    f = judge_admission([window, state], [1, 1], scenario(50_000), 40_000, 0)  # refuses what no pool bounds
    assert f is not None and "no group bounds a request's length" in f.message


def test_no_limit_over_a_bounded_pool_would_admit_what_it_cannot_hold():
    f = judge_admission([group(W=2, B=16)], [4], scenario(100), None, 0)  # 4 x 16 x 2 = 128
    assert f is not None and "admits any length" in f.message and "a request of 129 tokens" in f.message


def test_drafts_count_as_tokens_and_every_refused_request_is_counted():
    f = judge_admission([group(W=2, B=16)], [4], scenario(60, 100, 125, k=3), 64, 0)  # 63, 103, 128 tokens
    assert f.request_id == "r1" and "of 103 tokens" in f.message and "1 more request refused alike" in f.message
    assert "103 = prompt 99 + output 1 + 3 drafts" in f.details


def test_helix_is_not_judged():
    assert judge_admission([group(W=2, B=16, helix=True)], [4], scenario(100), 1, 0) is None


# --- the engine's decision, the scheduler, the run ---------------------------------------------


@pytest.mark.parametrize("W", [2, 8])
def test_the_reference_decision_is_the_checkers_capacity_on_every_builtin(W):
    engine = ReferenceEngine()
    for name in builtin_names_at(W):
        sc = builtin(name, W)
        geos = geometries(sc)
        sizes = pool_sizes(sc, engine, geos)
        cap = logical_capacity(expected_groups(sc), sizes)
        assert engine.max_admissible_tokens(geos, sizes) == (cap and cap.tokens), name


def test_the_fault_counts_one_ranks_rows():
    sc = builtin("llama4-scout", 8)
    geos = geometries(sc)
    sizes = pool_sizes(sc, ReferenceEngine(), geos)
    right = ReferenceEngine().max_admissible_tokens(geos, sizes)
    assert FAULTS[FAULT].max_admissible_tokens(geos, sizes) * 8 == right


def long_and_short(W=2):
    # one sharded MLA group, B = 16, a 40-block pool: 640 rows per rank, 1,280 tokens at W = 2
    return make_scenario([("mla", mla_spec())], [request_spec("long", 1000, 4), request_spec("short", 20, 4)], W=W, num_gpu_blocks=40)


class Limit(ReferenceEngine):
    def __init__(self, limit):
        self.limit = limit

    def max_admissible_tokens(self, geometries, pool_sizes):
        return self.limit


def test_the_scheduler_never_admits_past_the_decision():
    s = scheduler(long_and_short(), Limit(1004))
    assert (s.admission_decided, s.admission_limit) == (True, 1004)
    admitted = [e.request_id for plan in s.plans() for e in plan.events if e.kind.name == "ADMITTED"]
    assert admitted == ["long", "short"]
    with pytest.raises(ConfigError, match="its 1004 tokens exceed the 1003 the engine admits"):
        list(scheduler(long_and_short(), Limit(1003)).plans())


def test_an_engine_without_the_decision_is_not_judged():
    class Without(ReferenceEngine):
        def max_admissible_tokens(self, geometries, pool_sizes):
            raise NotImplementedError

    s = scheduler(long_and_short(), Without())
    assert not s.admission_decided and s.admission_limit is None
    assert run(long_and_short(), engine=Without()).passed


def test_a_run_reports_the_refusal_before_the_first_step():
    assert run(long_and_short()).passed
    f = run(long_and_short(), inject=FAULT).failure
    assert f.kind == "admission" and f.step == 0 and f.request_id == "long"
    assert "of 1004 tokens refused" in f.message and "at most 640 tokens" in f.message and "1280 logical tokens" in f.message
