"""``--engine vllm-ascend``: vllm-ascend 0.23.0.post1's own DCP code over vLLM 0.23.0, both fetched
(``engine fetch vllm-ascend``: the source archive's Python files; never skipped). The plugin's
slot mapping, local lengths, spec-decode mask and merge give the reference's verdicts at W = 2 and 4
(attention too) where its mask is right (I = 1); at I > 1 its MTP verify mask fails the
``attention-mask`` check (bug class 39, still in the release), and passes with the fix planted; a bug
planted in a copy of the slot mapping, the local lengths or the merge makes the run exit 1; the
plugin over another vLLM release is exit 2."""

from __future__ import annotations

import pytest

import dcpsim
from dcpsim.cli import main
from dcpsim.engine.vllm_ascend.releases import NEWEST, VLLM_OF
from support.helpers import patched_copy

CASES = [
    ("dsv3", dict(dcp=2)),
    ("dsv3", dict(dcp=4)),
    ("llama-gqa", dict(dcp=2, attention=True)),
    ("llama-gqa", dict(dcp=4, attention=True)),
]


@pytest.fixture(scope="module")
def trees(release_source):
    return str(release_source("vllm-ascend", NEWEST)), str(release_source("vllm", VLLM_OF[NEWEST]))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for n, o in CASES])
def test_the_plugin_gives_the_reference_verdict(name, options, trees):
    ascend, vllm = trees
    report = dcpsim.run(name, engine="vllm-ascend", vllm_ascend_source=ascend, vllm_source=vllm, **options)
    reference = dcpsim.run(name, **options)
    assert (report.passed, report.failure and report.failure.kind) == (reference.passed, reference.failure and reference.failure.kind), (
        report.text()
    )
    decisions = report.to_dict()["engine"]["decisions"]
    assert decisions["write_slots"].startswith("vllm-ascend vllm_ascend/worker/block_table.py::BlockTable._compute_pcp_dcp_slot_mapping")
    assert decisions["local_seq_lens"] == "vllm-ascend vllm_ascend/worker/pcp_utils.py::PCPManager._get_cp_local_seq_lens"
    assert decisions["spec_decode_mask"].startswith("vllm-ascend vllm_ascend/worker/pcp_utils.py::PCPManager.generate_mtp_attention_mask")
    if options.get("attention"):  # every merge is the plugin's: its all-to-all and combine, over the rank's group
        assert decisions["merge_across_ranks"].startswith(
            "vllm-ascend vllm_ascend.attention.context_parallel.common_cp._process_attn_out_lse"
        )
        assert "_npu_attention_update" in report.text() and "merges" in report.text(), report.text()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "file, old, new",
    [
        ("vllm_ascend/worker/block_table.py", "mask = virtual_block_offsets // self.cp_kv_cache_interleave_size %",
         "mask = (virtual_block_offsets + 1) // self.cp_kv_cache_interleave_size %"),
        ("vllm_ascend/worker/pcp_utils.py", "        remainder = seq_lens_tiled - base * total_world_size\n",
         "        base = base + 1\n        remainder = seq_lens_tiled - (base - 1) * total_world_size\n"),
        ("vllm_ascend/attention/context_parallel/common_cp.py", "    x = x.permute(0, 2, 1, 3, 4).contiguous()\n",
         "    x = x.contiguous()\n"),
    ],
    ids=["slot-mapping", "local-lengths", "merge"],
)  # fmt: skip
def test_a_bug_planted_in_the_plugin_fails_the_run(file, old, new, capsys, tmp_path, trees):
    ascend, vllm = trees
    copy = patched_copy(ascend, tmp_path / "ascend-bug", file, old, new)
    argv = ["run", "dsv3", "--dcp", "2", "--attention", "--engine", "vllm-ascend", "--vllm-ascend-source", str(copy), "--vllm-source", vllm]
    assert main(argv) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.dist
@pytest.mark.slow
def test_the_plugin_over_another_vllm_release_is_exit_2(capsys, trees, release_source):
    ascend, _ = trees
    other = str(release_source("vllm", "0.33.0"))
    assert main(["run", "dsv3", "--dcp", "2", "--engine", "vllm-ascend", "--vllm-ascend-source", ascend, "--vllm-source", other]) == 2
    assert "vllm-ascend 0.23.0.post1 runs on vLLM 0.23.0" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.slow
def test_the_platform_interleave_rule_is_quoted(capsys, trees):
    """vllm-ascend's platform overrides the interleave to the block size for sparse attention
    under DCP: a run at another interleave is exit 2 quoting the platform's line."""
    ascend, vllm = trees
    argv = ["run", "dsv32-sparse", "--dcp", "2", "--engine", "vllm-ascend", "--vllm-ascend-source", ascend, "--vllm-source", vllm]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "vllm_ascend/platform.py:" in err and "Override cp_kv_cache_interleave_size to" in err and "--interleave 64" in err, err


MASK = "vllm_ascend/worker/pcp_utils.py"
MASK_FIX = (
    (
        '        k_lens = torch.div(max_indices - cp_rank, cp_size, rounding_mode="floor") + 1\n',
        "        interleave = self.vllm_config.parallel_config.cp_kv_cache_interleave_size\n"
        "\n"
        "        def owned_below(n):\n"
        "            runs = (n + interleave - 1) // interleave\n"
        "            mine = torch.where(runs > cp_rank, (runs - 1 - cp_rank) // cp_size + 1, torch.zeros_like(runs))\n"
        "            last = runs - 1\n"
        "            mine_last = (runs > 0) & (last % cp_size == cp_rank)\n"
        "            cut = torch.where(mine_last, interleave - (n - last * interleave), torch.zeros_like(n))\n"
        "            return mine * interleave - cut\n"
        "\n"
        "        k_lens = owned_below(total_lens)\n",
    ),
    (
        "        k_upper = (context_lens[:, None] + q_indices - cp_rank) // cp_size\n",
        "        k_upper = owned_below(context_lens[:, None] + q_indices + 1) - 1\n",
    ),
    (
        "        full_mask = (k_idx_expanded > k_upper_expanded) & (k_upper_expanded >= 0)\n",
        "        full_mask = k_idx_expanded > k_upper_expanded\n",
    ),
)
"""The interleave-aware count planted in ``generate_mtp_attention_mask_for_decode`` (what
vllm-ascend#11492 and #11849 fix on main): a rank's keys below a length, by runs of ``I``."""


@pytest.fixture(scope="module")
def fixed_mask(trees, tmp_path_factory):
    ascend, _ = trees
    return str(patched_copy(ascend, tmp_path_factory.mktemp("ascend") / "fixed-mask", MASK, *MASK_FIX[0], *MASK_FIX[1:]))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options", [("mtp-mask-interleave", {}), ("dsv3", dict(dcp=4, interleave=8))], ids=["mtp-mask-interleave", "dsv3-dcp4-i8"]
)
def test_the_releases_verify_mask_fails_at_an_interleave_and_the_fix_passes(name, options, trees, fixed_mask):
    ascend, vllm = trees
    assert dcpsim.run(name, **options).passed
    report = dcpsim.run(name, engine="vllm-ascend", vllm_ascend_source=ascend, vllm_source=vllm, **options)
    assert not report.passed and report.failure.kind == "attention-mask", report.text()
    assert "the query at position" in report.text() and "the key at position" in report.text(), report.text()
    if name == "mtp-mask-interleave":  # the scenario's own case: a later draft on rank 1, a lost key on rank 0
        assert "rank 1 step 1" in report.text() and "the query at position 250 sees the key at position 251" in report.text()
    fixed = dcpsim.run(name, engine="vllm-ascend", vllm_ascend_source=fixed_mask, vllm_source=vllm, **options)
    assert fixed.passed, fixed.text()
