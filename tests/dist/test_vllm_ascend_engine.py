"""``--engine vllm-ascend``: vllm-ascend 0.23.0.post1's own DCP code over vLLM 0.23.0, both fetched
(``engine fetch vllm-ascend``: the source archive's Python files; never skipped). The plugin's
slot mapping and local lengths give the reference's verdicts at W = 2 and 4 (attention too); a bug
planted in a copy of either makes the run exit 1; the plugin over another vLLM release is exit 2."""

from __future__ import annotations

import pytest

import dcpsim
from dcpsim.cli import main
from dcpsim.engine.vllm_ascend.releases import NEWEST, VLLM_OF
from support.helpers import patched_copy

CASES = [
    ("dsv3", dict(dcp=2)),
    ("dsv3", dict(dcp=4, interleave=8)),
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


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "file, old, new",
    [
        ("vllm_ascend/worker/block_table.py", "mask = virtual_block_offsets // self.cp_kv_cache_interleave_size %",
         "mask = (virtual_block_offsets + 1) // self.cp_kv_cache_interleave_size %"),
        ("vllm_ascend/worker/pcp_utils.py", "        remainder = seq_lens_tiled - base * total_world_size\n",
         "        base = base + 1\n        remainder = seq_lens_tiled - (base - 1) * total_world_size\n"),
    ],
    ids=["slot-mapping", "local-lengths"],
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
