"""P/D runs under ``--engine vllm``: both instances schedule with the engine's scheduler (vLLM's
``KVCacheManager`` in dcpsim's step loop, or vLLM's v1 ``Scheduler``), the decode instance's
loaded prompts allocated by vLLM (``num_external_computed_tokens``); the P/D built-ins get the
reference's verdicts, and a bug planted in vLLM's KV cache manager that only a loaded prompt
reaches fails a P/D run."""

from __future__ import annotations

import json

import pytest
from test_vllm_engine import patched_copy

from dcpsim.cli import main
from dcpsim.engine.choice import EngineChoice
from dcpsim.errors import ConfigError
from dcpsim.harness.pd import run_pd_batch
from dcpsim.harness.pd_job import PDJob
from dcpsim.harness.world_options import WorldOptions
from dcpsim.scenarios.load import load_scenario, scenario_from_dict
from dcpsim.scenarios.registry import builtin_scenario_names

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DRIVER = {"manager": "KVCacheManager in dcpsim's step loop", "full": "Scheduler.schedule and .update_from_output"}
MANAGER = "vllm/v1/core/kv_cache_manager.py"

EDGE = {
    "name": "pd-edge",
    "config": {"max_model_len": 1024, "max_num_batched_tokens": 96, "num_speculative_tokens": 1, "enable_prefix_caching": False},
    "layers": [{"name": "l.{i}", "layers": "0-1", "kind": "mla", "block_size": 16, "head_size": 576}],
    "requests": [
        # decode W = 4, B = 16: the manager's block is 64 tokens; the loaded prompt ends a block, so the
        # first decode step (the last prompt token and a draft) needs a block past the loaded ones
        {"id": "a", "prompt_len": 128, "output_len": 6, "acceptance": [1, 0]},
        {"id": "b", "prompt_len": 37, "output_len": 9, "arrival_step": 1},
    ],
    "disaggregated": {
        "kv_connector": "nixl",
        "prefill": {"decode_context_parallel_size": 2},
        "decode": {"decode_context_parallel_size": 4},
    },
}


def pd_builtins() -> list:
    return [sc for sc in map(load_scenario, builtin_scenario_names()) if sc.disaggregated is not None]


def vllm(source, mode: str) -> EngineChoice:
    return EngineChoice(name="vllm", vllm_source=str(source), vllm_scheduler=mode)


@pytest.mark.network
@pytest.mark.parametrize("mode", ["manager", "full"])
def test_pd_builtins_get_the_reference_verdicts_under_vllms_scheduler(vllm_source, mode):
    scenarios = [*pd_builtins(), scenario_from_dict(EDGE, source="pd-edge.toml")]
    assert len(scenarios) >= 2
    world = WorldOptions(timeout=60)
    reference = run_pd_batch([PDJob(sc) for sc in scenarios], world=world)
    got = run_pd_batch([PDJob(sc, engine=vllm(vllm_source, mode)) for sc in scenarios], world=world)
    for sc, ref, report in zip(scenarios, reference, got):
        assert ref.passed, sc.name
        assert report.passed, (sc.name, report.prefill.failure, report.decode.failure)
        for instance in (report.prefill, report.decode):
            assert instance.engine["name"] == "vllm" and DRIVER[mode] in instance.engine["decisions"]["make_scheduler"]
        prompts = sum(r.prompt_len for r in sc.requests)
        assert report.entries_sent == ref.entries_sent == prompts  # one group: every prompt position moved once
        assert report.entries_written == ref.entries_written == prompts  # written at the slots vLLM's manager gave
        assert report.decode.schedule["finished"] == ref.decode.schedule["finished"] == len(sc.requests)


@pytest.mark.network
@pytest.mark.parametrize("mode", ["manager", "full"])
def test_a_bug_in_vllms_kv_cache_manager_only_a_loaded_prompt_reaches_fails_a_pd_run(capsys, tmp_path, vllm_source, mode):
    """The connector's tokens left out of the tokens ``allocate_slots`` gives slots to: the
    first decode step past the loaded blocks has no block (a write violation)."""
    copy = patched_copy(
        vllm_source,
        tmp_path / "vllm-bug",
        MANAGER,
        "        total_computed_tokens = min(\n            num_local_computed_tokens + num_external_computed_tokens,\n",
        "        total_computed_tokens = min(\n            num_local_computed_tokens,\n",
    )
    path = tmp_path / "pd-edge.toml"
    path.write_text(toml_of(EDGE), encoding="utf-8")
    argv = ["run", str(path), "--engine", "vllm", "--vllm-scheduler", mode, "--json"]
    assert main([*argv, "--vllm-source", str(copy)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["prefill"]["passed"] and report["decode"]["failure"]["kind"] == "write-violation", report["decode"]["failure"]
    assert main([*argv, "--vllm-source", str(vllm_source)]) == 0  # the clean tree passes
    capsys.readouterr()


@pytest.mark.network
def test_a_pd_fault_of_the_reference_engine_does_not_combine_with_vllm(vllm_source):
    with pytest.raises(ConfigError, match="cannot be combined with --engine vllm"):
        PDJob(pd_builtins()[0], inject="nixl-interleave-not-block-size", engine=vllm(vllm_source, "manager"))


def toml_of(data: dict) -> str:
    """``EDGE`` as a scenario file (tables of scalars and lists of tables only)."""
    lines = [f'name = "{data["name"]}"']

    def table(name: str, values: dict) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict))
        for k, v in values.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    table("config", data["config"])
    table("disaggregated", data["disaggregated"])
    for key in ("layers", "requests"):
        for item in data[key]:
            lines.append(f"[[{key}]]")
            lines.extend(f"{k} = {json.dumps(v)}" for k, v in item.items())
    return "\n".join(lines) + "\n"
