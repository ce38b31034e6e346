"""``--engine MODULE:ATTR``: a plugin written from the interface's docstrings passes, its
broken variant fails, and engines that cannot run end with exit 2 naming what is wrong."""

from __future__ import annotations

import pytest

from dcpsim.cli import main
from dcpsim.engine.example_plugin import ExampleEngine, OffByOneExampleEngine
from dcpsim.engine.registry import build_engine, unimplemented
from dcpsim.errors import ConfigError
from dcpsim.harness.job import Job
from support.helpers import builtin, run

PLUGIN = "dcpsim.engine.example_plugin:ExampleEngine"


def test_the_example_plugin_implements_every_decision():
    assert unimplemented(ExampleEngine()) == []
    assert isinstance(build_engine(PLUGIN), ExampleEngine)


@pytest.mark.slow
@pytest.mark.parametrize("name,W,I", [("dsv3", 2, 1), ("dsv41-hybrid", 4, 16), ("llama4-chunked", 3, 4), ("gpt-oss-hybrid", 2, 16)])
def test_the_example_plugin_passes(name, W, I):
    report = run(builtin(name, W, I), engine=ExampleEngine(), attention=True)
    assert report.passed, report.text()
    assert report.attention_checks > 0 and report.engine["name"] == "example-plugin"
    assert set(report.engine["decisions"].values()) == {"ExampleEngine"}


@pytest.mark.slow
@pytest.mark.parametrize("mode,W", [("none", 2), ("align", 4)])
def test_the_example_plugin_holds_mamba_states(mode, W):
    # qwen3-next-hybrid: replicated Gated DeltaNet states beside sharded full attention; the
    # plugin's state group is one state a page, never scaled by W, written in its window
    sc = builtin("qwen3-next-hybrid", W, mamba_cache_mode=mode)
    report = run(sc, engine=ExampleEngine(), attention=True)
    assert report.passed, report.text()
    state = [g for g in report.groups if g["storage"] == "state"]
    assert state and all(not g["sharded"] for g in state)
    # the plugin's geometry of the state group is the reference's, field for field
    from dcpsim.engine.reference import ReferenceEngine

    mine = [g for g in ExampleEngine().geometries(sc.layers, sc.config) if g.storage.value == "state"]
    ref = [g for g in ReferenceEngine().geometries(sc.layers, sc.config) if g.storage.value == "state"]
    assert [(g.manager_block_size, g.block_table_width) for g in mine] == [(g.manager_block_size, g.block_table_width) for g in ref]


@pytest.mark.parametrize("name", ["dsv3", "dsv41-hybrid"])
def test_the_broken_example_plugin_fails(name):
    report = run(builtin(name, 2, 4), engine=OffByOneExampleEngine())
    assert not report.passed and report.failure.kind == "wrong-content"


def test_plugin_through_the_cli(run_json):
    code, report = run_json("run", "llama-draft", "--dcp", "2", "--engine", PLUGIN, "--in-process")
    assert code == 0 and report["engine"]["name"] == "example-plugin"
    assert report["replay"]["options"]["engine"] == PLUGIN
    code, report = run_json(
        "run", "llama-draft", "--dcp", "2", "--in-process", "--engine", "dcpsim.engine.example_plugin:OffByOneExampleEngine"
    )
    assert code == 1 and report["failure"]["kind"] == "wrong-content"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_module_xyz:Engine", "cannot import module 'no_such_module_xyz'"),
        ("dcpsim.engine.example_plugin:Nope", "has no attribute 'Nope'"),
        ("dcpsim.engine.example_plugin:PAD", "is not a dcpsim.engine.interface.Engine"),
        ("dcpsim.engine.interface:Engine", "does not implement attention_metadata, blocks_needed"),
        ("justaname", "expected reference, vllm, sglang, vllm-ascend, or MODULE:ATTR"),
    ],
)
def test_a_bad_plugin_is_exit_2_naming_it(capsys, spec, message):
    assert main(["run", "dsv3", "--dcp", "2", "--engine", spec, "--in-process"]) == 2
    assert message in capsys.readouterr().err


def test_engine_options_are_refused_together_with_what_they_contradict():
    sc = builtin("dsv3", 2)
    with pytest.raises(ConfigError, match="cannot be combined with --engine"):
        Job.from_options(sc, inject="foreign-block", engine=PLUGIN)
    with pytest.raises(ConfigError, match="only used with --engine vllm"):
        Job.from_options(sc, vllm_source="/tmp")
    with pytest.raises(ConfigError, match="--vllm-runner must be one of v2, v1"):
        Job.from_options(sc, vllm_runner="v3")
    with pytest.raises(ConfigError, match="needs --vllm-source DIR"):
        Job.from_options(sc, engine="vllm")


def test_selftest_runs_its_baselines_with_the_engine(capsys):
    argv = ["selftest", "--in-process", "--scenario", "llama-draft", "--fault", "foreign-block"]
    assert main([*argv, "--engine", PLUGIN]) == 0
    assert "selftest PASSED" in capsys.readouterr().out
    assert main([*argv, "--engine", "dcpsim.engine.example_plugin:OffByOneExampleEngine"]) == 1
    out = capsys.readouterr().out
    assert "FALSE POSITIVE" in out and "baseline failures" in out


@pytest.mark.slow
def test_matrix_and_fuzz_take_the_engine(capsys, tmp_path):
    broken = "dcpsim.engine.example_plugin:OffByOneExampleEngine"
    assert main(["matrix", "llama-gqa", "--dcp", "2", "--interleave", "4", "--in-process", "--engine", PLUGIN]) == 0
    assert main(["matrix", "llama-gqa", "--dcp", "2", "--interleave", "4", "--in-process", "--engine", broken]) == 1
    capsys.readouterr()
    assert main(["fuzz", "--engine", broken, "--examples", "30", "--in-process", "--out", str(tmp_path)]) == 1
    assert list(tmp_path.glob("fuzz-*.toml"))


class _SchedulerWithoutConnector(ExampleEngine):
    def make_scheduler(self, scenario, geometries):  # written before P/D passed ``connector``
        return super().make_scheduler(scenario, geometries)


class _RenamedButCallable(ExampleEngine):
    def make_scheduler(self, sc, geos, connector=None, extra=1):  # other names, same calls: fine
        return super().make_scheduler(sc, geos, connector=connector)


def test_an_override_the_harness_cannot_call_is_refused_when_the_plugin_loads(capsys, monkeypatch):
    import dcpsim.engine.example_plugin as plugin
    from dcpsim.engine.registry import signature_mismatches

    assert signature_mismatches(ExampleEngine()) == [] and signature_mismatches(_RenamedButCallable()) == []
    (problem,) = signature_mismatches(_SchedulerWithoutConnector())
    assert "_SchedulerWithoutConnector.make_scheduler cannot be called as Engine.make_scheduler" in problem
    assert "connector=..." in problem
    monkeypatch.setattr(plugin, "NoConnector", _SchedulerWithoutConnector, raising=False)
    # refused before any rank starts, even for a run that is not P/D
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "dcpsim.engine.example_plugin:NoConnector", "--in-process"]) == 2
    assert "make_scheduler cannot be called" in capsys.readouterr().err


def test_every_engine_dcpsim_ships_can_be_called_as_the_interface_says():
    # the reference, every fault variant, and the vLLM and SGLang adapters (their classes:
    # the check reads signatures, it needs no source tree)
    from dcpsim.engine.faults.registry import FAULTS
    from dcpsim.engine.reference import ReferenceEngine
    from dcpsim.engine.registry import signature_mismatches
    from dcpsim.engine.sglang.adapter import SglangEngine
    from dcpsim.engine.vllm.adapter import VllmEngine

    engines = [ReferenceEngine(), OffByOneExampleEngine(), *FAULTS.values()]
    engines += [cls.__new__(cls) for cls in (VllmEngine, SglangEngine)]
    assert [p for e in engines for p in signature_mismatches(e)] == []
