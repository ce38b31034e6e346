"""``--engine sglang``: SGLang 0.5.23's own code (fetched by the ``sglang_source`` fixture, never
skipped) runs inside the gloo ranks and gets the reference engine's verdicts where SGLang can
run the scenario (exit 2 quoting SGLang's rule where it cannot); ``mla-norope`` fails on the
released kernel (sglang#36886) and passes with it fixed; copies of the source with a planted
bug fail with the right kind; a broken source tree ends clearly."""

from __future__ import annotations

import json

import pytest
from test_vllm_engine import patched_copy

from dcpsim.cli import main
from dcpsim.errors import ConfigError
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from support.helpers import builtin, builtin_names_at
from support.reference_runs import reference_run

pytestmark = [pytest.mark.network, pytest.mark.slow]

WRITES = "sglang/kernels/ops/kvcache/mla_buffer.py"
LAYOUT = "sglang/srt/layers/dcp/layout.py"
KERNELS = "sglang/kernels/ops/attention/dcp_kernels.py"
REFUSED = {
    "compressed-prefix": "a pooled index key spans",  # records of several positions
    "dsv41-hybrid": "a pooled index key spans",
    "heavy-rejection": "a pooled index key spans",
    "dsv3-mtp": "A replicated draft indexes",  # a draft the scenario shards with the target
    "glm-pcp2-dcp2": "does not support --enable-prefill-cp",
    "gqa-pcp2-heads": "does not support --enable-prefill-cp",
    "dsv32-sparse": "The index-K buffer is replicated under DCP",  # vLLM's sharded indexer
}
"""Built-ins SGLang cannot run as the scenario says, with the words of SGLang's rule."""
NOROPE_FIX = (
    "        BLOCK = triton.next_power_of_2(nope_dim)\n        grid = (n_loc, 1)\n",
    "        owned = loc % dcp_world_size == dcp_rank\n"
    "        loc, cache_k_nope = loc[owned] // dcp_world_size, cache_k_nope[owned]\n"
    "        BLOCK = triton.next_power_of_2(nope_dim)\n        grid = (loc.numel(), 1)\n",
)
"""The owner rule in the no-rope branch of ``_set_mla_kv_buffer_impl``: keep this rank's ids
and collapse them, as the rope kernel does (what sglang#36886 asks for)."""


def sglang_run(capsys, source, *argv) -> tuple[int, dict]:
    """``run ARGV --engine sglang`` with a process-group timeout of 120 s: SGLang's kernels under
    Triton's interpreter on a loaded machine (the test suite's own workers) can hold a rank
    past the default 30 s."""
    code = main(["run", *argv, "--engine", "sglang", "--sglang-source", str(source), "--json", "--timeout", "120"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("W", [2, 4])
def test_builtins_get_the_reference_verdicts_or_sglangs_reason(sglang_source, W):
    jobs, names, refused = [], [], {}
    valid = builtin_names_at(W)  # gqa-pcp2-heads's heads are refused at W = 4 (exit 2 before SGLang)
    for name in valid:
        try:
            jobs.append(Job.from_options(builtin(name, W), engine="sglang", sglang_source=str(sglang_source), timeout=120))
            names.append(name)
        except ConfigError as exc:
            refused[name] = str(exc)
    assert set(refused) == set(REFUSED) & set(valid), refused
    for name, message in refused.items():
        assert "SGLang 0.5.23 cannot run this" in message and REFUSED[name] in message, message
        assert "SGLang's rule: sglang/" in message, message
    for name, got in zip(names, run_jobs(jobs)):  # one world per W: every job's ranks share it
        ref = reference_run(builtin(name, W))
        assert ref.passed, name
        assert got.engine["name"] == "sglang" and got.engine["version"] == "0.5.23"
        if name == "llama-gqa":  # MHA writes through SGLang's Triton backend (test_mha_writes_run_sglangs_backend_and_pool's release run)
            assert "TritonAttnBackend._set_kv_buffer" in got.engine["decisions"]["write_slots"], got.engine["decisions"]
        if name == "mla-norope":  # sglang#36886: caught, not the reference's verdict
            _is_sglang_36886(got.failure, got.text())
            continue
        want = (ref.passed, ref.steps, ref.verified_indices)
        have = (got.passed, got.steps, got.verified_indices)
        assert have == want, f"{name}: sglang {have} vs reference {want}\n{got.text()}"


@pytest.mark.parametrize("name", ["dsv3", "llama-gqa"])
def test_attention_with_sglangs_local_lengths(capsys, sglang_source, name):
    """The default merge alternates allgather and alltoall: on dsv3 both of SGLang's MLA merges
    pass on gloo (the release runs of ``test_the_alltoall_merge_runs_sglangs_combine`` and
    ``test_sglangs_merges_let_a_nan_empty_shard_through_and_dcpsim_says_so`` until issue 29)."""
    code, report = sglang_run(capsys, sglang_source, name, "--dcp", "2", "--attention")
    assert code == 0, report.get("failure")
    assert report["attention_checks"] > 10 and report["attention_max_error"] < 1e-4
    assert "get_dcp_chain_spec_lens" in report["engine"]["decisions"]["query_local_bounds"]
    if name == "dsv3":  # the alltoall steps merged by SGLang's combine, the allgather ones by correct_attn_out
        merges = report["attention_merges"]
        assert merges.get("alltoall", 0) > 0 and merges.get("allgather", 0) > 0, merges
        merged = report["attention_merged_by"]["sglang.kernels.ops.attention.dcp_kernels.dcp_lse_combine_triton"]
        assert merged["merges"] == merges["alltoall"] and 0 < merged["rows"] <= merged["of"], report["attention_merged_by"]


def test_npu_deals_whole_pages_and_cuda_refuses_an_interleave(capsys, sglang_source):
    code, report = sglang_run(capsys, sglang_source, "llama-gqa", "--dcp", "2", "--interleave", "16", "--sglang-platform", "npu")
    assert code == 0, report.get("failure")
    assert "localize_dcp_indices" in report["engine"]["decisions"]["write_slots"]
    code = main(["run", "dsv3", "--dcp", "2", "--interleave", "16", "--engine", "sglang", "--sglang-source", str(sglang_source)])
    err = capsys.readouterr().err
    assert code == 2 and "mla_buffer.py:42" in err and "loc % DCP_WORLD_SIZE == DCP_RANK" in err, err
    code = main(["run", "dsv3", "--dcp", "2", "--engine", "sglang", "--sglang-platform", "npu", "--sglang-source", str(sglang_source)])
    err = capsys.readouterr().err
    assert code == 2 and "interleave_size=self.page_size" in err, err


def _is_sglang_36886(failure, text: str) -> None:
    """``mla-norope --dcp 2`` on the release (the W = 2 sweep's run): a write violation naming the
    first bad position and the rank that wrote it."""
    assert failure is not None and failure.kind == "write-violation", text
    assert failure.index is not None and failure.details[0].startswith("rank "), text
    assert f"index {failure.index} " in " ".join(failure.details), text


def test_mla_norope_is_sglang_36886(capsys, tmp_path, sglang_source):
    """The release fails (``_is_sglang_36886``, in the W = 2 sweep's world:
    ``test_builtins_get_the_reference_verdicts_or_sglangs_reason[2]``); the reference and the
    release with the owner rule planted pass."""
    assert main(["run", "mla-norope", "--dcp", "2", "--in-process"]) == 0  # the reference engine passes
    capsys.readouterr()
    fixed = patched_copy(sglang_source, tmp_path / "sglang-fixed", WRITES, *NOROPE_FIX)
    code, report = sglang_run(capsys, fixed, "mla-norope", "--dcp", "2")
    assert code == 0, report.get("failure")


@pytest.mark.parametrize(
    "rel,old,new,argv,kinds",
    [
        # the rope Triton kernel writes one row too far (the sampled tokens)
        (
            WRITES,
            "    safe_loc = safe_loc // DCP_WORLD_SIZE\n",
            "    safe_loc = safe_loc // DCP_WORLD_SIZE + 1\n",
            (),
            ("write-violation", "wrong-content"),
        ),
        # the torch scatter keeps every id, not only this rank's (the tokens off the sample)
        (
            WRITES,
            "        is_valid &= loc % dcp_world_size == dcp_rank\n",
            "        is_valid &= loc >= 0\n",
            (),
            ("write-violation", "wrong-content"),
        ),
        # get_dcp_lens counts one position too many on every rank
        (
            LAYOUT,
            "        return full_cycles * interleave_size + rank_remainder\n",
            "        return full_cycles * interleave_size + rank_remainder + 1\n",
            ("--attention",),
            ("attention-metadata", "attention-mismatch"),
        ),
        # the per-token read builder skips the rank's first key and reads one past its last
        (
            KERNELS,
            "        abs_pos = first + offset * dcp_size\n",
            "        abs_pos = first + offset * dcp_size + dcp_size\n",
            ("--attention",),
            ("attention-mismatch",),
        ),
        # the MLA page table strides by P pages instead of P * W positions
        (
            KERNELS,
            "    global_positions = DCP_RANK + page_offsets * PHYSICAL_PAGE_SIZE * DCP_SIZE\n",
            "    global_positions = DCP_RANK + page_offsets * PHYSICAL_PAGE_SIZE\n",
            (),
            ("attention-metadata",),
        ),
        # correct_attn_out weighs a base-2 LSE with exp, not exp2
        (
            KERNELS,
            "    factor = tl.exp(lse_diff) if IS_LSE_BASE_ON_E else tl.exp2(lse_diff)\n",
            "    factor = tl.exp(lse_diff)\n",
            ("--attention", "--attention-merge", "allgather"),
            ("attention-mismatch",),
        ),
    ],
    ids=["rope-kernel-row", "scatter-owner-rule", "get-dcp-lens", "token-read-builder", "mla-page-table", "correct-attn-out"],
)
def test_planted_bugs_are_caught(capsys, tmp_path, sglang_source, rel, old, new, argv, kinds):
    copy = patched_copy(sglang_source, tmp_path / "sglang-bug", rel, old, new)
    code, report = sglang_run(capsys, copy, "dsv3", "--dcp", "2", *argv)
    assert code == 1 and report["failure"]["kind"] in kinds, report["failure"]


def test_a_source_that_does_not_import_is_exit_2_naming_file_and_line(capsys, tmp_path, sglang_source):
    copy = patched_copy(sglang_source, tmp_path / "sglang-broken", LAYOUT, "def get_dcp_lens(\n", "def get_dcp_lens(:\n")
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "sglang", "--sglang-source", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "sglang/srt/layers/dcp/layout.py:23" in err and "SyntaxError" in err, err
    copy = patched_copy(sglang_source, tmp_path / "sglang-old", LAYOUT, "def get_dcp_lens(\n", "def get_dcp_lengths(\n")
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "sglang", "--sglang-source", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "local_seq_lens: found sglang/srt/layers/dcp/layout.py has no get_dcp_lens" in err and "0.5.22..0.5.23" in err, err
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "sglang", "--sglang-source", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_sglang_code_that_raises_in_a_rank_is_exit_3_naming_rank_and_function(capsys, tmp_path, sglang_source):
    copy = patched_copy(
        sglang_source,
        tmp_path / "sglang-raises",
        LAYOUT,
        "    cycle_size = dcp_size * interleave_size\n",
        "    cycle_size = dcp_size * interleave_size\n    raise RuntimeError('planted failure')\n",
    )
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "sglang", "--sglang-source", str(copy)]) == 3
    err = capsys.readouterr().err
    assert "rank" in err and "SglangCallError: SGLang get_dcp_" in err and "raised RuntimeError: planted failure" in err, err


def test_engine_info_names_sglangs_functions(capsys, sglang_source):
    assert main(["engine", "info", "--engine", "sglang", "--sglang-source", str(sglang_source), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["version"] == "0.5.23"
    # the MHA write modules load on the first sharded MHA write; an engine this process built
    # earlier (one build per process and source, engine.loading.forkserver) may have them already
    core = ["sglang.kernels.ops.attention.dcp_kernels", "sglang.kernels.ops.kvcache.mla_buffer", "sglang.srt.layers.dcp.layout"]
    mha = ["sglang.srt.layers.attention.triton_backend", "sglang.srt.mem_cache.memory_pool"]
    assert info["loaded"] in (core, sorted(core + mha)), info["loaded"]
    assert "set_mla_kv_buffer_dcp_sharded_triton" in info["decisions"]["write_slots"]
    assert "get_dcp_lens" in info["decisions"]["local_seq_lens"]
    assert main(["engine", "fetch", "sglang==0.5.23"]) == 0  # already there: prints the folder
    assert capsys.readouterr().out.strip() == str(sglang_source)


def test_matrix_skips_the_cells_sglang_refuses(capsys, sglang_source):
    argv = ["matrix", "mla-norope", "--dcp", "2", "--interleave", "1,16", "--engine", "sglang", "--sglang-source", str(sglang_source)]
    assert main(argv) == 1  # the il1 cell: sglang#36886
    out = capsys.readouterr().out
    assert "mla-norope-dcp2-il16-bs64  skipped" in out and "the engine refuses it: SGLang 0.5.23 cannot run this" in out, out
    assert "mla-norope-dcp2-il1-bs64   fail" in out, out


def test_selftest_skips_the_baselines_sglang_refuses(capsys, sglang_source):
    """The faults run everywhere they apply (variants of the reference engine); the baselines
    run SGLang, and one it refuses (heavy-rejection's pooled records) is skipped with SGLang's
    reason instead of ending the selftest in exit 2."""
    argv = ["selftest", "--engine", "sglang", "--sglang-source", str(sglang_source), "--in-process", "--json"]
    argv += ["--fault", "interleave-off-by-one", "--scenario", "dsv3", "--scenario", "heavy-rejection"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    baselines = {r["scenario"]: r["outcome"] for r in doc["rows"] if r["fault"] == "none"}
    assert baselines == {"dsv3": "pass"}, doc["rows"]
    refused = [s for s in doc["skipped"] if s["scenario"] == "heavy-rejection" and s["fault"] == "none"]
    assert refused and "the engine refuses it: SGLang 0.5.23 cannot run this" in refused[0]["reason"], doc["skipped"]


@pytest.mark.parametrize("W", [2, 4])
def test_threads_of_one_process_are_each_their_own_rank(capsys, sglang_source, W):
    """--in-process ranks are threads of one process: SGLang's get_parallel() must give each
    its own rank while its write kernel runs (one process-wide record made ranks write each
    other's rows: write violations at W = 2)."""
    code, report = sglang_run(capsys, sglang_source, "dsv3", "--dcp", str(W), "--in-process")
    assert code == 0, report.get("failure")


def test_fuzz_draws_only_what_sglang_runs(capsys, sglang_source):
    argv = ["fuzz", "--engine", "sglang", "--sglang-source", str(sglang_source), "--examples", "4", "--seed", "1", "--in-process"]
    assert main(argv) == 0, capsys.readouterr().err
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert lines and all(" W=1 " in line or " I=1 " in line for line in lines), lines


COMBINE = "sglang/kernels/ops/attention/dcp_kernels.py"


def test_the_alltoall_merge_runs_sglangs_combine(capsys, tmp_path, sglang_source):
    """Every received partial state added unweighted: an attention failure. The release passes
    with its combine merging the alltoall steps: ``test_attention_with_sglangs_local_lengths[dsv3]``."""
    unweighted = ("        acc += partial_out * w\n", "        acc += partial_out\n")
    source = patched_copy(sglang_source, tmp_path / "sglang-bug", COMBINE, *unweighted)
    code, report = sglang_run(capsys, source, "dsv3", "--dcp", "2", "--attention", "--attention-merge", "alltoall")
    assert code == 1 and report["failure"]["kind"] == "attention-mismatch", report["failure"]
    assert "dcp_lse_combine_triton" in json.dumps(report["attention_merged_by"]), report["attention_merged_by"]


@pytest.mark.parametrize("merge", ["allgather", "alltoall"])
def test_sglangs_merges_let_a_nan_empty_shard_through_and_dcpsim_says_so(capsys, monkeypatch, sglang_source, merge):
    """A shard with no key whose output row is NaN (what SGLang's Triton decode kernel stores,
    ``acc / e_sum`` with ``e_sum = 0``): neither ``correct_attn_out`` nor
    ``dcp_lse_combine_triton`` guards ``0 * NaN``, so the merged rows they make are NaN and the
    run ends in an attention failure (exit 1), not a crash; dcpsim's own shard output (0 there)
    passes with either merge: ``test_attention_with_sglangs_local_lengths[dsv3]`` (the default merge
    alternates allgather and alltoall, on gloo)."""
    monkeypatch.setenv("DCPSIM_SGLANG_SOURCE", str(sglang_source))
    argv = ["run", "dsv3", "--dcp", "2", "--attention", "--attention-merge", merge, "--in-process", "--json"]
    code = main([*argv, "--engine", "support.sglang_nan_shards:NanShardsSglangEngine"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["failure"]["kind"] == "attention-mismatch", report["failure"]
    failure = report["failure"]
    assert failure["error"] == "inf" and any(c["keys"] == 0 for c in failure["contributions"]), failure  # NaN counts as inf


def test_sglangs_index_builders_decide_the_reads(capsys, sglang_source):
    code, report = sglang_run(capsys, sglang_source, "dsv3", "--dcp", "4", "--attention", "--attention-merge", "allgather")
    assert code == 0, report.get("failure")
    decisions = report["engine"]["decisions"]
    assert "create_triton_kv_indices_for_dcp_triton" in decisions["attention_metadata"]
    assert "create_mla_kv_page_table_for_dcp" in decisions["build_attention_metadata"]
    assert "correct_attn_out" in decisions["merge_across_ranks"] and "in base 2" in decisions["merge_across_ranks"]
    assert report["attention"]["lse_base"] == "2", report["attention"]


BACKEND = "sglang/srt/layers/attention/triton_backend.py"
POOL = "sglang/srt/mem_cache/memory_pool.py"


@pytest.mark.parametrize(
    "rel,old,new",
    [
        # the Triton backend's MHA write keeps every token, not only this rank's
        (
            BACKEND,
            "dcp_kv_mask = forward_batch.positions % self.dcp_size == self.dcp_rank\n",
            "dcp_kv_mask = forward_batch.positions >= 0\n",
        ),
        # the pool's masked kernel stores K one row too far (the sampled tokens)
        (
            POOL,
            "tl.store(k_buffer_ptr + loc * k_buffer_stride + idx, key, mask=mask)\n",
            "tl.store(k_buffer_ptr + (loc + 1) * k_buffer_stride + idx, key, mask=mask)\n",
        ),
    ],
    ids=["mha-backend-mask", "mha-pool-kernel"],
)
def test_mha_writes_run_sglangs_backend_and_pool(capsys, tmp_path, sglang_source, rel, old, new):
    """The release's run (llama-gqa at W = 2, I = 1, its writes by ``TritonAttnBackend._set_kv_buffer``)
    passes in the W = 2 sweep, ``test_builtins_get_the_reference_verdicts_or_sglangs_reason[2]``."""
    copy = patched_copy(sglang_source, tmp_path / "sglang-bug", rel, old, new)
    code, report = sglang_run(capsys, copy, "llama-gqa", "--dcp", "2")
    assert code == 1 and report["failure"]["kind"] in ("write-violation", "wrong-content"), report["failure"]


def test_an_lse_base_other_than_sglangs_is_exit_2_quoting_its_rule(capsys, sglang_source):
    code = main(
        ["run", "dsv3", "--dcp", "2", "--attention", "--lse-base", "e", "--engine", "sglang", "--sglang-source", str(sglang_source)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "computes base-2 LSEs" in err and "is_mla_dcp_lse_base_on_e('flashinfer') is False" in err, err


def test_a_w_sglangs_mla_merge_cannot_launch_is_exit_2_quoting_its_rule(capsys, sglang_source):
    code = main(["run", "dsv3", "--dcp", "3", "--engine", "sglang", "--sglang-source", str(sglang_source)])
    err = capsys.readouterr().err
    assert code == 2 and 'dcp_kernels.py:418: "N_ROUNDED": N,' in err and "power of two" in err, err
    code, report = sglang_run(capsys, sglang_source, "llama-gqa", "--dcp", "3")  # MHA: SGLang's torch merge takes any W
    assert code == 0, report.get("failure")
