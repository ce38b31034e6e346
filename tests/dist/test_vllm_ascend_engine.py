"""``--engine vllm-ascend``: vllm-ascend 0.23.0.post1's own DCP code over vLLM 0.23.0, both fetched
(``engine fetch vllm-ascend``: the source archive's Python files; never skipped). The plugin's
slot mapping, local lengths, spec-decode mask and merge give the reference's verdicts at W = 2 and 4
(attention too) where its mask is right (I = 1); at I > 1 its MTP verify mask fails the
``attention-mask`` check (bug class 39, still in the release), and passes with the fix planted; a bug
planted in a copy of the slot mapping, the local lengths or the merge makes the run exit 1; the
plugin over another vLLM release is exit 2. The MLA builder's chunked context (every request cut
alike, each piece padded to ``I`` per rank) passes the checker's any-valid-chunking rule, and a
chunk size planted undivided by DCP fails it. Every built-in the plugin runs gets the reference's
verdict at W = 2 and 4, with the attention check (``eagle-hybrid-hit`` fails as bug
class 40, the plugin's hybrid coordinator, and passes with the margin fix planted); the rest exit 2 quoting the rule of vllm-ascend or of
vLLM 0.23.0 that refuses them."""

from __future__ import annotations

import json
import re

import pytest

import dcpsim
from dcpsim.cli import main
from dcpsim.engine.vllm_ascend.releases import NEWEST, VLLM_OF
from dcpsim.errors import ConfigError
from dcpsim.harness.job import Job
from dcpsim.harness.runner import run_jobs
from support.helpers import builtin, builtin_names_at, patched_copy, run
from support.job_batch import job_of, run_batched

CASES = ("dsv3", "llama-gqa")
"""The built-ins whose every decision (the merge's too) is checked to be the plugin's, at W = 2 and 4
in the sweep's world (``test_builtins_get_the_reference_verdicts_or_the_plugins_reason``; until
issue 29 a test of their own, ``test_the_plugin_gives_the_reference_verdict``, one world each)."""


@pytest.fixture(scope="module")
def trees(release_source):
    return str(release_source("vllm-ascend", NEWEST)), str(release_source("vllm", VLLM_OF[NEWEST]))


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
        ("vllm_ascend/worker/block_table.py", "cdiv(max_model_len, block_size * total_cp_world_size)",
         "cdiv(max_model_len, block_size * total_cp_world_size * 2)"),
    ],
    ids=["slot-mapping", "local-lengths", "merge", "table-width"],
)  # fmt: skip
def test_a_bug_planted_in_the_plugin_fails_the_run(file, old, new, capsys, tmp_path, trees):
    ascend, vllm = trees
    copy = patched_copy(ascend, tmp_path / "ascend-bug", file, old, new)
    argv = ["run", "dsv3", "--dcp", "2", "--attention", "--engine", "vllm-ascend", "--vllm-ascend-source", str(copy), "--vllm-source", vllm]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    if "total_cp_world_size * 2" in new:  # rows of half the entries: the worker's table is judged at step 0
        assert "block table width (worker) is 16, expected >= 32" in out, out


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


@pytest.mark.dist
@pytest.mark.slow
def test_a_spec_class_refusal_under_dcpsims_scheduler_is_exit_2(capsys, trees):
    """Under --vllm-scheduler dcpsim no KV cache manager is built before the run, but the group
    geometries are: vLLM 0.23.0's spec classes refuse a replicated group there, not in a rank."""
    ascend, vllm = trees
    argv = ["run", "dsv41-hybrid", "--dcp", "2", "--engine", "vllm-ascend", "--vllm-ascend-source", ascend, "--vllm-source", vllm]
    assert main([*argv, "--vllm-scheduler", "dcpsim"]) == 2
    assert "SlidingWindowMLASpec has no dcp_sharded field" in capsys.readouterr().err


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
    jobs = [job_of(name, engine="vllm-ascend", vllm_ascend_source=tree, vllm_source=vllm, **options) for tree in (ascend, fixed_mask)]
    reference, report, fixed = run_batched([job_of(name, **options), *jobs])  # one world: the three runs in turn
    assert reference.passed, reference.text()
    assert not report.passed and report.failure.kind == "attention-mask", report.text()
    assert "the query at position" in report.text() and "the key at position" in report.text(), report.text()
    if name == "mtp-mask-interleave":  # the scenario's own case: a later draft on rank 1, a lost key on rank 0
        assert "rank 1 step 1" in report.text() and "the query at position 250 sees the key at position 251" in report.text()
    assert fixed.passed, fixed.text()


REFUSED = {
    "dsv32-sparse": 'vllm_ascend/platform.py:759: f"Override cp_kv_cache_interleave_size to {cache_config.block_size}."',
    "pd-dsv3": 'vllm_ascend/platform.py:751: "needs to be equal if use pcp or dcp > 1 in P/D disaggregate and kv pool scenario."',
    "pd-async-recycled": 'vllm_ascend/platform.py:751: "needs to be equal if use pcp or dcp > 1 in P/D disaggregate and kv pool scenario."',
    "dsv41-hybrid": "vllm.v1.kv_cache_interface.SlidingWindowMLASpec has no dcp_sharded field",
    "heavy-rejection": "vllm.v1.kv_cache_interface.SlidingWindowMLASpec has no dcp_sharded field",
    "gpt-oss-hybrid": "vllm.v1.kv_cache_interface.SlidingWindowSpec has no dcp_sharded field",
    "llama-draft": "vllm.v1.kv_cache_interface.FullAttentionSpec has no dcp_sharded field",  # the replicated draft
    "eagle-draft-hit": "vllm.v1.kv_cache_interface.FullAttentionSpec has no dcp_sharded field",  # the replicated draft
    "llama4-chunked": "vllm.v1.kv_cache_interface.ChunkedLocalAttentionSpec has no dcp_sharded field",
    "llama4-scout": "vllm.v1.kv_cache_interface.ChunkedLocalAttentionSpec has no dcp_sharded field",
    "llama4-chunked-prefix": "vllm.v1.kv_cache_interface.ChunkedLocalAttentionSpec has no dcp_sharded field",
}
"""Built-ins the plugin cannot run as the scenario says at the sweep's interleave (I = 1), with the
words of the rule: vllm-ascend's platform (sparse attention under DCP runs at I = B, a P/D run
asserts I = B), or vLLM 0.23.0's spec classes, which have no field to keep a group whole under DCP
(vllm-ascend's own specs have none either): a group the scenario replicates would be sharded; or
``glm-pcp2-dcp2`` runs at W = 2 (the plugin's PCP 2, DCP 1: its shards over PCP x DCP are then
dcpsim's); at W = 4 (TP 2) its shards would be ordered PCP-major (``REFUSED_AT``)."""
REFUSED_AT = {4: {"glm-pcp2-dcp2": "are ordered PCP-major (shard pcp_rank * 2 + dcp_rank)"}}
"""Built-ins refused at one W only: W -> name -> the words of the rule."""
KNOWN_BUGS = {"eagle-hybrid-hit": "prefix-hit-short"}
"""Built-ins whose failure under the plugin is a known upstream bug: name -> failure kind, under
the default ``--vllm-scheduler manager`` (the bug is the plugin's hybrid coordinator, bug class
40; under dcpsim's scheduler the run must match the reference). ``mtp-mask-interleave`` is not
here: the sweep runs every built-in at I = 1 (``builtin(name, W)``), where the plugin's MTP verify
mask is right, so it must match the reference; its failure at its own I = B = 128 is tested
above."""
MERGED_BY = "vllm-ascend vllm_ascend.attention.context_parallel.common_cp._npu_attention_update"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("W", [2, 4])
def test_builtins_get_the_reference_verdicts_or_the_plugins_reason(W, trees):
    """Every built-in the plugin runs, with the attention check, in one gloo world per W, twice: under the default
    ``--vllm-scheduler manager`` (vLLM 0.23.0's ``KVCacheManager`` with the plugin's coordinator,
    what ``--engine vllm-ascend`` runs) it gets the reference's verdict and finishes every request
    (on its own schedule: vLLM's one block pool preempts at other steps than dcpsim's per-group
    pools, ``qwen3-next-hybrid``, and its prefix hits are longer, ``prefix-sharing``); under
    ``--vllm-scheduler dcpsim`` (the reference's very schedule, only the plugin's worker side) the
    same steps, verified indices and attention checks. The attention check is cheap enough for the
    whole set; every row of a dense paged group (MLA, GQA) is merged by the plugin's code, the rows
    of sparse and compressed groups (which it never merges across ranks) by vLLM's path: under
    ``pytest -n 2`` on 2 cores (load average 6-8), 70 s at W = 2 and 85 s at W = 4 (the plugin's 26
    or 28 runs in one world, then the reference's in process). Without the attention check (until
    issue 29's third pass a variant of its own, 17 s and 23 s) each run would be these runs' write path alone: the
    same writes, judged here too. ``eagle-hybrid-hit`` under ``manager`` is the release's run of
    ``test_the_releases_hybrid_eagle_hit_is_short_and_the_fix_passes`` (its short hit, in its words)."""
    ascend, vllm = trees
    options = dict(engine="vllm-ascend", vllm_ascend_source=ascend, vllm_source=vllm, attention=True, timeout=120)
    builtins = builtin_names_at(W)  # gqa-pcp2-heads's heads are refused at W = 4 (exit 2 before the plugin)
    names, refused = [], {}
    for name in builtins:
        try:
            Job.from_options(builtin(name, W), **options)
            names.append(name)
        except ConfigError as exc:
            refused[name] = str(exc)
    assert set(KNOWN_BUGS) <= set(names), (names, refused)
    expected = {**REFUSED, **REFUSED_AT.get(W, {})}
    assert refused.keys() == expected.keys(), refused
    for name, fragment in expected.items():
        message = refused[name]
        assert message.startswith((f"vllm-ascend {NEWEST} ", f"vLLM {VLLM_OF[NEWEST]} ")) and fragment in message, message
    scenarios = [builtin(name, W) for name in names]
    jobs = [Job.from_options(sc, **options) for sc in scenarios]
    jobs += [Job.from_options(sc, vllm_scheduler="dcpsim", **options) for sc in scenarios]
    reports = run_jobs(jobs)  # one world per W: every job's ranks share it
    for k, (name, sc) in enumerate(zip(names, scenarios)):
        ref = run(sc, attention=True)
        assert ref.passed, name
        want = (ref.passed, ref.failure and ref.failure.kind, ref.steps, ref.verified_indices, ref.attention_checks)
        for scheduler, got in (("manager", reports[k]), ("dcpsim", reports[len(names) + k])):
            where = f"{name} at W = {W} under --vllm-scheduler {scheduler}"
            assert (got.engine["name"], got.engine["version"]) == ("vllm-ascend", NEWEST), got.engine
            assert got.engine["decisions"]["write_slots"].startswith("vllm-ascend vllm_ascend/worker/block_table.py"), got.engine
            if name in CASES:
                _every_decision_is_the_plugins(got)
            if name in KNOWN_BUGS and scheduler == "manager":
                assert not got.passed and got.failure.kind == KNOWN_BUGS[name], f"{where}:\n{got.text()}"
                _the_hit_is_short(got, W)
                continue
            have = (got.passed, got.failure and got.failure.kind, got.steps, got.verified_indices, got.attention_checks)
            if scheduler == "dcpsim":
                assert have == want, f"{where}: plugin {have} vs reference {want}\n{got.text()}"
            assert have[:2] == want[:2] and got.schedule["finished"] == len(sc.requests), f"{where}:\n{got.text()}"
            # every row of its dense groups by the plugin's all-to-all and combine, the rest by vLLM's
            merged = got.attention_merged_by.get(MERGED_BY, {})
            assert got.attention_checks > 0 and merged.get("rows") == merged.get("of") > 0, got.attention_merged_by
            assert sum(m["of"] for m in got.attention_merged_by.values()) == got.attention_query_tokens, got.attention_merged_by


def _every_decision_is_the_plugins(report) -> None:
    decisions = report.engine["decisions"]
    assert decisions["write_slots"].startswith("vllm-ascend vllm_ascend/worker/block_table.py::BlockTable._compute_pcp_dcp_slot_mapping")
    assert decisions["local_seq_lens"] == "vllm-ascend vllm_ascend/worker/pcp_utils.py::PCPManager._get_cp_local_seq_lens"
    assert decisions["spec_decode_mask"].startswith("vllm-ascend vllm_ascend/worker/pcp_utils.py::PCPManager.generate_mtp_attention_mask")
    assert "width: vllm-ascend vllm_ascend/worker/block_table.py::MultiGroupBlockTable.__init__" in decisions["group_geometry"]
    # every merge is the plugin's: its all-to-all and combine, over the rank's group
    assert decisions["merge_across_ranks"].startswith("vllm-ascend vllm_ascend.attention.context_parallel.common_cp._process_attn_out_lse")
    assert "_npu_attention_update" in report.text() and "merges" in report.text(), report.text()


COORDINATOR = "vllm_ascend/patch/platform/patch_kv_cache_coordinator.py"
MARGIN_FIX = (
    "_max_length = min(curr_hit_length + spec.block_size, max_cache_hit_length)",
    "_max_length = min(curr_hit_length + effective_block_size, max_cache_hit_length)",
)
"""The EAGLE margin in the group's own block, ``effective_block_size`` (``B * W``), in both lookups
of ``AscendHybridKVCacheCoordinator`` (what vLLM's own coordinator takes)."""


HIT = {4: (576, 512), 2: (608, 576)}
"""W -> (the prefix hit the cache allows ``eagle-hybrid-hit``, the release's short one)."""


def _the_hit_is_short(report, W: int) -> None:
    """The release's ``eagle-hybrid-hit`` at W (the sweep's run): its coordinator's hit is short."""
    right, short = HIT[W]
    assert f"request reader: a prefix-cache hit of {short} tokens where the cache allows {right}" in report.text(), report.text()
    decisions = report.engine["decisions"]
    assert "patch_kv_cache_coordinator.py::get_kv_cache_coordinator" in decisions["prefix_hit_tokens"], decisions


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("W", [4, 2], ids=["W4", "W2"])
def test_the_releases_hybrid_eagle_hit_is_short_and_the_fix_passes(W, trees, tmp_path):
    """With the margin fix planted the hit is the one the cache allows. The release's own run (the
    short hit, ``_the_hit_is_short``) is the sweep's: ``test_builtins_get_the_reference_verdicts_or_the_plugins_reason[W]``."""
    ascend, vllm = trees
    fixed = str(patched_copy(ascend, tmp_path / "fixed-margin", COORDINATOR, *MARGIN_FIX))
    [good] = run_batched([job_of("eagle-hybrid-hit", dcp=W, engine="vllm-ascend", vllm_ascend_source=fixed, vllm_source=vllm)])
    assert good.passed and good.to_dict()["schedule"]["prefix_hit_tokens"] == HIT[W][0], good.text()


SFA = "vllm_ascend/attention/context_parallel/sfa_cp.py"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("planted", [False, True], ids=["release-with-mask-fix", "remap-off-by-one"])
def test_sparse_attention_reads_the_keys_of_the_plugins_remap(planted, trees, fixed_mask, tmp_path):
    """dsv32-sparse at I = B = 64 (the platform's rule for sparse attention) with the attention
    check: the selection's local keys are the plugin's _remap_sparse_indices (compacted to the
    front); on the release with the verify-mask fix planted (bug class 39 would end the run at
    step 6 first) it passes; an off-by-one planted in the remap's local offset is an attention
    failure at step 0."""
    source = fixed_mask
    if planted:
        old = "            remapped_indices_fp32 = remapped_indices_fp32 * interleave_size + local_offsets\n"
        source = str(patched_copy(fixed_mask, tmp_path / "remap-bug", SFA, old, old.replace("local_offsets\n", "local_offsets + 1\n")))
    _, vllm = trees
    report = dcpsim.run(
        "dsv32-sparse", dcp=2, interleave=64, attention=True, engine="vllm-ascend", vllm_ascend_source=source, vllm_source=vllm
    )
    assert report.to_dict()["engine"]["decisions"]["sparse_local_keys"].startswith(
        f"vllm-ascend {SFA}::AscendSFADCPImpl._remap_sparse_indices"
    )
    if planted:
        assert not report.passed and report.failure.kind == "attention-mismatch" and report.failure.step == 0, report.text()
    else:
        assert report.passed, report.text()


SPLIT_BUG = (
    "tail_start_loc = positions_start_loc + (2 * self.pcp_world_size - rank - 1) * pcp_chunk_sizes",
    "tail_start_loc = positions_start_loc + (2 * self.pcp_world_size - rank - 2) * pcp_chunk_sizes",
)
"""A tail chunk one place early in ``update_tokens_for_pcp``: rank 1 recomputes its own head chunk,
and the last chunk of every split row is computed by no rank."""
_INDENT = " " * 20
_TAIL_NOMASK = f"list(range(kv_req_offset, kv_req_offset + chunk_len * q_{{}}_chunk_id))\n{_INDENT})\n{_INDENT}kv_with_q_tail_mask_idx"
KEYS_BUG = (_TAIL_NOMASK.format("tail"), _TAIL_NOMASK.format("head"))
"""The tail chunk's unmasked keys cut at the head chunk in ``generate_pcp_metadata`` (bug class 49)."""


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "bug, kind",
    [(None, None), (SPLIT_BUG, "wrong-content"), (KEYS_BUG, "attention-mask")],
    ids=["release", "tail-chunk-one-early", "tail-keys-cut"],
)
def test_a_pcp_run_splits_rows_by_the_plugins_dualchunkswap(bug, kind, trees, tmp_path):
    """``glm-pcp2-dcp2`` (TP 1, PCP 2, DCP spanning it: the plugin's PCP 2, DCP 1) on gloo: the
    rows are split, gathered and restored by the plugin's ``update_tokens_for_pcp`` and
    ``classify_decode_request_mask``, their attention key ranges are ``generate_pcp_metadata``'s,
    the slots, local lengths and widths are the plugin's over its PCP x DCP sizes, and the merge is
    its PCP all-gather and combine. A tail chunk planted one place early fails on wrong content;
    the tail chunk's unmasked keys cut at the head chunk fail the PCP prefill mask check."""
    ascend, vllm = trees
    if bug:
        ascend = str(patched_copy(ascend, tmp_path / "ascend-bug", "vllm_ascend/worker/pcp_utils.py", *bug))
    report = dcpsim.run("glm-pcp2-dcp2", engine="vllm-ascend", vllm_ascend_source=ascend, vllm_source=vllm, attention=not bug)
    decisions = report.to_dict()["engine"]["decisions"]
    assert decisions["pcp_chunks"].startswith("vllm-ascend vllm_ascend/worker/pcp_utils.py::PCPManager.update_tokens_for_pcp")
    assert decisions["pcp_replicated"].startswith("vllm-ascend vllm_ascend/worker/pcp_utils.py::PCPManager.classify_decode_request_mask")
    assert decisions["pcp_query_keys"].startswith("vllm-ascend vllm_ascend/worker/pcp_utils.py::PCPManager.generate_pcp_metadata")
    if bug:
        assert not report.passed and report.failure.kind == kind, report.text()
        if bug is KEYS_BUG:
            first = "rank 0 step 0 request doc-0 (PCP prefill): the query at position 192 does not see the key at position 0"
            assert first in report.text(), report.text()
        return
    text = report.text()
    assert report.passed and "attention checks matched the full-context reference" in text, text
    merged = re.search(re.escape(MERGED_BY) + r" \d+ merges, (\d+) of (\d+) rows", text)
    assert merged and merged.group(1) == merged.group(2) != "0", text


MLA_CP = "vllm_ascend/attention/context_parallel/mla_cp.py"
_LOCAL_CHUNK = """            cdiv(
                self.max_context_chunk,
                self.cp_virtual_block_size,
            )
            * self.cp_local_block_size"""
CHUNK_BUG = (_LOCAL_CHUNK, _LOCAL_CHUNK.replace("self.cp_virtual_block_size,", "self.cp_local_block_size * self.pcp_size,"))
"""The local chunk size of ``build_chunked_metadata`` padded over PCP alone, not PCP x DCP: each
rank's piece ``i`` starts ``i * piece / pcp`` rows into its shard instead of ``i * piece / (pcp * dcp)``."""


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, CHUNK_BUG], ids=["release", "chunk-not-over-dcp"])
def test_the_mla_builders_chunked_context_is_judged(bug, capsys, trees, tmp_path):
    """``dsv3 --dcp 2`` with a 256-row workspace (cached contexts from chunked prefills and prefix
    hits, cut into 128-token pieces): the plugin's ``build_chunked_metadata`` decides every rank's
    gather, which passes (with the attention check: the context is read through it); the chunk size
    planted undivided by DCP fails at the first split context, naming the chunk."""
    ascend, vllm = trees
    if bug:
        ascend = str(patched_copy(ascend, tmp_path / "ascend-bug", MLA_CP, *bug))
    argv = ["run", "dsv3", "--dcp", "2", "--chunked-prefill-workspace-size", "256", "--engine", "vllm-ascend"]
    argv += ["--vllm-ascend-source", ascend, "--vllm-source", vllm, "--json"] + ([] if bug else ["--attention"])
    code = main(argv)
    report = json.loads(capsys.readouterr().out)
    decision = report["engine"]["decisions"]["context_gather"]
    assert decision.startswith(f"vllm-ascend {MLA_CP}::AscendMlaCPMetadataBuilder.build_chunked_metadata"), decision
    if not bug:
        assert code == 0, report
        return
    assert code == 1 and report["failure"]["kind"] == "attention-metadata", report
    assert "context gather chunk 1 local_starts is 128, expected 64" in json.dumps(report), report
