"""The two Mamba-era faults, in one process (ranks as threads): each decision against the
reference engine beside it, then detection on the built-ins with the expected failure kind
(and the same scenario and config passing without the fault), and their place in selftest.

* ``mamba-block-size-scaled-by-w`` (vllm#49962): every group's manager block size B*W;
* ``dcp-transform-on-replicated`` (vllm#57260): the sharded slot transform on replicated groups.
"""

from __future__ import annotations

import numpy as np
import pytest

from dcpsim.campaigns.selftest_plan import BASELINE, plan_selftest
from dcpsim.engine.faults import FAULTS
from dcpsim.engine.reference import ReferenceEngine
from dcpsim.model.kinds import Retention, Storage
from dcpsim.model.layout import PAD
from dcpsim.model.plan import ReqWrite
from support.helpers import builtin, geometries
from support.helpers import run_fault as run

SCALED, TRANSFORM = FAULTS["mamba-block-size-scaled-by-w"], FAULTS["dcp-transform-on-replicated"]
NAME = "qwen3-next-hybrid"


def state_of(lays):
    (g,) = [g for g in lays if g.storage is Storage.STATE]
    return g


# ----------------------------------------------------------------------------- decisions


def test_scaled_fault_scales_the_mamba_manager_only():
    sc = builtin(NAME, 4, mamba_cache_mode="align", block_size=16)
    good, bad = geometries(sc), SCALED.geometries(sc.layers, sc.config)
    assert state_of(good).manager_block_size == 16 and state_of(bad).manager_block_size == 64
    # the attention group was B*W already and stays so; nothing else of the state changes
    assert [g.manager_block_size for g in good if g.sharded] == [g.manager_block_size for g in bad if g.sharded] == [64]
    assert state_of(bad).block_size == 16 and state_of(bad).block_table_width == state_of(good).block_table_width
    assert SCALED.applies_to(good)
    # none mode (the built-in's own): one block spans max_model_len, so the bug cannot show
    plain = builtin(NAME, 4)
    assert not SCALED.applies_to(geometries(plain))
    assert run(plain, SCALED.name).passed


def test_transform_fault_on_a_state_keeps_only_the_owners_write():
    sc = builtin(NAME, 2)
    g = state_of(geometries(sc))
    write = ReqWrite(0, "r", 700, np.arange(3, dtype=np.int64), num_drafts=2)  # states after 700, 701, 702
    row = np.array([5, 9, 4])
    good, index = ReferenceEngine().write_slots(g, write, row, 0)
    assert good.tolist() == [5, 9, 4] and index.tolist() == [700, 701, 702]
    for rank, owned in ((0, [700, 702]), (1, [701])):  # I = 1, W = 2: owner p % 2
        bad, _ = TRANSFORM.write_slots(g, write, row, rank)
        assert [int(p) for p, s in zip(index, bad) if s != PAD] == owned
        assert all(s == t for s, t in zip(bad, good) if s != PAD)  # one state a page: no offset


def test_transform_fault_on_a_sliding_window_uses_sharded_local_offsets():
    sc = builtin("gpt-oss-hybrid", 2, 1)
    (swa,) = [g for g in geometries(sc) if g.retention is Retention.WINDOW]
    write = ReqWrite(0, "r", 0, np.arange(40, dtype=np.int64))
    row = np.array([7, 3, 8])  # B = 16: positions 0-15, 16-31, 32-47
    good, _ = ReferenceEngine().write_slots(swa, write, row, 1)
    bad, _ = TRANSFORM.write_slots(swa, write, row, 1)
    np.testing.assert_array_equal(good[:16], 7 * 16 + np.arange(16))  # replicated: every position
    # sharded transform on rank 1: odd positions only, virtual block of 32 -> entry 0 for 0-31, 1 for 32-39
    assert (bad[0::2] == PAD).all()
    np.testing.assert_array_equal(bad[1:32:2], 7 * 16 + np.arange(16))  # p = 2j + 1 -> local j
    np.testing.assert_array_equal(bad[33:40:2], 3 * 16 + np.arange(4))


# ----------------------------------------------------------------------------- detection

CASES = [
    (SCALED.name, NAME, dict(W=2, mamba_cache_mode="align", block_size=16), "write-violation"),
    (SCALED.name, NAME, dict(W=4, mamba_cache_mode="align", block_size=16), "write-violation"),
    (TRANSFORM.name, NAME, dict(W=2), "wrong-content"),
    (TRANSFORM.name, NAME, dict(W=4, I=16), "wrong-content"),
    (TRANSFORM.name, NAME, dict(W=2, mamba_cache_mode="align", block_size=16), "wrong-content"),
    (TRANSFORM.name, "gpt-oss-hybrid", dict(W=2), "wrong-content"),
    (TRANSFORM.name, "llama4-chunked", dict(W=2), "wrong-content"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fault,name,options,kind", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_fault_is_detected_and_the_same_config_passes_without_it(fault, name, options, kind):
    options = dict(options)
    sc = builtin(name, options.pop("W"), options.pop("I", 1), **options)
    assert FAULTS[fault].applies_to_scenario(sc, geometries(sc))
    clean = run(sc)
    assert clean.passed, clean.failure and clean.failure.lines()
    f = run(sc, fault).failure
    assert f is not None and f.kind == kind, f and f.lines()
    if name == NAME:
        assert f.group.startswith("Mamba[")
    if fault == SCALED.name:  # the kernel's state column is past the manager's short row
        assert any("null block 0" in d for d in f.details)
    if fault == TRANSFORM.name:
        assert f.expected_owner == "all"


def test_selftest_runs_both_on_the_mamba_builtin_and_skips_identical_baselines():
    # prefix-hash-unit-B runs dsv3 at B = 16, so dsv3 has a B = 16 baseline of its own
    plan = plan_selftest(["prefix-hash-unit-B", SCALED.name, TRANSFORM.name], [NAME, "dsv3", "gpt-oss-hybrid"], dry_run=False)
    where = {}
    for c in plan.cases:
        where.setdefault(c.fault, set()).add(c.scenario)
    assert where[SCALED.name] == {NAME}
    assert where[TRANSFORM.name] == {NAME, "gpt-oss-hybrid"}  # dsv3 has no replicated group
    align = next(c.options for c in plan.cases if c.fault == SCALED.name)
    assert dict(align) == {"mamba_cache_mode": "align", "block_size": 16}
    # the align config changes only Mamba layers: its baseline runs on the Mamba built-in alone...
    runs = {(c.scenario, c.options) for c in plan.cases if c.fault == BASELINE}
    assert (NAME, align) in runs and ("dsv3", align) not in runs and ("gpt-oss-hybrid", align) not in runs
    # ...and elsewhere it is skipped as the same run as another baseline: the B = 16 one (the
    # align config sets the cache block size, so even gpt-oss-hybrid, whose pages are 16 tokens
    # already, matches its B = 16 baseline rather than its own config)
    same = {s["scenario"]: s["reason"] for s in plan.skipped if s["fault"] == BASELINE and s["options"] == dict(align)}
    assert same == {"dsv3": "the same run as its baseline in config B=16", "gpt-oss-hybrid": "the same run as its baseline in config B=16"}
