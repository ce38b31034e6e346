"""The estimate of a run (``harness.budget``): its figures by hand, the refusal, ``force``,
the CPU warning, and every built-in fitting a 2-core 8 GiB CI machine."""

from __future__ import annotations

import dataclasses

import pytest

from dcpsim.errors import ConfigError
from dcpsim.harness import budget as bd
from dcpsim.scenarios.load import load_scenario
from dcpsim.scenarios.registry import builtin_scenario_names
from support.helpers import builtin, make_scenario, mla_spec, request_spec

GIB = 2**30


def tiny(W=2, **kw):
    """One sharded MLA group (B = 16) and two requests of 100 + 10 tokens."""
    return make_scenario({"l0": mla_spec(16)}, [request_spec("a", 100, 10), request_spec("b", 100, 10)], W=W, **kw)


def test_the_figures_follow_the_pools_and_tables_the_worker_allocates():
    s = tiny(W=2)
    b = bd.estimate(s)
    # every request fits at once: cdiv(110, 16 * 2) = 4 blocks each, 8 in the pool (+ the null block)
    assert b.pool_blocks == 8
    assert b.store_bytes == 9 * 16 * bd.ENTRY_BYTES
    width = -(-s.config.max_model_len // 32)
    assert b.table_bytes == 2 * width * 8
    assert b.workload_tokens == 220
    assert b.ranks == 2 and b.processes == 3 and b.groups == 1
    assert b.total_bytes() == bd.PARENT_BYTES + b.parent_bytes + 2 * (bd.PROCESS_BYTES + b.rank_bytes)
    assert b.total_bytes(in_process=True) == bd.PARENT_BYTES + b.parent_bytes + 2 * b.rank_bytes


def test_the_attention_check_adds_its_vectors_to_the_stores():
    s = tiny(W=2)
    assert bd.estimate(s, attention_width=32).store_bytes == 9 * 16 * (bd.ENTRY_BYTES + 4 * 32)


def test_a_run_larger_than_the_memory_is_refused_with_its_figures_unless_forced():
    s = builtin("dsv3", 1000)
    with pytest.raises(ConfigError) as info:
        bd.check_budget(s, available=8 * GIB)
    message = str(info.value)
    assert "across 1000 ranks" in message and "the machine has 8.0 GiB available" in message
    assert "--force" in message
    need = float(message.split("~", 1)[1].split(" GiB", 1)[0])
    assert need == pytest.approx(bd.estimate(s).total_bytes() / GIB, rel=0.01) and need > 100
    assert bd.check_budget(s, available=8 * GIB, force=True).ranks == 1000


def test_local_ranks_count_only_this_machine():
    s = builtin("dsv3", 16)
    whole, local = bd.estimate(s), bd.estimate(s, local_ranks=4)
    assert local.total_bytes() < whole.total_bytes()
    assert local.total_bytes() == bd.PARENT_BYTES + local.parent_bytes + 4 * (bd.PROCESS_BYTES + local.rank_bytes)


def test_a_schedule_that_cannot_end_within_max_steps_is_refused_even_when_forced():
    s = make_scenario({"l0": mla_spec(16)}, [request_spec("a", 10_000, 10)], budget=64, max_len=20_000)
    assert bd.estimate(s).min_steps == -(-10_010 // 64)
    short = dataclasses.replace(s, max_steps=100)
    with pytest.raises(ConfigError, match=r"at least 157 steps .* more than max_steps = 100"):
        bd.check_budget(short, force=True)


def test_decodes_bound_the_steps_too():
    s = make_scenario({"l0": mla_spec(16)}, [request_spec("a", 10, 400, arrival_step=5)], k=3, budget=512)
    assert bd.estimate(s).min_steps == 5 + 100  # 400 output tokens, at most 1 + k = 4 a step


def test_huge_pools_and_tables_are_estimated_without_being_built():
    s = dataclasses.replace(tiny(W=2), kv_cache_tokens=9 * 10**18)
    b = bd.estimate(s)
    assert b.pool_blocks == 9 * 10**18 // 32
    with pytest.raises(ConfigError, match="KV stores"):
        bd.check_budget(s, available=8 * GIB)
    with pytest.raises(ConfigError, match="scheduler alone needs"):
        bd.check_scheduler_fits(s, available=8 * GIB)


@pytest.mark.parametrize("name", builtin_scenario_names())
def test_every_builtin_fits_a_ci_machine_at_eight_ranks_with_attention(name):
    try:
        s = builtin(name, 8)
    except ConfigError as exc:  # a stated head layout admissible only at its own W (gqa-pcp2-heads): there
        assert "KV heads do not follow its queries" in str(exc), exc
        s = load_scenario(name)
    b = bd.check_budget(s, available=8 * GIB, attention_width=32)
    assert b.total_bytes() < 4 * GIB, bd.gib(b.total_bytes())


def test_more_ranks_than_cpus_is_one_warning_line():
    line = bd.cpu_warning(4, cpus=2)
    assert line.startswith("dcpsim: warning: 4 ranks on 2 CPUs") and "\n" not in line
    assert bd.cpu_warning(2, cpus=2) is None


def test_sizes_read_well():
    assert [bd.size(n) for n in (640, 12_800, 3 * 2**20, 80 * GIB)] == ["640 B", "12.5 KiB", "3.0 MiB", "80.0 GiB"]
    assert bd.gib(10**30).endswith("e+20")


def test_a_kv_cache_tokens_below_the_largest_request_says_which_pool_was_used():
    s = dataclasses.replace(tiny(W=2), kv_cache_tokens=1)
    note = bd.pool_note(s)
    assert "kv_cache_tokens = 1" in note and "4 blocks (128 tokens)" in note
    assert bd.pool_note(dataclasses.replace(tiny(W=2), kv_cache_tokens=4096)) is None


def test_a_pd_run_counts_both_instances_in_one_world_and_is_refused_with_their_figures():
    from dcpsim.scenarios.load import load_scenario
    from dcpsim.scenarios.pd import ROLES, instance_scenario

    pd = load_scenario("pd-dsv3")
    instances = {role: instance_scenario(pd, role) for role in ROLES}
    budgets = {role: bd.estimate(sc) for role, sc in instances.items()}
    need = bd.check_pd_budget(instances, available=64 * GIB)
    assert need == bd.PARENT_BYTES + sum(b.parent_bytes + b.ranks * (bd.PROCESS_BYTES + b.rank_bytes) for b in budgets.values())
    assert need < sum(b.total_bytes() for b in budgets.values()), "one parent, not one per instance"
    with pytest.raises(ConfigError) as info:
        bd.check_pd_budget(instances, available=need - 1)
    message = str(info.value)
    assert message.startswith("the P/D run needs ~") and "prefill: ~" in message and "decode: ~" in message
    assert "--force" in message
    assert bd.check_pd_budget(instances, available=need - 1, force=True) == need
