"""P/D runs under ``--engine vllm``: both instances schedule with the engine's scheduler (vLLM's
``KVCacheManager`` in dcpsim's step loop, or vLLM's v1 ``Scheduler``), the decode instance's
loaded prompts allocated by vLLM (``num_external_computed_tokens``); the P/D built-ins get the
reference's verdicts, and a bug planted in vLLM's KV cache manager that only a loaded prompt
reaches fails a P/D run. With the ``nixl`` connector the decode instance's connector is vLLM's own
NIXL scheduler side (``dcpsim.engine.vllm.nixl_scheduler``) on every tree it binds to: a bug planted
in its block count fails the run too, and ``engine info`` names it."""

from __future__ import annotations

import json

import pytest
from test_vllm_engine import patched_copy

from dcpsim.cli import main
from dcpsim.engine.choice import EngineChoice
from dcpsim.engine.loading.bindings import bind
from dcpsim.engine.vllm.nixl_scheduler import PD_CONNECTOR_DECISION
from dcpsim.engine.vllm.releases import NIXL_SCHEDULER, VLLM_RELEASES
from dcpsim.errors import ConfigError
from dcpsim.harness.pd import run_pd_batch
from dcpsim.harness.pd_job import PDJob, prepare_pd
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
    """The P/D built-ins vLLM's engine runs (pd-helix is Helix's and pd-async-recycled's asynchronous
    loads are dcpsim's scheduler's: the reference's only, below)."""
    every = [sc for sc in map(load_scenario, builtin_scenario_names()) if sc.disaggregated is not None]
    return [sc for sc in every if sc.config.kv_cache_layout == "vllm" and not sc.disaggregated.load_steps]


def vllm(source, mode: str) -> EngineChoice:
    return EngineChoice(name="vllm", vllm_source=str(source), vllm_scheduler=mode)


@pytest.mark.network
@pytest.mark.parametrize("mode", ["manager", "full"])
def test_pd_builtins_get_the_reference_verdicts_under_vllms_scheduler(vllm_source, mode):
    scenarios = [*pd_builtins(), scenario_from_dict(EDGE, source="pd-edge.toml")]
    assert len(scenarios) >= 2
    with pytest.raises(ConfigError, match='the decode instance: kv_cache_layout = "helix": engine vllm'):
        prepare_pd(PDJob(load_scenario("pd-helix"), engine=vllm(vllm_source, mode)))
    with pytest.raises(ConfigError, match="disaggregated.load_steps 2: the asynchronous loads are dcpsim's scheduler's"):
        prepare_pd(PDJob(load_scenario("pd-async-recycled"), engine=vllm(vllm_source, mode)))
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
    """The connector's tokens left out of the slots ``allocate_slots`` gives (the new tokens' count
    and the external blocks' count both short): vLLM's NIXL load (asynchronous, no new tokens
    in its allocation) gets no block for a prompt shorter than a block, so the pull fills nothing
    and the request's first decode step reads a prompt that never arrived. Either half alone is
    harmless there: ``allocate_new_computed_blocks`` or ``allocate_new_blocks`` gives the block
    (with the synchronous stand-in connector the first half alone failed the run)."""
    copy = patched_copy(
        vllm_source,
        tmp_path / "vllm-bug",
        MANAGER,
        "        total_computed_tokens = min(\n            num_local_computed_tokens + num_external_computed_tokens,\n",
        "        total_computed_tokens = min(\n            num_local_computed_tokens,\n",
    )
    single = copy / "vllm/v1/core/single_type_kv_cache_manager.py"
    text = single.read_text(encoding="utf-8")
    external = "            0, cdiv(num_total_computed_tokens, self.block_size) - len(req_blocks)\n"
    assert external in text
    single.unlink()  # a hard link: write a file of its own
    floor = "            0, num_total_computed_tokens // self.block_size - len(req_blocks)\n"
    single.write_text(text.replace(external, floor), encoding="utf-8")
    path = tmp_path / "pd-edge.toml"
    path.write_text(toml_of(EDGE), encoding="utf-8")
    argv = ["run", str(path), "--engine", "vllm", "--vllm-scheduler", mode, "--json"]
    assert main([*argv, "--vllm-source", str(copy)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["prefill"]["passed"] and report["decode"]["failure"]["kind"] == "wrong-content", report["decode"]["failure"]
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


# --- vLLM's NIXL scheduler side (dcpsim.engine.vllm.nixl_scheduler) ---------------------------

NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
NIXL_TREES = {
    # release -> (the file holding the scheduler class, its clip method, the class engine info names)
    "0.34.0": ("pull_scheduler.py", "get_exchange_clipped_blocks", "nixl.pull_scheduler.NixlPullConnectorScheduler"),
    "0.33.0": ("pull_scheduler.py", "get_exchange_clipped_blocks", "nixl.pull_scheduler.NixlPullConnectorScheduler"),
    "0.23.0": ("scheduler.py", "get_sw_clipped_blocks", "nixl.scheduler.NixlConnectorScheduler"),
}
NIXL_CASES = [("0.34.0", "manager"), ("0.23.0", "manager"), ("0.33.0", "full"), ("0.34.0", "full")]
"""The newest tree and 0.23.0 (the whole scheduler class in ``nixl/scheduler.py``) under dcpsim's
step loop; vLLM's v1 Scheduler (``full``) on 0.33.0, the newest release its stand-in config covers."""


def _nixl_bug(source, dest, release: str):
    """A copy of ``source`` whose NIXL scheduler side counts the blocks to pull with a floor (and
    the raw block size times DCP): the partly filled last block of a prompt is never pulled."""
    file, clip, _ = NIXL_TREES[release]
    line = f"                    local_block_ids = self.{clip}(\n                        unhashed_local_block_ids\n                    )\n"
    floor = (
        "                    local_block_ids = tuple(g[: num_external_tokens // (self.block_size * "
        "self.vllm_config.parallel_config.decode_context_parallel_size)] for g in local_block_ids)\n"
    )
    return patched_copy(source, dest, f"{NIXL}/{file}", line, line + floor)


@pytest.mark.network
@pytest.mark.parametrize(("release", "mode"), NIXL_CASES)
def test_vllms_nixl_scheduler_side_chooses_the_pulls_of_the_pd_runs(release, mode, release_source):
    """vLLM's NIXL scheduler side says what each decode request loads and which blocks the pull
    fills; the entries are written there, and every P/D run gets the reference's verdict."""
    scenarios = [*pd_builtins(), scenario_from_dict(EDGE, source="pd-edge.toml")]
    source = release_source("vllm", release)
    reference = run_pd_batch([PDJob(sc) for sc in scenarios], world=WorldOptions(timeout=60))
    got = run_pd_batch([PDJob(sc, engine=vllm(source, mode)) for sc in scenarios], world=WorldOptions(timeout=60))
    for sc, ref, report in zip(scenarios, reference, got):
        assert ref.passed and report.passed, (sc.name, report.prefill.failure, report.decode.failure)
        decided = report.decode.engine["scheduler_decisions"]
        assert NIXL_TREES[release][2] in decided[PD_CONNECTOR_DECISION]
        assert report.entries_written == ref.entries_written == sum(r.prompt_len for r in sc.requests)
        assert report.decode.schedule["finished"] == len(sc.requests)


@pytest.mark.network
@pytest.mark.parametrize(("release", "mode"), NIXL_CASES)
def test_a_block_count_bug_in_vllms_nixl_scheduler_fails_a_pd_run(release, mode, capsys, tmp_path, release_source):
    copy = _nixl_bug(release_source("vllm", release), tmp_path / "vllm-nixl-bug", release)
    path = tmp_path / "pd-edge.toml"
    path.write_text(toml_of(EDGE), encoding="utf-8")
    assert main(["run", str(path), "--engine", "vllm", "--vllm-scheduler", mode, "--json", "--vllm-source", str(copy)]) == 1
    report = json.loads(capsys.readouterr().out)
    failure = report["decode"]["failure"]
    assert report["prefill"]["passed"] and failure["kind"] == "wrong-content", failure  # the last block's entries never arrive


def test_engine_info_names_vllms_nixl_scheduler_side(capsys, release_source):
    for release in ("0.34.0", "0.23.0"):
        assert main(["engine", "info", "--engine", "vllm", "--vllm-source", str(release_source("vllm", release))]) == 0
        assert NIXL_TREES[release][2] in capsys.readouterr().out


@pytest.mark.network
@pytest.mark.parametrize("release", VLLM_RELEASES)
def test_the_nixl_scheduler_side_binds_by_the_trees_code(release, release_source):
    """0.23.0 holds the whole class in ``nixl/scheduler.py``; from 0.24.0 that file only re-exports
    ``pull_scheduler.py``'s, which the binding finds by its code, not by a version."""
    bound = bind(release_source("vllm", release), (NIXL_SCHEDULER,), release=None, label="vLLM", flag="--vllm-source")
    assert bound.shape("nixl_scheduler") == ("single" if release == "0.23.0" else "pull")
