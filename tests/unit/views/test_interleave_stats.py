"""How an interleave size spreads a schedule over the ranks: hand-made schedules whose
figures follow from semantics section 2, and the trends on a built-in."""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.campaigns.interleave import interleave_stats
from dcpsim.engine.serial_ranks import SerialRanks
from dcpsim.model.layout import local_seq_lens
from dcpsim.model.plan import WriteRecord
from dcpsim.views.interleave import write_runs
from support.helpers import builtin, make_scenario, mla_spec, request_spec


def stats(sc):
    ((_, result),) = interleave_stats(sc)
    return result


def decode_only(I, W=4, k=0, **kw):
    """One request of 16 positions written one token a step (prompt 1, output 16), B = 16."""
    return make_scenario({"mla": mla_spec(16)}, [request_spec("r", 1, 16, **kw)], W=W, I=I, k=k)


def test_interleave_1_deals_a_16_token_request_4_positions_to_each_of_4_ranks():
    s = stats(decode_only(1))
    assert s["stored"] == [4, 4, 4, 4] and s["empty_shards"] == [0, 0, 0, 0]
    # one request decoding: max - min of local(L) over ranks is 1 unless 4 divides L (L = 1..16)
    assert s["decode_steps"] == 16 and s["imbalance_max"] == 1 and s["imbalance_mean"] == 12 / 16
    assert s["runs_per_write"] == 1 and s["run_length"] == 1


def test_interleave_b_puts_every_position_of_a_block_on_one_rank():
    s = stats(decode_only(16))
    assert s["stored"] == [16, 0, 0, 0] and s["empty_shards"] == [0, 1, 1, 1]
    # rank 0 holds all L positions, the others none: imbalance L at step L
    assert s["imbalance_max"] == 16 and s["imbalance_mean"] == np.mean(range(1, 17))
    assert s["decode_writes_with_empty_shard"] == 16


@pytest.mark.parametrize("I", [1, 2, 4, 8, 16])
def test_stored_and_final_local_lengths_agree_with_semantics_section_2(I):
    sc = make_scenario({"mla": mla_spec(16)}, [request_spec("a", 37, 5), request_spec("b", 100, 3)], W=4, I=I)
    s = stats(sc)
    final = [37 + 5 - 1, 100 + 3 - 1]  # the last sampled token has no KV
    want = local_seq_lens(final, dcp_size=4, interleave_size=I).sum(axis=0)
    assert s["stored"] == want.tolist() and sum(s["stored"]) == sum(final)


def test_fragmentation_of_one_64_token_prefill_falls_as_the_interleave_grows():
    """A rank's 16 positions of the write come in 16 / I runs of I tokens at consecutive slots."""
    for I in (1, 2, 4, 8, 16):
        sc = make_scenario({"mla": mla_spec(16)}, [request_spec("p", 64, 1)], W=4, I=I)
        s = stats(sc)
        assert s["rank_writes"] == 4 and s["runs_per_write"] == 16 / I and s["run_length"] == I, I


def test_speculative_steps_land_on_every_rank_at_interleave_1_and_mostly_one_rank_at_b():
    spread = stats(decode_only(1, k=3, acceptance=(0,)))
    blocky = stats(decode_only(16, k=3, acceptance=(0,)))
    assert spread["speculative_steps"] == blocky["speculative_steps"] > 10
    # 1 + k consecutive tokens at I = 1 go to min(1 + k, W) ranks, never to one
    assert spread["speculative_one_rank_share"] == 0 and spread["speculative_ranks_mean"] > 3
    assert blocky["speculative_one_rank_share"] > 0.75 and blocky["speculative_ranks_mean"] < 1.3


def test_write_runs_breaks_at_a_token_gap_and_at_a_slot_jump():
    def rec(index, slots):
        return WriteRecord(0, 0, "r", np.asarray(slots), np.asarray(index))

    assert write_runs(rec([], [])) == 0
    assert write_runs(rec([0, 1, 2, 3], [80, 81, 82, 83])) == 1
    assert write_runs(rec([0, 4, 8], [80, 81, 82])) == 3  # I = 1: neighbours in the slots, not in the tokens
    assert write_runs(rec([14, 15, 16, 17], [94, 95, 160, 161])) == 2  # a new block


def test_trends_on_dsv3_at_w4():
    runs = {I: stats(builtin("dsv3", 4, I)) for I in (1, 8, 64)}
    one, eight, block = runs[1], runs[8], runs[64]
    # the schedule does not depend on I, so neither does the total stored
    assert sum(one["stored"]) == sum(eight["stored"]) == sum(block["stored"])
    assert one["imbalance_mean"] < eight["imbalance_mean"] < block["imbalance_mean"]
    decoding_at_most = len(builtin("dsv3", 4).requests)
    assert one["imbalance_max"] <= decoding_at_most < eight["imbalance_max"]  # at most I per decoding request
    assert one["runs_per_write"] > eight["runs_per_write"] > block["runs_per_write"]
    assert one["run_length"] < eight["run_length"] < block["run_length"]
    assert one["speculative_one_rank_share"] < eight["speculative_one_rank_share"] < block["speculative_one_rank_share"]
    assert block["stored_spread"] > one["stored_spread"]


def test_the_trace_hands_out_every_ranks_write_log_of_every_step():
    sc = decode_only(1)
    trace = SerialRanks(sc)
    steps = list(trace.steps())
    assert len(steps) == 16
    for plan, logs in steps:
        assert len(logs) == 4 and all(len(log) == len(plan.writes) for log in logs)
        (write,) = plan.writes
        owners = [r for r, log in enumerate(logs) if len(log[0].slots)]
        assert owners == [write.start % 4]  # I = 1: position p on rank p % W
