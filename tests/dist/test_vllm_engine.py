"""``--engine vllm``: vLLM 0.33.0's own code (fetched by the ``vllm_source`` fixture, never
skipped) runs inside the gloo ranks and gets the reference engine's verdicts; copies of
the source with a known DCP bug planted fail with the right kind; a broken source tree
ends clearly (exit 2 before any rank starts, exit 3 naming the rank and the function)."""

from __future__ import annotations

import json

import pytest

from dcpsim.cli import main
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from support.helpers import builtin, builtin_names_at, patched_copy
from support.reference_runs import reference_run

pytestmark = pytest.mark.slow  # gloo worlds running an engine's kernels; the fast loop leaves them out

V2 = "vllm/v1/worker/gpu/block_table.py"
V1 = "vllm/v1/worker/block_table.py"
LENS = "vllm/v1/attention/backends/utils.py"
SPECS = "vllm/v1/kv_cache_interface.py"


def vllm_run(capsys, source, *argv) -> tuple[int, dict]:
    code = main(["run", *argv, "--engine", "vllm", "--vllm-source", str(source), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("W,I", [(2, 16), (4, 1)])
def test_builtins_get_the_reference_verdicts(vllm_source, runner, W, I):
    """With dcpsim's own scheduler (only vLLM's worker-side code), the very same schedule."""
    names = builtin_names_at(W)  # gqa-pcp2-heads's heads are refused at W = 4
    scenarios = [builtin(name, W, I) for name in names]
    reference = [reference_run(sc) for sc in scenarios]
    jobs = [
        Job.from_options(sc, engine="vllm", vllm_source=str(vllm_source), vllm_runner=runner, vllm_scheduler="dcpsim", timeout=60)
        for sc in scenarios
    ]
    reports = run_jobs(jobs)
    for name, ref, got in zip(names, reference, reports):
        assert got.engine["name"] == "vllm" and got.engine["version"] == "0.33.0"
        assert "vllm " in got.engine["decisions"]["write_slots"], got.engine
        want = (ref.passed, ref.failure.kind if ref.failure else None, ref.steps, ref.verified_indices)
        have = (got.passed, got.failure.kind if got.failure else None, got.steps, got.verified_indices)
        assert have == want, f"{name}: vllm {have} vs reference {want}\n{got.text()}"
        assert ref.passed, name


def test_attention_with_vllm_local_lengths(capsys, vllm_source):
    code, report = vllm_run(capsys, vllm_source, "dsv41-hybrid", "--dcp", "4", "--interleave", "16", "--attention", "--deadline", "600")
    assert code == 0, report.get("failure")
    assert report["attention_checks"] > 100 and report["attention_max_error"] < 1e-4
    assert "get_dcp_local_seq_lens" in report["engine"]["decisions"]["query_local_bounds"]


@pytest.mark.parametrize(
    "runner,rel,old,new",
    [
        (
            "v2",
            V2,
            "is_local = virtual_block_offsets // CP_INTERLEAVE % CP_SIZE == cp_rank",
            "is_local = virtual_block_offsets % CP_SIZE == cp_rank",
        ),
        ("v1", V1, "virtual_block_offsets // CP_KV_CACHE_INTERLEAVE_SIZE\n", "virtual_block_offsets // 1\n"),
    ],
)
def test_a_kernel_that_ignores_the_interleave_is_caught(capsys, tmp_path, vllm_source, runner, rel, old, new):
    copy = patched_copy(vllm_source, tmp_path / "vllm-bug", rel, old, new)
    code, report = vllm_run(capsys, copy, "dsv3", "--dcp", "2", "--interleave", "16", "--vllm-runner", runner)
    assert code == 1
    assert report["failure"]["kind"] in ("wrong-content", "write-violation"), report["failure"]
    # the clean tree passes the same layout (dsv3 at W = 2, I = 16, the runner's kernel, the very same
    # schedule): test_builtins_get_the_reference_verdicts[2-16-runner]


def test_local_lengths_one_too_long_are_caught_by_the_attention_check(capsys, tmp_path, vllm_source):
    copy = patched_copy(
        vllm_source,
        tmp_path / "vllm-bug",
        LENS,
        "    dcp_local_seq_lens = base + remainder\n",
        "    dcp_local_seq_lens = base + remainder + 1\n",
    )
    code, report = vllm_run(capsys, copy, "dsv3", "--dcp", "2", "--attention")
    assert code == 1 and report["failure"]["kind"] == "attention-mismatch", report["failure"]


@pytest.mark.parametrize("name", ["gpt-oss-hybrid", "llama-draft"])
def test_a_replicated_spec_scaled_by_w_in_the_spec_class_is_caught(capsys, tmp_path, vllm_source, name):
    copy = patched_copy(
        vllm_source,
        tmp_path / "vllm-bug",
        SPECS,
        "parallel_config.decode_context_parallel_size if self.dcp_sharded else 1",
        "parallel_config.decode_context_parallel_size",
    )
    code, report = vllm_run(capsys, copy, name, "--dcp", "4")
    # the worker's table is narrower than the metadata builder expects: caught at step 0
    assert code == 1 and report["failure"]["kind"] == "attention-metadata", report["failure"]
    assert any("block table width (worker)" in d for d in report["failure"]["details"])
    assert "spec classes" in report["engine"]["decisions"]["group_geometry"]


def test_a_missing_function_is_exit_2_naming_file_function_and_versions(capsys, tmp_path, vllm_source):
    copy = patched_copy(vllm_source, tmp_path / "vllm-old", V2, "def _compute_slot_mappings_kernel(", "def _renamed_slot_mappings_kernel(")
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "vllm", "--vllm-source", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"write_slots: found {V2} has no _compute_slot_mappings_kernel" in err and str(copy) in err, err
    assert "known: " in err and "in 0.32.0..0.34.0" in err and "--engine-partial" in err, err


def test_a_changed_signature_is_exit_2(capsys, tmp_path, vllm_source):
    copy = patched_copy(
        vllm_source,
        tmp_path / "vllm-new",
        V2,
        "def _compute_slot_mappings_kernel(\n",
        "def _compute_slot_mappings_kernel(\n    new_first_argument,\n",
    )
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "vllm", "--vllm-source", str(copy)]) == 2
    assert "_compute_slot_mappings_kernel is (new_first_argument, max_num_tokens" in capsys.readouterr().err


def test_vllm_code_that_raises_in_a_rank_is_exit_3_naming_rank_and_function(capsys, tmp_path, vllm_source):
    copy = patched_copy(
        vllm_source,
        tmp_path / "vllm-raises",
        V2,
        "    kv_block_size = tl.load(block_sizes + group_id)\n",
        "    kv_block_size = tl.load(block_sizes + group_id)\n    raise RuntimeError('planted failure')\n",
    )
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "vllm", "--vllm-source", str(copy)]) == 3
    err = capsys.readouterr().err
    assert "rank" in err and "_compute_slot_mappings_kernel raised" in err and "planted failure" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--vllm-source", "/nonexistent/vllm-tree"], "no such directory"),
        (["--vllm-source", "/tmp"], "no vllm/ package in this directory"),
        ([], "needs --vllm-source DIR"),
    ],
)
def test_a_bad_source_is_exit_2(capsys, monkeypatch, argv, message):
    monkeypatch.delenv("DCPSIM_VLLM_SOURCE", raising=False)
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "vllm", *argv]) == 2
    assert message in capsys.readouterr().err


def test_engine_info_and_fetch(capsys, vllm_source, monkeypatch):
    monkeypatch.setenv("DCPSIM_VLLM_SOURCE", str(vllm_source))
    assert main(["engine", "info", "--engine", "vllm", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["version"] == "0.33.0" and info["source"] == str(vllm_source)
    assert "vllm.v1.worker.gpu.block_table" in info["loaded"] and info["stubbed"]
    assert "spec classes" in info["decisions"]["group_geometry"]
    assert "cp_lse_ag_out_rs" in info["decisions"]["merge_across_ranks"]  # --vllm-merge vllm, the default
    assert "KVCacheManager" in info["decisions"]["make_scheduler"]  # --vllm-scheduler manager, the default
    assert "vllm.v1.core.kv_cache_manager" in info["loaded"]
    assert main(["engine", "info", "--engine", "vllm", "--vllm-scheduler", "dcpsim", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["decisions"]["prefix_key_position"] == "reference" and info["decisions"]["make_scheduler"].startswith("reference")
    assert "scheduler_decisions" not in info
    assert main(["engine", "info", "--engine", "vllm", "--vllm-scheduler", "full"]) == 0
    text = capsys.readouterr().out
    assert "vllm.v1.core.sched.scheduler" in text.split("loaded:")[1].splitlines()[0]
    assert "  scheduler decisions:\n" in text
    assert "    preemption under pressure and its victim: vllm.v1.core.sched.scheduler.Scheduler.schedule" in text
    assert main(["engine", "fetch", "vllm==0.33.0", "--dest", str(vllm_source)]) == 0  # already there
    assert capsys.readouterr().out.strip() == str(vllm_source)


@pytest.mark.parametrize("planted", [False, True])
def test_kernel_block_tables_through_vllm(capsys, tmp_path, vllm_source, planted):
    source = vllm_source
    if planted:  # kernel block j of KV block b taken as b + j instead of b * (B / Bk) + j
        source = patched_copy(
            vllm_source,
            tmp_path / "vllm-bug",
            "vllm/v1/worker/utils.py",
            "alpha=self.kernel_block_stride or blocks_per_kv_block,",
            "alpha=1,",
        )
    code, report = vllm_run(
        capsys, source, "dsv3", "--dcp", "2", "--interleave", "16", "--block-size", "64", "--kernel-block-size", "16", "--attention"
    )
    assert "map_to_kernel_block_table" in report["engine"]["decisions"]["kernel_block_table"]
    if planted:
        assert code == 1 and report["failure"]["kind"] == "attention-mismatch", report["failure"]
    else:
        assert code == 0, report.get("failure")


@pytest.mark.parametrize("W", [1, 2, 4, 8])
def test_vllms_spec_classes_agree_with_the_spec_model(vllm_source, W):
    """Sharded or not, manager block size, table width, page bytes and per-request memory of
    every group of every built-in: vLLM 0.33.0's spec classes and dcpsim.model.specs agree."""
    from dcpsim.engine.vllm.adapter import VllmEngine
    from support.helpers import geometries

    engine = VllmEngine(str(vllm_source))
    fields = ("sharded", "manager_block_size", "block_table_width", "page_size_bytes", "max_memory_usage_bytes")
    for name in builtin_names_at(W):
        sc = builtin(name, W, 1)
        for ref, got in zip(geometries(sc), geometries(sc, engine)):
            assert [getattr(got, f) for f in fields] == [getattr(ref, f) for f in fields], (name, ref.name)
            assert got.page_size_bytes > 0 and got.max_memory_usage_bytes > 0
