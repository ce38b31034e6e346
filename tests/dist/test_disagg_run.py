"""P/D runs on real gloo worlds: every (prefill W, decode W) pair of at most 8 processes passes,
NIXL where block matching allows the pair, re-sharding (with differing I and B) elsewhere;
the P/D faults fail them; the CLI's report and exit codes."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main
from dcpsim.harness.pd import run_pd, run_pd_batch
from dcpsim.harness.pd_job import PDJob
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.load import scenario_from_dict

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = {
    "name": "pd-tiny",
    "config": {"max_model_len": 1024, "max_num_batched_tokens": 96, "num_speculative_tokens": 1, "enable_prefix_caching": False},
    "layers": [{"name": "l.{i}", "layers": "0-1", "kind": "mla", "block_size": 16, "head_size": 576}],
    "requests": [
        {"id": "a", "prompt_len": 150, "output_len": 6, "acceptance": [1, 0]},
        {"id": "b", "prompt_len": 37, "output_len": 9, "arrival_step": 1},
        {"id": "c", "prompt_len": 260, "output_len": 5, "arrival_step": 2},
    ],
}

PAIRS = [(p, d) for p in range(1, 8) for d in range(1, 8) if p + d <= 8]
NIXL = [(p, d) for p, d in PAIRS if p % d == 0 or d % p == 0]
RESHARD = [(p, d) for p, d in PAIRS if (p, d) not in NIXL] + [(1, 4), (4, 2), (2, 2)]


def tiny(prefill: dict, decode: dict, connector: str):
    data = dict(TINY, disaggregated={"kv_connector": connector, "prefill": prefill, "decode": decode})
    return scenario_from_dict(data, source="pd-tiny.toml")


def check_passed(report, P, D):
    assert report.passed, (report.prefill.failure, report.decode.failure)
    assert len(report.prefill.ranks) == P and len(report.decode.ranks) == D
    prompts = sum(r["prompt_len"] for r in TINY["requests"])
    assert report.entries_sent == prompts * 1  # one group: every prompt position moved exactly once
    assert report.entries_written == prompts
    assert report.decode.schedule["finished"] == 3 and report.decode.verified_indices > prompts


def test_every_nixl_pair_passes():
    """One world of 8 runs the 20 pairs whose context-parallel sizes divide one another, in turn."""
    jobs = [PDJob(tiny({"decode_context_parallel_size": P}, {"decode_context_parallel_size": D}, "nixl")) for P, D in NIXL]
    for (P, D), report in zip(NIXL, run_pd_batch(jobs, world=WorldOptions(timeout=60))):
        check_passed(report, P, D)
        assert report.layouts["decode"]["cp_kv_cache_interleave_size"] == (16 if D > 1 else 1)


def test_every_other_pair_passes_resharding_with_differing_interleave_and_block_size():
    jobs = [
        PDJob(
            tiny(
                {"decode_context_parallel_size": P, "cp_kv_cache_interleave_size": 1},
                {"decode_context_parallel_size": D, "cp_kv_cache_interleave_size": 4, "block_size": 32},
                "resharding",
            )
        )
        for P, D in RESHARD
    ]
    for (P, D), report in zip(RESHARD, run_pd_batch(jobs, world=WorldOptions(timeout=60))):
        check_passed(report, P, D)
        assert report.layouts["decode"]["block_size"] == 32


@pytest.mark.parametrize(
    "fault, connector, prefill_i, failing",
    [
        ("nixl-interleave-not-block-size", "nixl", None, "prefill"),
        ("reshard-ignores-interleave", "resharding", 1, "decode"),
    ],
)
def test_a_pd_fault_fails_the_run(fault, connector, prefill_i, failing):
    prefill = {"decode_context_parallel_size": 2} | ({"cp_kv_cache_interleave_size": prefill_i} if prefill_i else {})
    decode = {"decode_context_parallel_size": 4} | ({"cp_kv_cache_interleave_size": 8} if prefill_i else {})
    report = run_pd(PDJob(tiny(prefill, decode, connector), inject=fault), world=WorldOptions(timeout=60))
    assert not report.passed
    assert getattr(report, failing).failure.kind == "wrong-content"


def test_the_cli_reports_both_instances(capsys):
    assert main(["run", "pd-dsv3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] and doc["kv_connector"] == "nixl"
    assert doc["layouts"]["prefill"]["decode_context_parallel_size"] == 2
    assert doc["layouts"]["decode"] == {
        "decode_context_parallel_size": 4,
        "cp_kv_cache_interleave_size": 64,
        "block_size": 64,
        "prefill_context_parallel_size": 1,
        "tensor_parallel_size": 4,
        "kv_shards": 4,
    }
    assert doc["entries_sent"] == doc["entries_written"] == 700 * 2 + 90 + 1000
    assert len(doc["decode"]["ranks"]) == 4 and doc["decode"]["passed"] and doc["prefill"]["passed"]
    assert (
        main(["run", "pd-dsv3", "--kv-connector", "resharding", "--decode-interleave", "8", "--inject", "reshard-ignores-interleave"]) == 1
    )
    assert "P/D FAILED" in capsys.readouterr().out


def test_the_matrix_runs_pd_pairs_and_skips_what_nixl_cannot_pair(capsys):
    assert main(["matrix", "--pd", "1:2,2:3", "--json"]) == 0
    cells = {c["cell"]: c for c in json.loads(capsys.readouterr().out)}
    assert cells["pd-dsv3-pd1:2"]["status"] == "pass"
    assert cells["pd-dsv3-pd1:2"]["report"]["layouts"]["decode"]["decode_context_parallel_size"] == 2
    assert cells["pd-dsv3-pd2:3"]["status"] == "skipped" and "divide one another" in cells["pd-dsv3-pd2:3"]["reason"]


def test_decode_prefix_hits_and_a_decode_preemption_recompute_from_the_loaded_blocks():
    """A request preempted on the decode instance recomputes locally and hits the prefix cache
    the loaded blocks filled; the checker judges the result as any run."""
    import copy

    data = copy.deepcopy(TINY)
    data["config"]["enable_prefix_caching"] = True
    for r in data["requests"][:2]:
        r.update(prefix="sys", shared_prefix_len=36)
    data["requests"].append(
        {
            "id": "d",
            "prompt_len": 200,
            "output_len": 4,
            "arrival_step": 6,
            "prefix": "sys",
            "shared_prefix_len": 36,
            "preempt_at_steps": [8],
        }
    )
    data["disaggregated"] = {
        "kv_connector": "resharding",
        "prefill": {"decode_context_parallel_size": 1},
        "decode": {"decode_context_parallel_size": 3, "cp_kv_cache_interleave_size": 2},
    }
    (report,) = run_pd_batch([PDJob(scenario_from_dict(data, source="pd-prefix.toml"))], world=WorldOptions(timeout=60))
    assert report.passed, report.failure
    assert report.decode.schedule["preemptions"] == 1 and report.decode.schedule["prefix_hit_tokens"] > 0
    assert report.entries_written == 150 + 37 + 260 + 200
