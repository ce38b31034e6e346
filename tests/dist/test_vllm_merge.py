"""``--engine vllm --attention``: every cross-rank merge runs vLLM's own combine wrappers
(``cp_lse_ag_out_rs``, ``dcp_a2a_lse_reduce``) over the rank's group, in the LSE base of
the chosen attention backend read from vLLM's source; copies of vLLM's source with a bug
planted in a wrapper fail with an attention mismatch while the clean tree passes."""

from __future__ import annotations

import pytest
from test_vllm_engine import patched_copy
from test_vllm_engine import vllm_run as _vllm_run

pytestmark = pytest.mark.slow  # gloo worlds running an engine's kernels; the fast loop leaves them out

DCP = "vllm/v1/attention/ops/dcp.py"
ALLGATHER = "vllm.v1.attention.ops.dcp.cp_lse_ag_out_rs"
ALLTOALL = "vllm.v1.attention.ops.dcp.dcp_a2a_lse_reduce"


def vllm_run(capsys, source, *argv):
    """A run with a deadline for a loaded machine: the interpreter's merges are CPU-bound."""
    return _vllm_run(capsys, source, *argv, "--deadline", "900")


def test_every_merge_runs_vllms_wrappers(capsys, vllm_source):
    """At W = 4, the default merge alternating both wrappers (at W = 2 each wrapper's run alone:
    ``test_the_clean_tree_passes_each_merge_alone``)."""
    code, report = vllm_run(capsys, vllm_source, "dsv3", "--dcp", "4", "--attention")
    assert code == 0, report.get("failure")
    by, merges = report["attention_merged_by"], report["attention_merges"]
    assert by[ALLGATHER]["merges"] == merges["allgather"] > 5 and by[ALLTOALL]["merges"] == merges["alltoall"] > 5
    _merged_by_vllm_in_base_e(report)


def _merged_by_vllm_in_base_e(report) -> None:
    for tally in report["attention_merged_by"].values():  # a sample of the rows of the big merges, every row of the small ones
        assert 0 < tally["rows"] < tally["of"], report["attention_merged_by"]
    assert report["attention"]["lse_base"] == "e"  # FLASHMLA, the default backend
    assert "is_lse_base_on_e=True (FLASHMLA)" in report["engine"]["decisions"]["merge_across_ranks"]


def test_a_base_2_backend_runs_the_wrappers_in_base_2(capsys, vllm_source):
    code, report = vllm_run(capsys, vllm_source, "dsv3", "--dcp", "2", "--attention", "--vllm-attention-backend", "TOKENSPEED_MLA")
    assert code == 0, report.get("failure")
    assert report["attention"]["lse_base"] == "2"
    assert "tokenspeed_mla.py:180" in report["engine"]["decisions"]["shard_lse"]


TINY = """
name = "tiny-decode"
[config]
max_model_len = 256
max_num_batched_tokens = 64
decode_context_parallel_size = 2
cp_kv_cache_interleave_size = 4
num_speculative_tokens = 1
[[layers]]
name = "layers.{i}.attn"
layers = "0-1"
kind = "mla"
block_size = 16
head_size = 64
[[requests]]
id = "r{i}"
count = 2
prompt_len = 40
output_len = 12
"""


def test_every_row_runs_vllms_code_with_a_large_budget(capsys, tmp_path, vllm_source):
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY, encoding="utf-8")
    code, report = vllm_run(capsys, vllm_source, str(scenario), "--attention", "--vllm-merge-programs", "100000")
    assert code == 0, report.get("failure")
    assert all(t["rows"] == t["of"] for t in report["attention_merged_by"].values())


def test_the_reference_merge_on_request(capsys, vllm_source):
    code, report = vllm_run(capsys, vllm_source, "dsv3", "--dcp", "2", "--attention", "--vllm-merge", "reference")
    assert code == 0 and not report["attention_merged_by"], report.get("failure")


RS_CALL = (
    "        is_lse_base_on_e={base},\n        seq_lens=seq_lens,\n        query_start_loc=query_start_loc,\n"
    "    )\n    out = cp_group.reduce_scatter(out, dim=1)"
)
"""The end of ``cp_lse_ag_out_rs``'s call of ``_cp_lse_common``."""
PLANTED = [
    pytest.param(  # the all-gather wrapper hands the correction the other base
        RS_CALL.format(base="is_lse_base_on_e"),
        RS_CALL.format(base="not is_lse_base_on_e"),
        "allgather",
        id="wrapper-lse-base",
    ),
    pytest.param(  # every rank corrects its output as if it were rank 0
        "        cp_group.rank_in_group,\n        ctx,\n",
        "        0,\n        ctx,\n",
        "allgather",
        id="correction-rank",
    ),
    pytest.param(  # the rank's output no longer rescaled by its share of the merged LSE
        "lse_finally = lse_tmp - lse\n",
        "lse_finally = lse_tmp - lse_tmp\n",
        "allgather",
        id="correction-kernel",
    ),
    pytest.param(  # the all-to-all combine weights every shard by the max LSE, not the merged one
        "            weight = tl.exp(lse_val - global_lse)\n",
        "            weight = tl.exp(lse_val - lse_max)\n",
        "alltoall",
        id="a2a-weights",
    ),
    pytest.param(  # the pack sends each rank the heads of the next one
        "        src_head_idx = rank_idx * H_PER_RANK + local_head_idx\n",
        "        src_head_idx = ((rank_idx + 1) % N) * H_PER_RANK + local_head_idx\n",
        "alltoall",
        id="a2a-pack-heads",
    ),
]


@pytest.mark.parametrize("old,new,variant", PLANTED)
def test_a_bug_planted_in_a_combine_wrapper_is_caught(capsys, tmp_path, vllm_source, old, new, variant):
    copy = patched_copy(vllm_source, tmp_path / "vllm-bug", DCP, old, new)
    argv = ("dsv3", "--dcp", "2", "--attention", "--attention-merge", variant)
    code, report = vllm_run(capsys, copy, *argv)
    assert code == 1 and report["failure"]["kind"] == "attention-mismatch", report.get("failure")
    # the clean tree passes the same run: test_the_clean_tree_passes_each_merge_alone[variant]


@pytest.mark.parametrize("variant", ["allgather", "alltoall"])
def test_the_clean_tree_passes_each_merge_alone(capsys, vllm_source, variant):
    """The clean tree's run of each ``PLANTED`` bug (``--attention-merge VARIANT``) passes, every
    merge run by its wrapper (the default merge's run at W = 2, alternating both, was a test of
    its own until issue 29's third pass; ``test_every_merge_runs_vllms_wrappers`` runs it at W = 4)."""
    code, report = vllm_run(capsys, vllm_source, "dsv3", "--dcp", "2", "--attention", "--attention-merge", variant)
    assert code == 0, report.get("failure")
    by = report["attention_merged_by"]
    assert list(by) == [{"allgather": ALLGATHER, "alltoall": ALLTOALL}[variant]], by
    assert by[list(by)[0]]["merges"] == report["attention_merges"][variant] > 5, report["attention_merges"]
    _merged_by_vllm_in_base_e(report)
