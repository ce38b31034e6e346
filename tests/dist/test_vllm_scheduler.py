"""``--engine vllm`` with vLLM's own ``KVCacheManager`` deciding every block (the default,
``--vllm-scheduler manager``) and with vLLM's v1 ``Scheduler`` driving the steps
(``--vllm-scheduler full``): the built-ins get the reference's verdicts under both,
vllm#50118 reproduces as a clear engine error, and copies of vLLM's source with a
scheduler-side bug planted fail with the right kind."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_vllm_engine import patched_copy, vllm_run

from dcpsim.cli import main
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from support.helpers import builtin, builtin_names_at, make_scenario, mla_spec, request_spec, run
from support.reference_runs import reference_run

pytestmark = pytest.mark.slow  # gloo worlds running an engine's kernels; the fast loop leaves them out

UPSTREAM_BUG = "kv-events-full"
CHUNKED_PREFIX_BUG = "llama4-chunked-prefix"  # vLLM asserts at its first prefix lookup under DCP (test_vllm_hybrid_layout)
"""Fails under vLLM 0.33.0 at W > 1 by design: it reproduces vllm#50118 (tested below)."""
MANAGER = "vllm/v1/core/kv_cache_manager.py"
POOL = "vllm/v1/core/block_pool.py"
SINGLE_TYPE = "vllm/v1/core/single_type_kv_cache_manager.py"
COORDINATOR = "vllm/v1/core/kv_cache_coordinator.py"


DRIVER = {"manager": "KVCacheManager in dcpsim's step loop", "full": "Scheduler.schedule and .update_from_output"}
"""What ``make_scheduler`` names under each ``--vllm-scheduler``."""


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("mode", ["manager", "full"])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_builtins_get_the_reference_verdicts_with_vllms_scheduler(vllm_source, W, mode):
    names = [n for n in builtin_names_at(W) if not (n in (UPSTREAM_BUG, CHUNKED_PREFIX_BUG) and W > 1)]
    scenarios = [builtin(name, W) for name in names]
    by_world: dict[int, list[int]] = {}
    for k, sc in enumerate(scenarios):
        by_world.setdefault(sc.config.world_size, []).append(k)
    for ks in by_world.values():  # one gloo world per world size (a PCP built-in has its own)
        jobs = [Job.from_options(scenarios[k], engine="vllm", vllm_source=str(vllm_source), vllm_scheduler=mode, timeout=60) for k in ks]
        for k, got in zip(ks, run_jobs(jobs)):
            ref = reference_run(scenarios[k])
            assert DRIVER[mode] in got.engine["decisions"]["make_scheduler"], got.engine
            assert ref.passed, names[k]
            assert got.passed, f"{names[k]} at W = {W} under --vllm-scheduler {mode}:\n{got.text()}"
            assert got.schedule["finished"] == ref.schedule["finished"] == len(scenarios[k].requests)
            if mode == "full" and names[k] in SPECULATING:  # the clean tree of FULL_PLANTED's bugs
                who = got.engine["scheduler_decisions"]["speculative tokens scheduled"]
                assert who.startswith("vllm.v1.core.sched.scheduler.Scheduler.schedule"), who


SPECULATING = ("dsv3", "llama-gqa")
"""Built-ins whose drafts vLLM's ``Scheduler`` schedules under ``full`` (FULL_PLANTED's scenarios)."""


def test_vllm_50118_is_an_engine_error_naming_vllms_assertion(capsys, vllm_source):
    code, report = vllm_run(capsys, vllm_source, UPSTREAM_BUG)
    assert code == 1, report
    failure = report["failure"]
    assert failure["kind"] == "engine-error" and failure["step"] == 3, failure
    assert "KVCacheManager.get_computed_blocks" in failure["message"]
    assert "AssertionError: assert block_size % hash_block_size == 0" in failure["message"]
    assert failure["details"][0] == "raised by vllm.v1.core.kv_cache_utils.resolve_block_hashes, vllm/v1/core/kv_cache_utils.py:1262"
    assert "kv_cache_coordinator.py:390 emit_cached_block_events" in failure["details"][1]
    # under vLLM's v1 Scheduler the same assertion, reached through Scheduler.schedule
    code, report = vllm_run(capsys, vllm_source, UPSTREAM_BUG, "--vllm-scheduler", "full")
    failure = report["failure"]
    assert code == 1 and failure["kind"] == "engine-error" and "Scheduler.schedule" in failure["message"], failure
    assert failure["details"][0] == "raised by vllm.v1.core.kv_cache_utils.resolve_block_hashes, vllm/v1/core/kv_cache_utils.py:1262"
    assert any("scheduler.py" in d and " schedule" in d for d in failure["details"]), failure["details"]
    # at W = 1 the spec's block size is the manager's: it passes (test_builtins_get_the_reference_verdicts_with_vllms_scheduler[1-manager]
    # runs it), as the reference does at W = 4
    assert main(["run", UPSTREAM_BUG, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"]["prefix_hit_tokens"] > 0


def test_with_the_fix_vllms_readvertised_blocks_pass_the_router(capsys, tmp_path, vllm_source):
    fixed = patched_copy(
        vllm_source,
        tmp_path / "vllm-fixed",
        COORDINATOR,
        "                    len(group_blocks),\n                    group.kv_cache_spec.block_size,\n",
        "                    len(group_blocks),\n                    manager.block_size,\n",
    )
    code, report = vllm_run(capsys, fixed, UPSTREAM_BUG)
    assert code == 0, report.get("failure")
    assert report["schedule"]["prefix_hit_tokens"] > 0


PLANTED = [
    pytest.param(  # a BlockStored event's span: half the manager's block
        POOL,
        "            block_size=block_size,\n            lora_id=request.lora_request.adapter_id if request.lora_request else None,",
        "            block_size=block_size // 2,\n            lora_id=request.lora_request.adapter_id if request.lora_request else None,",
        "dsv3",
        "kv-events",
        id="event-block-size",
    ),
    pytest.param(  # sliding-window blocks released 16 tokens early (still inside the window)
        SINGLE_TYPE,
        "            num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens,",
        "            num_computed_tokens - self.sliding_window + 17 - self.extra_retained_tokens,",
        "gpt-oss-hybrid",
        "retention-at-read",  # the step's own queries read the released keys (wrong-content after the step, before that judge)
        id="window-release",
    ),
    pytest.param(  # one slot too few: the step's last token has no block
        MANAGER,
        "            num_tokens_main_model + num_lookahead_tokens, self.max_model_len\n        )",
        "            num_tokens_main_model + num_lookahead_tokens, self.max_model_len\n        ) - 1",
        "dsv3",
        "write-violation",
        id="slots-short-by-one",
    ),
    pytest.param(  # a prefix hit does not take a reference: its blocks are handed out while in use
        POOL,
        "                self.free_block_queue.remove(block)\n            block.ref_cnt += 1",
        "                self.free_block_queue.remove(block)\n            block.ref_cnt += 0",
        "dsv3",
        "engine-error",
        id="hit-without-reference",
    ),
    pytest.param(  # the hash view of a sharded group at B, not B * W
        SINGLE_TYPE,
        "            block_size *= dcp_world_size",
        "            block_size *= 1",
        "dsv3",
        "engine-error",
        id="hash-view-unscaled",
    ),
]


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("mode", ["manager", "full"])
@pytest.mark.parametrize("rel,old,new,scenario,kind", PLANTED)
def test_a_scheduler_side_bug_planted_in_vllm_is_caught(capsys, tmp_path, vllm_source, rel, old, new, scenario, kind, mode):
    copy = patched_copy(vllm_source, tmp_path / "vllm-bug", rel, old, new)
    code, report = vllm_run(capsys, copy, scenario, "--dcp", "2", "--vllm-scheduler", mode)
    assert code == 1 and report["failure"]["kind"] == kind, report.get("failure")
    # the clean tree passes: test_builtins_get_the_reference_verdicts_with_vllms_scheduler[2-mode] runs it


SCHEDULER = "vllm/v1/core/sched/scheduler.py"
FULL_PLANTED = [
    pytest.param(  # a running request gets one token more than it has: a position without a token is computed
        "                request.num_tokens_with_spec\n                + request.num_output_placeholders\n"
        "                - request.num_computed_tokens\n            )",
        "                request.num_tokens_with_spec\n                + request.num_output_placeholders\n"
        "                - request.num_computed_tokens\n                + 1\n            )",
        "dsv3",
        "wrong-content",
        id="one-token-too-many",
    ),
    pytest.param(  # rejected drafts stay computed: the next step starts past the bonus token
        "                        request.num_computed_tokens -= num_rejected",
        "                        request.num_computed_tokens -= 0",
        "llama-gqa",
        "wrong-content",
        id="no-rollback-after-rejection",
    ),
    pytest.param(  # one draft fewer listed than scheduled: the step's last own token is past the request's tokens
        "                    scheduled_spec_decode_tokens[request.request_id] = spec_token_ids\n",
        "                    scheduled_spec_decode_tokens[request.request_id] = spec_token_ids[:-1]\n",
        "dsv3",
        "wrong-content",
        id="spec-tokens-one-short",
    ),
]


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("old,new,scenario,kind", FULL_PLANTED)
def test_a_bug_planted_in_vllms_scheduler_is_caught_under_full(capsys, tmp_path, vllm_source, old, new, scenario, kind):
    copy = patched_copy(vllm_source, tmp_path / "vllm-bug", SCHEDULER, old, new)
    code, report = vllm_run(capsys, copy, scenario, "--dcp", "2", "--vllm-scheduler", "full")
    assert code == 1 and report["failure"]["kind"] == kind, report.get("failure")
    # the clean tree passes, its drafts scheduled by vLLM's Scheduler: test_builtins_get_the_reference_verdicts_with_vllms_scheduler[2-full]


@pytest.mark.network
def test_a_configuration_vllms_scheduler_refuses_is_exit_2_quoting_vllm(capsys, tmp_path, vllm_source):
    # a vLLM whose Scheduler refuses DCP when it is built: exit 2 before any rank starts, vLLM's words quoted
    copy = patched_copy(
        vllm_source,
        tmp_path / "vllm-no-dcp",
        SCHEDULER,
        "        self.dcp_world_size = vllm_config.parallel_config.decode_context_parallel_size\n",
        "        self.dcp_world_size = vllm_config.parallel_config.decode_context_parallel_size\n"
        '        assert self.dcp_world_size == 1, "DCP is not supported by this scheduler"\n',
    )
    argv = ["run", "dsv3", "--dcp", "2", "--engine", "vllm", "--vllm-scheduler", "full"]
    assert main([*argv, "--vllm-source", str(copy)]) == 2
    err = capsys.readouterr().err
    where = "vllm.v1.core.sched.scheduler.Scheduler.__init__ (vllm/v1/core/sched/scheduler.py:"
    assert f"vLLM 0.33.0 refuses this configuration: {where}" in err
    assert "AssertionError: DCP is not supported by this scheduler" in err and "Traceback" not in err
    assert main([*argv, "--vllm-source", str(vllm_source), "--async-scheduling"]) == 2  # vLLM's AsyncScheduler: not run
    assert "async_scheduling (vLLM's AsyncScheduler) is not supported" in capsys.readouterr().err


def test_a_source_tree_that_does_not_import_is_exit_2_naming_file_and_line(capsys, tmp_path, vllm_source):
    copy = patched_copy(vllm_source, tmp_path / "vllm-syntax", "vllm/v1/kv_cache_interface.py", "@dataclass", "@dataclass(")
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "vllm", "--vllm-source", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"vLLM source {copy}: vllm/v1/kv_cache_interface.py:" in err and "SyntaxError" in err
    assert "Traceback" not in err


def lookahead_pressure(method: str):
    """Two 61-token prompts at W = 2 (64-token block-table entries) in a pool of two blocks,
    every draft rejected: each step ends by position 63, one entry a request, but with an
    EAGLE / MTP drafter the first decode step's lookahead of 2 reaches slot 65, a second entry
    the pool has not, and the last running request is preempted for it (semantics section 5)."""
    reqs = [request_spec("x", 61, 3, acceptance=(0,)), request_spec("y", 61, 3, acceptance=(0,))]
    sc = make_scenario({"mla.0": mla_spec(32), "mla.1": mla_spec(32)}, reqs, W=2, k=2, budget=256, num_gpu_blocks=2, prefix=False)
    return dataclasses.replace(sc, config=dataclasses.replace(sc.config, speculative_method=method))


@pytest.mark.slow
@pytest.mark.network
def test_the_drafters_lookahead_gives_vllms_blocks_and_preemptions_in_both_modes(vllm_source):
    """vLLM's scheduler passes ``num_lookahead_tokens`` (``k`` for EAGLE / MTP, 0 for ngram) to every
    ``allocate_slots``; the reference reserves the same: each run's rows are judged exactly
    (``blocks held`` counts the lookahead) and the preemption it forces is the same under
    ``--vllm-scheduler manager``, ``full`` and the reference."""
    keys = ("preemptions", "steps", "finished", "reused_blocks")
    cases = [(method, preemptions, mode) for method, preemptions in (("eagle", 1), ("mtp", 1), ("ngram", 0)) for mode in DRIVER]
    jobs = [
        Job.from_options(lookahead_pressure(m), engine="vllm", vllm_source=str(vllm_source), vllm_scheduler=d, timeout=60)
        for m, _, d in cases
    ]
    refs = {method: run(lookahead_pressure(method)) for method in ("eagle", "mtp", "ngram")}
    for (method, preemptions, mode), got in zip(cases, run_jobs(jobs)):  # one world: the six runs in turn
        ref = refs[method]
        assert ref.passed and ref.schedule["preemptions"] == preemptions, (method, ref.text())
        assert got.passed, f"{method} under --vllm-scheduler {mode}:\n{got.text()}"
        assert {k: got.schedule[k] for k in keys} == {k: ref.schedule[k] for k in keys}, (method, mode)
